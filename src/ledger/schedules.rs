//! Periodic schedules (domain::schedule): operators' changes and the
//! scheduler's firings, each appended to the schedule's own stream with the
//! state it leaves, in one transaction. A firing enqueues its job in that
//! same transaction, keyed by (schedule, slot), after checking the
//! scheduler's fenced lease; so a slot fires once whatever happens: two
//! schedulers (one is fenced out), a restart (the cursor is in the
//! database), a clock step (slots at or before the cursor never fire).

use chrono::{DateTime, Duration, Utc};
use serde_json::json;
use sqlx::PgConnection;

use super::error::{LedgerError, LedgerResult};
use super::validate::typed;
use super::Ledger;
use crate::domain::digest::fmt_time;
use crate::domain::schedule::{
    apply_schedule, decide_schedule, next_slot, parse, plan, ScheduleAction, ScheduleCommand, ScheduleEvent,
    ScheduleRefusal, ScheduleSpec, ScheduleState,
};
use crate::domain::NewJob;
use crate::store::queues::the_clock;
use crate::store::schedules::{self as st, ScheduleEventRow, ScheduleRow};
use crate::store::StoreError;

/// Schedule names leave room for the slot in the firing's job key.
const MAX_SCHEDULE_NAME: usize = 160;

/// A schedule as `schedule list` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScheduleStatus {
    pub name: String,
    pub spec: ScheduleSpec,
    pub paused: bool,
    pub deleted: bool,
    /// Every slot at or before it was fired or skipped.
    pub cursor: DateTime<Utc>,
    /// The next slot after the cursor (none for a deleted schedule).
    pub next_slot: Option<DateTime<Utc>>,
    pub version: i64,
}

/// What one scheduler step did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Firing {
    /// (schedule, slot, job) per slot fired.
    pub fired: Vec<(String, DateTime<Utc>, uuid::Uuid)>,
    pub skipped: u64,
    /// False: this scheduler's lease was not current; nothing was fired.
    pub fenced_out: bool,
}

/// The job key of a schedule's slot: the same slot, the same key.
pub fn slot_key(name: &str, slot: DateTime<Utc>) -> String {
    format!("schedule:{name}:{}", fmt_time(slot))
}

fn state_of(name: &str, row: Option<&ScheduleRow>) -> LedgerResult<ScheduleState> {
    let Some(r) = row else {
        return Ok(ScheduleState {
            name: name.into(),
            ..Default::default()
        });
    };
    let spec = serde_json::from_value(r.spec.clone())
        .map_err(|e| StoreError::Corrupt(format!("schedule {name:?} spec: {e}")))?;
    Ok(ScheduleState {
        name: name.into(),
        spec: Some(spec),
        paused: r.paused,
        deleted: r.deleted,
        cursor: r.cursor_at,
        version: r.version,
        last_hash: Some(r.last_hash.clone()),
    })
}

fn to_event(r: ScheduleEventRow) -> LedgerResult<ScheduleEvent> {
    Ok(ScheduleEvent {
        action: ScheduleAction::parse(&r.action)
            .ok_or_else(|| StoreError::Corrupt(format!("schedule action {:?}", r.action)))?,
        name: r.name,
        version: r.version,
        actor: r.actor,
        reason: r.reason,
        data: r.data,
        recorded_at: r.recorded_at,
        prev_hash: r.prev_hash,
        hash: r.hash,
    })
}

fn status_of(s: &ScheduleState) -> Option<ScheduleStatus> {
    let spec = s.spec.clone()?;
    let next = parse(&spec)
        .ok()
        .filter(|_| !s.deleted)
        .and_then(|(c, tz)| next_slot(&c, &tz, s.cursor));
    Some(ScheduleStatus {
        name: s.name.clone(),
        spec,
        paused: s.paused,
        deleted: s.deleted,
        cursor: s.cursor,
        next_slot: next,
        version: s.version,
    })
}

/// Decides, appends and stores one event under the schedule's lock.
async fn append(
    conn: &mut PgConnection,
    s: &ScheduleState,
    cmd: &ScheduleCommand,
    actor: &str,
    reason: &str,
    now: DateTime<Utc>,
) -> LedgerResult<Result<ScheduleState, ScheduleRefusal>> {
    let e = match decide_schedule(s, cmd, actor, reason, now) {
        Ok(e) => e,
        Err(r) => return Ok(Err(r)),
    };
    let next = apply_schedule(s, &e).map_err(LedgerError::BadInput)?;
    let row = ScheduleEventRow {
        name: e.name.clone(),
        version: e.version,
        action: e.action.as_str().into(),
        actor: e.actor.clone(),
        reason: e.reason.clone(),
        data: e.data.clone(),
        recorded_at: e.recorded_at,
        prev_hash: e.prev_hash.clone(),
        hash: e.hash.clone(),
    };
    let state = ScheduleRow {
        name: next.name.clone(),
        spec: json!(next.spec),
        paused: next.paused,
        deleted: next.deleted,
        cursor_at: next.cursor,
        version: next.version,
        last_hash: e.hash.clone(),
    };
    st::append_schedule_event(conn, &row, &state).await?;
    Ok(Ok(next))
}

