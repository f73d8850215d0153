//! Periodic schedules: a cron expression in a time zone that fires jobs.
//! Each schedule is a hash-chained stream of its own (created, paused,
//! resumed, deleted, and every slot fired or skipped), decided and replayed
//! here with no I/O. A slot fires at most once: a firing's slot must lie
//! after the schedule's cursor, and firing moves the cursor to it.
//!
//! Daylight-saving time (the cron crate's rules, pinned by tests): a slot
//! whose local time falls in a spring-forward gap fires once, at the first
//! instant after the gap; a slot whose local time occurs twice on a
//! fall-back day fires once, at its first occurrence.

use chrono::{DateTime, Duration, TimeZone, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::digest::{canonical_json, fmt_time};

/// A slot younger than this when the scheduler sees it is on time; older
/// ones are missed, and the schedule's policy decides what becomes of them.
pub const ON_TIME_MS: i64 = 60_000;
/// No plan walks more slots than this in one step (a per-second schedule
/// after a day and more of downtime); the rest wait for the next tick.
pub const MAX_SLOTS_WALKED: usize = 100_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Missed {
    /// Missed slots never fire.
    Skip,
    /// After downtime, one firing (the latest missed slot) stands for all.
    Once,
    /// Every missed slot fires, the latest `max_catch_up` of them.
    All,
}

/// What a schedule fires.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleSpec {
    pub cron: String,
    #[serde(default = "utc")]
    pub tz: String,
    pub queue: String,
    pub kind: String,
    #[serde(default)]
    pub payload: Value,
    #[serde(default)]
    pub priority: i16,
    pub missed: Missed,
    #[serde(default)]
    pub max_catch_up: u32,
}

fn utc() -> String {
    "UTC".into()
}

/// The parsed expression and zone, or a one-line reason.
pub fn parse(spec: &ScheduleSpec) -> Result<(croner::Cron, Tz), String> {
    let cron = croner::Cron::new(&spec.cron)
        .with_seconds_optional()
        .parse()
        .map_err(|e| format!("cron expression {:?}: {e}", spec.cron))?;
    let tz: Tz = spec
        .tz
        .parse()
        .map_err(|_| format!("time zone {:?} is not an IANA zone name", spec.tz))?;
    if spec.max_catch_up > 1000 {
        return Err(format!("max catch-up {} is over 1000", spec.max_catch_up));
    }
    Ok((cron, tz))
}

/// The first slot strictly after `after`. A local time that occurs twice
/// (a fall-back day) is a slot in its first pass only: croner maps it
/// there, so when `after` lies in the second pass the next slot is the
/// first at or after the end of the repeated hour.
pub fn next_slot(cron: &croner::Cron, tz: &Tz, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
    use chrono::{LocalResult, Timelike};
    let local = tz.from_utc_datetime(&after.naive_utc());
    let next = cron.find_next_occurrence(&local, false).ok()?.with_timezone(&Utc);
    if next > after {
        return Some(next);
    }
    // Folds start and end on whole minutes; walk to the first local minute
    // that is not ambiguous (at most a day of minutes, in practice 60).
    let mut n = local.naive_local().with_second(0)?.with_nanosecond(0)?;
    for _ in 0..(24 * 60) {
        if !matches!(tz.from_local_datetime(&n), LocalResult::Ambiguous(..)) {
            break;
        }
        n += Duration::minutes(1);
    }
    let start = tz.from_local_datetime(&n).earliest()?;
    let next = cron.find_next_occurrence(&start, true).ok()?.with_timezone(&Utc);
    (next > after).then_some(next)
}

/// Slots missed and not fired, as the `skipped` event records them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    pub first: DateTime<Utc>,
    pub last: DateTime<Utc>,
    pub count: u64,
}

/// What one scheduler step does for a schedule at `now`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// Slots to fire, oldest first.
    pub fire: Vec<DateTime<Utc>>,
    pub skipped: Option<Skipped>,
}