impl Ledger {
    pub async fn create_schedule(
        &self,
        name: &str,
        spec: &ScheduleSpec,
        operator: &str,
        reason: &str,
    ) -> LedgerResult<ScheduleStatus> {
        self.check_new(&slot_job(spec, name, Utc::now()))?;
        self.change_schedule(name, ScheduleCommand::Create(spec.clone()), operator, reason)
            .await
    }

    pub async fn pause_schedule(
        &self,
        name: &str,
        operator: &str,
        reason: &str,
    ) -> LedgerResult<ScheduleStatus> {
        self.change_schedule(name, ScheduleCommand::Pause, operator, reason)
            .await
    }

    pub async fn resume_schedule(
        &self,
        name: &str,
        operator: &str,
        reason: &str,
    ) -> LedgerResult<ScheduleStatus> {
        self.change_schedule(name, ScheduleCommand::Resume, operator, reason)
            .await
    }

    /// Deletes the schedule: it fires no more; its stream stays (and the
    /// name may be created again, continuing the stream).
    pub async fn delete_schedule(
        &self,
        name: &str,
        operator: &str,
        reason: &str,
    ) -> LedgerResult<ScheduleStatus> {
        self.change_schedule(name, ScheduleCommand::Delete, operator, reason)
            .await
    }

    async fn change_schedule(
        &self,
        name: &str,
        cmd: ScheduleCommand,
        operator: &str,
        reason: &str,
    ) -> LedgerResult<ScheduleStatus> {
        self.limits.name("schedule", name)?;
        typed("schedule", name)?;
        if name.len() > MAX_SCHEDULE_NAME {
            return Err(LedgerError::BadInput(format!(
                "a schedule name is at most {MAX_SCHEDULE_NAME} bytes"
            )));
        }
        self.limits.control("operator", operator, reason)?;
        let mut tx = self.pool.begin().await?;
        let row = st::lock_schedule(&mut tx, name).await?;
        let s = state_of(name, row.as_ref())?;
        let now = the_clock(&mut tx).await?;
        let next = match append(&mut tx, &s, &cmd, operator, reason, now).await? {
            Ok(next) => next,
            // Nothing to record: the schedule as it is.
            Err(ScheduleRefusal::Already(_)) => s,
            Err(ScheduleRefusal::Invalid(why)) => return Err(LedgerError::BadInput(why)),
        };
        tx.commit().await?;
        status_of(&next).ok_or_else(|| LedgerError::BadInput(format!("there is no schedule {name:?}")))
    }

    /// Every schedule ever created (deleted ones say so).
    pub async fn schedules(&self) -> LedgerResult<Vec<ScheduleStatus>> {
        let mut out = vec![];
        for r in st::schedules(&self.pool).await? {
            out.extend(status_of(&state_of(&r.name, Some(&r))?));
        }
        Ok(out)
    }

    /// A schedule's events, oldest first: changes, firings and skips.
    pub async fn schedule_history(&self, name: &str) -> LedgerResult<Vec<ScheduleEvent>> {
        st::schedule_events(&self.pool, Some(name))
            .await?
            .into_iter()
            .map(to_event)
            .collect()
    }

    /// One scheduler step under lease `token`: for every active schedule,
    /// the slots due by the database clock (moved by `skew`, a drill knob:
    /// a stepped clock), fired and skipped per its policy. Each schedule in
    /// its own transaction; one that fails is logged and left for the next
    /// step.
    pub async fn fire_due(&self, token: i64, skew: Duration) -> LedgerResult<Firing> {
        let mut out = Firing::default();
        for name in st::active_schedule_names(&self.pool).await? {
            match self.fire_schedule(&name, token, skew, &mut out).await {
                Ok(true) => {}
                Ok(false) => {
                    out.fenced_out = true;
                    return Ok(out);
                }
                Err(e) => tracing::warn!(schedule = %name, "firing failed: {e}"),
            }
        }
        Ok(out)
    }