/// Every slot in (cursor, now], split by the missed-slot policy.
pub fn plan(spec: &ScheduleSpec, cursor: DateTime<Utc>, now: DateTime<Utc>) -> Result<Plan, String> {
    let (cron, tz) = parse(spec)?;
    let mut due = vec![];
    let mut at = cursor;
    while due.len() < MAX_SLOTS_WALKED {
        match next_slot(&cron, &tz, at) {
            Some(s) if s <= now => {
                due.push(s);
                at = s;
            }
            _ => break,
        }
    }
    let Some(&latest) = due.last() else {
        return Ok(Plan::default());
    };
    if due.len() == MAX_SLOTS_WALKED {
        // More may follow: these are all missed, and the policy applies
        // once, to the last stretch (so `once` fires once and `all` at most
        // its catch-up however long the outage).
        return Ok(Plan {
            fire: vec![],
            skipped: Some(Skipped {
                first: due[0],
                last: latest,
                count: due.len() as u64,
            }),
        });
    }
    let on_time = (now - latest).num_milliseconds() < ON_TIME_MS;
    let missed = if on_time { &due[..due.len() - 1] } else { &due[..] };
    let mut fire: Vec<DateTime<Utc>> = match spec.missed {
        Missed::Skip => vec![],
        Missed::Once => missed.last().copied().into_iter().collect(),
        Missed::All => missed[missed.len().saturating_sub(spec.max_catch_up as usize)..].to_vec(),
    };
    if on_time {
        fire.push(latest);
    }
    let unfired: Vec<&DateTime<Utc>> = due.iter().filter(|s| !fire.contains(s)).collect();
    let skipped = match (unfired.first(), unfired.last()) {
        (Some(f), Some(l)) => Some(Skipped {
            first: **f,
            last: **l,
            count: unfired.len() as u64,
        }),
        _ => None,
    };
    Ok(Plan { fire, skipped })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleAction {
    Created,
    Paused,
    Resumed,
    Deleted,
    Fired,
    Skipped,
}

const ACTIONS: [(ScheduleAction, &str); 6] = [
    (ScheduleAction::Created, "created"),
    (ScheduleAction::Paused, "paused"),
    (ScheduleAction::Resumed, "resumed"),
    (ScheduleAction::Deleted, "deleted"),
    (ScheduleAction::Fired, "fired"),
    (ScheduleAction::Skipped, "skipped"),
];

impl ScheduleAction {
    pub fn as_str(self) -> &'static str {
        ACTIONS.iter().find(|(a, _)| *a == self).expect("named").1
    }

    pub fn parse(s: &str) -> Option<Self> {
        ACTIONS.iter().find(|(_, n)| *n == s).map(|(a, _)| *a)
    }
}

/// What is asked of a schedule (firings and skips by the scheduler).
#[derive(Clone, Debug, PartialEq)]
pub enum ScheduleCommand {
    Create(ScheduleSpec),
    Pause,
    Resume,
    Delete,
    Fire { slot: DateTime<Utc>, job_id: uuid::Uuid },
    Skip(Skipped),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScheduleEvent {
    pub name: String,
    pub version: i64,
    pub action: ScheduleAction,
    pub actor: String,
    pub reason: String,
    pub data: Value,
    pub recorded_at: DateTime<Utc>,
    pub prev_hash: Option<String>,
    pub hash: String,
}

/// A schedule as its events leave it (version 0: never created).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScheduleState {
    pub name: String,
    pub spec: Option<ScheduleSpec>,
    pub paused: bool,
    pub deleted: bool,
    /// Every slot at or before it was fired or skipped.
    pub cursor: DateTime<Utc>,
    pub version: i64,
    pub last_hash: Option<String>,
}

impl ScheduleState {
    pub fn live(&self) -> bool {
        self.version > 0 && !self.deleted
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScheduleRefusal {
    /// Nothing to record (pausing a paused schedule).
    Already(&'static str),
    /// Not possible in this state, or bad terms.
    Invalid(String),
}

/// The event a command appends, or why none is due.
pub fn decide_schedule(
    s: &ScheduleState,
    cmd: &ScheduleCommand,
    actor: &str,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<ScheduleEvent, ScheduleRefusal> {
    use ScheduleCommand as C;
    let gone = || ScheduleRefusal::Invalid(format!("there is no schedule {:?}", s.name));
    let (action, data) = match cmd {
        C::Create(spec) if s.live() && s.spec.as_ref() == Some(spec) => {
            return Err(ScheduleRefusal::Already("the schedule exists with this spec"))
        }
        C::Create(_) if s.live() => {
            return Err(ScheduleRefusal::Invalid(format!(
                "a schedule {:?} exists with another spec: delete it first",
                s.name
            )))
        }
        C::Create(spec) => {
            let (cron, tz) = parse(spec).map_err(ScheduleRefusal::Invalid)?;
            if next_slot(&cron, &tz, now).is_none() {
                return Err(ScheduleRefusal::Invalid(format!(
                    "cron expression {:?} never fires",
                    spec.cron
                )));
            }
            (
                ScheduleAction::Created,
                json!({ "spec": spec, "cursor": fmt_time(now) }),
            )
        }
        _ if !s.live() => return Err(gone()),
        C::Pause if s.paused => return Err(ScheduleRefusal::Already("the schedule is already paused")),
        C::Resume if !s.paused => return Err(ScheduleRefusal::Already("the schedule is not paused")),
        C::Pause => (ScheduleAction::Paused, json!({})),
        // Slots while paused were declined by the pause, not missed.
        C::Resume => (
            ScheduleAction::Resumed,
            json!({ "cursor": fmt_time(now.max(s.cursor)) }),
        ),
        C::Delete => (ScheduleAction::Deleted, json!({})),
        C::Fire { .. } | C::Skip(_) if s.paused => {
            return Err(ScheduleRefusal::Invalid("the schedule is paused".into()))
        }
        C::Fire { slot, .. } if *slot <= s.cursor => {
            return Err(ScheduleRefusal::Already("the slot was already fired or skipped"))
        }
        C::Fire { slot, job_id } => (
            ScheduleAction::Fired,
            json!({ "slot": fmt_time(*slot), "job_id": job_id }),
        ),
        C::Skip(k) if k.first <= s.cursor || k.last < k.first => {
            return Err(ScheduleRefusal::Already(
                "the slots were already fired or skipped",
            ))
        }
        C::Skip(k) => (ScheduleAction::Skipped, json!(k)),
    };
    let mut e = ScheduleEvent {
        name: s.name.clone(),
        version: s.version + 1,
        action,
        actor: actor.into(),
        reason: reason.into(),
        data,
        recorded_at: now,
        prev_hash: s.last_hash.clone(),
        hash: String::new(),
    };
    e.hash = schedule_event_hash(&e);
    Ok(e)
}

fn time_in(e: &ScheduleEvent, field: &str) -> Result<DateTime<Utc>, String> {
    e.data
        .get(field)
        .and_then(Value::as_str)
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc))
        .ok_or_else(|| format!("schedule {:?} v{}: no time in {field:?}", e.name, e.version))
}

/// Folds one event; refuses one that does not follow its chain or would
/// fire a slot twice.
pub fn apply_schedule(s: &ScheduleState, e: &ScheduleEvent) -> Result<ScheduleState, String> {
    let at = format!("schedule {:?} v{}", e.name, e.version);
    if e.version != s.version + 1 || e.prev_hash != s.last_hash {
        return Err(format!("{at}: does not follow v{}", s.version));
    }
    if e.hash != schedule_event_hash(e) {
        return Err(format!("{at}: the hash does not match the event"));
    }
    let mut n = s.clone();
    n.name = e.name.clone();
    let live = s.live();
    match e.action {
        ScheduleAction::Created if !live => {
            let spec =
                serde_json::from_value(e.data["spec"].clone()).map_err(|err| format!("{at}: {err}"))?;
            n = ScheduleState {
                spec: Some(spec),
                cursor: time_in(e, "cursor")?,
                ..ScheduleState::default()
            };
            n.name = e.name.clone();
        }
        ScheduleAction::Paused if live && !s.paused => n.paused = true,
        ScheduleAction::Resumed if live && s.paused => {
            n.paused = false;
            n.cursor = time_in(e, "cursor")?.max(s.cursor);
        }
        ScheduleAction::Deleted if live => n.deleted = true,
        ScheduleAction::Fired | ScheduleAction::Skipped if live && !s.paused => {
            let slot = time_in(
                e,
                if e.action == ScheduleAction::Fired {
                    "slot"
                } else {
                    "last"
                },
            )?;
            if slot <= s.cursor {
                return Err(format!(
                    "{at}: slot {} is not after the cursor {}",
                    fmt_time(slot),
                    fmt_time(s.cursor)
                ));
            }
            n.cursor = slot;
        }
        a => {
            return Err(format!(
                "{at}: {} does not follow the schedule's state",
                a.as_str()
            ))
        }
    }
    n.version = e.version;
    n.last_hash = Some(e.hash.clone());
    Ok(n)
}

/// SHA-256 of the event's canonical JSON (everything but the hash).
pub fn schedule_event_hash(e: &ScheduleEvent) -> String {
    use sha2::{Digest, Sha256};
    let v = json!({
        "name": e.name, "version": e.version, "action": e.action.as_str(), "actor": e.actor,
        "reason": e.reason, "data": e.data, "at": fmt_time(e.recorded_at), "prev": e.prev_hash,
    });
    hex::encode(Sha256::digest(canonical_json(&v).as_bytes()))
}

#[cfg(test)]
mod tests;