    /// False when the lease is no longer ours (nothing written).
    async fn fire_schedule(
        &self,
        name: &str,
        token: i64,
        skew: Duration,
        out: &mut Firing,
    ) -> LedgerResult<bool> {
        let mut tx = self.pool.begin().await?;
        if !st::hold_scheduler_fence(&mut tx, token).await? {
            return Ok(false);
        }
        let row = st::lock_schedule(&mut tx, name).await?;
        let mut s = state_of(name, row.as_ref())?;
        let (Some(spec), true, false) = (s.spec.clone(), s.live(), s.paused) else {
            return Ok(true);
        };
        let now = the_clock(&mut tx).await? + skew;
        let p = plan(&spec, s.cursor, now).map_err(LedgerError::BadInput)?;
        if let Some(k) = p.skipped.clone() {
            out.skipped += k.count;
            let why = format!("missed ({:?} policy)", spec.missed).to_lowercase();
            s = step(&mut tx, &s, &ScheduleCommand::Skip(k), &why, now).await?;
        }
        let jobs = p
            .fire
            .iter()
            .map(|slot| (slot_job(&spec, name, *slot), None))
            .collect();
        let enqueued = self
            .enqueue_drafts_in(&mut tx, jobs, super::enqueue::SCHEDULER, None)
            .await?;
        for (slot, e) in p.fire.iter().zip(enqueued) {
            let fire = ScheduleCommand::Fire {
                slot: *slot,
                job_id: e.job.job_id,
            };
            s = step(&mut tx, &s, &fire, "slot due", now).await?;
            out.fired.push((name.to_string(), *slot, e.job.job_id));
        }
        tx.commit().await?;
        Ok(true)
    }

    /// Replays every schedule's stream against `jobledger.schedules`. One
    /// line per problem; run it inside verify's snapshot.
    pub async fn verify_schedules_in(&self, conn: &mut PgConnection) -> LedgerResult<Vec<String>> {
        let mut problems = vec![];
        let mut folded: std::collections::BTreeMap<String, ScheduleState> = Default::default();
        for r in st::schedule_events(&mut *conn, None).await? {
            let e = to_event(r)?;
            let s = folded.entry(e.name.clone()).or_insert_with(|| ScheduleState {
                name: e.name.clone(),
                ..Default::default()
            });
            match apply_schedule(s, &e) {
                Ok(next) => *s = next,
                Err(why) => problems.push(why),
            }
        }
        for row in st::schedules(&mut *conn).await? {
            let f = folded.remove(&row.name).unwrap_or_default();
            let stored = state_of(&row.name, Some(&row))?;
            if stored != f {
                problems.push(format!(
                    "schedule {:?}: the state (v{}) is not what its events leave (v{})",
                    row.name, row.version, f.version
                ));
            }
        }
        for (name, _) in folded {
            problems.push(format!("schedule {name:?}: events without a state row"));
        }
        Ok(problems)
    }
}

/// One scheduler event; a refusal here means the plan and the state
/// disagree, which the transaction must not commit.
async fn step(
    conn: &mut PgConnection,
    s: &ScheduleState,
    cmd: &ScheduleCommand,
    why: &str,
    now: DateTime<Utc>,
) -> LedgerResult<ScheduleState> {
    append(conn, s, cmd, "scheduler", why, now)
        .await?
        .map_err(|r| LedgerError::BadInput(format!("schedule {:?}: {r:?}", s.name)))
}

/// The job a slot fires.
fn slot_job(spec: &ScheduleSpec, name: &str, slot: DateTime<Utc>) -> NewJob {
    NewJob {
        queue: spec.queue.clone(),
        kind: spec.kind.clone(),
        job_key: Some(slot_key(name, slot)),
        payload: spec.payload.clone(),
        priority: spec.priority,
        run_at: None,
        delay_ms: None,
        policy: None,
        concurrency_key: None,
        unique_for_ms: None,
    }
}

impl Ledger {
    /// The scheduler lease (one active scheduler per database): its token,
    /// or None while another holder's lease runs.
    pub async fn acquire_scheduler_lease(
        &self,
        holder: &str,
        lease: std::time::Duration,
    ) -> LedgerResult<Option<i64>> {
        Ok(st::acquire_scheduler_lease(&self.pool, holder, super::lease::millis(lease)).await?)
    }

    /// False when the lease lapsed or another scheduler took it.
    pub async fn renew_scheduler_lease(&self, token: i64, lease: std::time::Duration) -> LedgerResult<bool> {
        Ok(st::renew_scheduler_lease(&self.pool, token, super::lease::millis(lease)).await?)
    }
}
