//! Claims, operator and API operations, and reads.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use std::time::Duration;
use tracing::instrument;
use uuid::Uuid;

use super::engine::{decide_and_write, run_transition, transition_in, WriteResult};
use super::error::{LedgerError, LedgerResult};
use super::lease::{millis, Lease};
use super::Ledger;
use crate::domain::{Command, Event, Fence, Job, ReceiptStatus};
use crate::store::jobs::Locked;
use crate::store::rejections::{self, RejectionRow};
use crate::store::{events, jobs, tombstones, TombstoneRow};
use crate::telemetry::{self, Spans};
use sqlx::PgConnection;

/// One event of a job's history, with its global position.
#[derive(Debug, Clone, Serialize)]
pub struct HistoryEntry {
    pub position: i64,
    #[serde(flatten)]
    pub event: Event,
}

/// One event of the log in `replay-log`: a job's, or one of the log's own
/// (a signed checkpoint, docs/audit.md), shown as stored.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum LogEntry {
    Job(HistoryEntry),
    Log {
        position: i64,
        #[serde(flatten)]
        row: crate::store::EventRow,
    },
}

impl LogEntry {
    pub fn position(&self) -> i64 {
        match self {
            LogEntry::Job(h) => h.position,
            LogEntry::Log { position, .. } => *position,
        }
    }
}

/// What `show` finds: a live job or what is left of a purged one.
#[derive(Debug, Clone)]
pub enum Found {
    Live(Box<Job>),
    Purged(TombstoneRow),
}

/// Decides and writes the claims of the locked jobs, each under its own
/// `jobledger.claim` span: a child of its job's enqueue, from `started` (the
/// claim's start) to the caller's commit. Its `claimed` event names it.
pub(super) async fn write_claims(
    conn: &mut PgConnection,
    locked: Vec<Locked>,
    holder: &str,
    lease_ms: i64,
    started: std::time::SystemTime,
) -> LedgerResult<(Vec<WriteResult>, Spans)> {
    let spans = Spans::start(
        "jobledger.claim",
        started,
        locked.iter().map(|l| {
            let mut attrs = telemetry::job_attrs(l.row.job_id, l.row.epoch, l.row.token + 1);
            attrs.push(opentelemetry::KeyValue::new("queue", l.row.queue.clone()));
            attrs.push(opentelemetry::KeyValue::new("holder", holder.to_string()));
            (
                l.row.job_id,
                telemetry::parent_for(l.row.traceparent.as_deref()),
                attrs,
            )
        }),
    );
    let cmd = |_: &Job| Command::Claim {
        holder: holder.to_string(),
        lease_ms,
    };
    let results = spans.around(decide_and_write(conn, locked, holder, cmd)).await?;
    Ok((results, spans))
}

impl Ledger {
    /// Claims up to `limit` jobs of `queue`: expired leases under the
    /// reconcile policy first (taken over, next action reconcile), then due
    /// queued jobs. One short transaction; nothing is held afterwards.
    // Debug: a worker polls; each claimed job has its own `jobledger.claim`
    // span (a trace per poll would bury them).
    #[instrument(level = "debug", skip(self), fields(queue = %queue, holder = %holder))]
    pub async fn claim(
        &self,
        queue: &str,
        holder: &str,
        lease: Duration,
        limit: i64,
    ) -> LedgerResult<Vec<Lease>> {
        self.limits.name("worker id", holder)?;
        self.limits.name("queue", queue)?;
        self.limits.lease(lease)?;
        if limit < 1 {
            return Ok(vec![]);
        }
        let lease_ms = millis(lease);
        let started = std::time::SystemTime::now();
        let mut tx = self.pool.begin().await?;
        let locked = jobs::lock_claimable(&mut tx, queue, holder, limit).await?;
        if locked.is_empty() {
            drop(tx);
            // Nothing claimable, or a queue with controls (docs/admission.md).
            let (paused, limited) = crate::store::admission::queue_is_controlled(&self.pool, queue).await?;
            if limited && !paused {
                return self.claim_limited(queue, holder, lease_ms, limit).await;
            }
            return Ok(vec![]);
        }
        let (results, spans) = write_claims(&mut tx, locked, holder, lease_ms, started).await?;
        tx.commit().await?;
        Ok(self.leases_of(results, spans))
    }

    /// The leases the committed claims handed out, each continuing its own
    /// claim span (which ends here, with the claim's commit).
    pub(super) fn leases_of(&self, results: Vec<WriteResult>, spans: Spans) -> Vec<Lease> {
        let leases = results
            .into_iter()
            .filter_map(|r| Lease::from_claim_owned(self, r))
            .map(|l| {
                let trace = spans.trace(l.job_id());
                l.under(trace)
            })
            .collect();
        spans.end();
        leases
    }

    pub(super) async fn transition(
        &self,
        job_id: Uuid,
        actor: &str,
        cmd: Command,
    ) -> LedgerResult<WriteResult> {
        run_transition(&self.pool, job_id, actor, cmd).await
    }

    /// Claims (or takes over) one named job, waiting for its row lock rather
    /// than skipping it: an operator's "take this stuck job now".
    #[instrument(skip(self), fields(job_id = %job_id, holder = %holder))]
    pub async fn claim_job(
        &self,
        job_id: Uuid,
        holder: &str,
        lease: Duration,
    ) -> LedgerResult<(WriteResult, Option<Lease>)> {
        self.limits.name("worker id", holder)?;
        self.limits.lease(lease)?;
        let cmd = Command::Claim {
            holder: holder.to_string(),
            lease_ms: millis(lease),
        };
        let out = run_transition(&self.pool, job_id, holder, cmd).await?;
        let lease = Lease::from_claim(self, &out);
        Ok((out, lease))
    }

    #[instrument(skip(self, note), fields(job_id = %job_id))]
    pub async fn cancel(&self, job_id: Uuid, note: Option<&str>) -> LedgerResult<WriteResult> {
        self.cancel_as(job_id, "api", note).await
    }

    /// `cancel`, recorded with `actor` (an operator's or token's name).
    pub async fn cancel_as(
        &self,
        job_id: Uuid,
        actor: &str,
        note: Option<&str>,
    ) -> LedgerResult<WriteResult> {
        self.limits.name("actor", actor)?;
        if let Some(n) = note {
            self.limits.text("reason", n)?;
            super::validate::typed("reason", n)?;
        }
        self.transition(
            job_id,
            actor,
            Command::Cancel {
                note: note.map(Into::into),
            },
        )
        .await
    }

    #[instrument(skip(self), fields(job_id = %job_id))]
    pub async fn receipt(
        &self,
        job_id: Uuid,
        receipt_id: &str,
        status: ReceiptStatus,
    ) -> LedgerResult<WriteResult> {
        self.receipt_as(job_id, "api", receipt_id, status).await
    }

    /// `receipt`, recording `actor` (an API token) as who delivered it.
    pub async fn receipt_as(
        &self,
        job_id: Uuid,
        actor: &str,
        receipt_id: &str,
        status: ReceiptStatus,
    ) -> LedgerResult<WriteResult> {
        self.limits.name("receipt id", receipt_id)?;
        self.limits.name("actor", actor)?;
        self.transition(
            job_id,
            actor,
            Command::Receipt {
                receipt_id: receipt_id.into(),
                status,
            },
        )
        .await
    }

    /// Operator replay of a dead job: a new run, attempts from zero; the token
    /// keeps counting up.
    #[instrument(skip(self, note), fields(job_id = %job_id))]
    pub async fn replay(&self, job_id: Uuid, operator: &str, note: &str) -> LedgerResult<WriteResult> {
        self.limits.name("operator", operator)?;
        self.limits.name("reason", note)?;
        super::validate::typed("operator", operator)?;
        super::validate::typed("reason", note)?;
        let actor = format!("operator:{operator}");
        self.transition(
            job_id,
            &actor,
            Command::Replay {
                operator: operator.into(),
                note: note.into(),
            },
        )
        .await
    }

    /// Batch replay: the same edge, job by job, for dead jobs that died with
    /// `reason_code` within `[since, until)`.
    pub async fn replay_batch(
        &self,
        reason_code: &str,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
        operator: &str,
        note: &str,
    ) -> LedgerResult<Vec<WriteResult>> {
        // Checked once up front: with no job in the range, nothing else would.
        super::validate::typed("operator", operator)?;
        super::validate::typed("reason", note)?;
        if crate::domain::Reason::parse(reason_code).is_none() {
            return Err(LedgerError::BadInput(format!(
                "unknown reason code {reason_code:?}"
            )));
        }
        let ids = jobs::dead_job_ids(&self.pool, reason_code, since, until).await?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            match self.replay(id, operator, note).await {
                Err(LedgerError::NotFound(_)) => continue, // purged meanwhile
                other => out.push(other?),
            }
        }
        Ok(out)
    }

    /// Records an observation. Any worker may, fenced or not; deduplicated by
    /// key (same data: already_committed; different: conflict).
    pub async fn observe(
        &self,
        job_id: Uuid,
        fence: Option<Fence>,
        key: &str,
        data: Value,
        actor: &str,
    ) -> LedgerResult<WriteResult> {
        let cmd = self.observation(fence, key, data)?;
        self.transition(job_id, actor, cmd).await
    }

    /// A checked observation command (its dedup digest is looked up under
    /// the job's lock by the engine).
    fn observation(&self, fence: Option<Fence>, key: &str, data: Value) -> LedgerResult<Command> {
        self.limits.name("observation key", key)?;
        self.limits.json("observation", &data)?;
        Ok(Command::Observe {
            fence,
            key: key.into(),
            data,
            existing: None,
        })
    }

    /// `observe` inside the caller's transaction (evidence recorded together
    /// with the caller's own writes).
    pub async fn observe_in(
        &self,
        conn: &mut sqlx::PgConnection,
        job_id: Uuid,
        fence: Option<Fence>,
        key: &str,
        data: Value,
        actor: &str,
    ) -> LedgerResult<WriteResult> {
        let cmd = self.observation(fence, key, data)?;
        transition_in(conn, job_id, actor, cmd).await
    }

    /// One pass of the sweeper: lease-expiry policies other than reconcile,
    /// exhausted leases, and receipt deadlines. Returns what it changed.
    #[instrument(level = "debug", skip(self))]
    pub async fn sweep(&self, batch: i64) -> LedgerResult<Vec<WriteResult>> {
        let mut conn = self.pool.acquire().await?;
        self.sweep_on(&mut conn, batch).await
    }

    /// `sweep` on one connection: the worker's active sweeper runs it on the
    /// session that holds the sweeper's advisory lock, so no sweep commits
    /// on a session that lost the lock (a database restart ends both the
    /// session and its lock; the sweep then fails instead of going on next
    /// to a new sweeper).
    pub async fn sweep_on(
        &self,
        conn: &mut sqlx::PgConnection,
        batch: i64,
    ) -> LedgerResult<Vec<WriteResult>> {
        let mut changed = vec![];
        loop {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            let locked = jobs::lock_sweepable(&mut tx, batch).await?;
            let n = locked.len() as i64;
            let results = decide_and_write(&mut tx, locked, "sweeper", |_| Command::Expire).await?;
            tx.commit().await?;
            changed.extend(results.into_iter().filter(|r| r.committed()));
            if n < batch {
                return Ok(changed);
            }
        }
    }

    /// Purges terminal jobs that ended more than `older_than` ago: appends a
    /// `purged` event, deletes the projection row, keeps a tombstone. The
    /// events stay in the log.
    #[instrument(level = "debug", skip(self))]
    pub async fn purge(&self, older_than: Duration, batch: i64) -> LedgerResult<u64> {
        let mut purged = 0;
        loop {
            let ids = jobs::purgeable_job_ids(&self.pool, millis(older_than), batch).await?;
            if ids.is_empty() {
                return Ok(purged);
            }
            let mut tx = self.pool.begin().await?;
            let locked = jobs::lock_jobs_skip_locked(&mut tx, &ids).await?;
            let results = decide_and_write(&mut tx, locked, "purger", |_| Command::Purge).await?;
            tx.commit().await?;
            let n = results.iter().filter(|r| r.committed()).count() as u64;
            purged += n;
            if n == 0 {
                return Ok(purged);
            }
        }
    }

    pub async fn show(&self, job_id: Uuid) -> LedgerResult<Found> {
        if let Some(row) = jobs::find_job(&self.pool, job_id).await? {
            return Ok(Found::Live(Box::new(Job::try_from(row)?)));
        }
        match tombstones::find_tombstone(&self.pool, job_id).await? {
            Some(t) => Ok(Found::Purged(t)),
            None => Err(LedgerError::NotFound(job_id)),
        }
    }

    /// Writes the fence refused for this job, oldest first.
    pub async fn rejections(&self, job_id: Uuid) -> LedgerResult<Vec<RejectionRow>> {
        Ok(rejections::job_rejections(&self.pool, job_id).await?)
    }

    /// The job's events from the log (also for purged jobs).
    pub async fn history(&self, job_id: Uuid) -> LedgerResult<Vec<HistoryEntry>> {
        if job_id == crate::domain::checkpoint::LOG_STREAM {
            return Err(LedgerError::BadInput(
                "the nil id is the log's own stream of signed checkpoints, not a job: \
                 read it with `replay-log`, check it with `verify` (docs/audit.md)"
                    .into(),
            ));
        }
        let rows = events::job_events(&self.pool, job_id).await?;
        if rows.is_empty() {
            return Err(LedgerError::NotFound(job_id));
        }
        rows.iter()
            .map(|r| {
                Ok(HistoryEntry {
                    position: r.position,
                    event: r.to_event()?,
                })
            })
            .collect()
    }

    pub async fn counts_by_state(&self) -> LedgerResult<Vec<(String, i64)>> {
        Ok(jobs::count_by_state(&self.pool).await?)
    }

    pub async fn counts_by_state_in(&self, queue: &str) -> LedgerResult<Vec<(String, i64)>> {
        Ok(jobs::count_by_state_in_queue(&self.pool, queue).await?)
    }

    /// Events of one type among a queue's live jobs (e.g. takeovers).
    pub async fn count_events_in(&self, queue: &str, kind: &str) -> LedgerResult<i64> {
        Ok(events::count_events_in_queue(&self.pool, queue, kind).await?)
    }

    /// How many transactions wrote `queue`'s events of type `kind`.
    pub async fn count_transactions_in(&self, queue: &str, kind: &str) -> LedgerResult<i64> {
        Ok(events::count_transactions_in_queue(&self.pool, queue, kind).await?)
    }

    pub async fn jobs_with_event_in(&self, queue: &str, kind: &str) -> LedgerResult<Vec<Uuid>> {
        Ok(events::jobs_with_event_in_queue(&self.pool, queue, kind).await?)
    }

    /// Per queue, seconds since the oldest unfinished job was enqueued.
    pub async fn oldest_open_age(&self) -> LedgerResult<Vec<(String, f64)>> {
        Ok(jobs::oldest_open_age(&self.pool).await?)
    }

    /// Vacuums and analyses the log (see `store::schema::vacuum_log`).
    pub async fn vacuum_log(&self) -> LedgerResult<()> {
        Ok(crate::store::schema::vacuum_log(&self.pool).await?)
    }

    pub async fn count_events_total(&self) -> LedgerResult<i64> {
        Ok(events::count_events(&self.pool).await?)
    }

    pub async fn reader_names(&self) -> LedgerResult<Vec<String>> {
        Ok(crate::store::readers::reader_names(&self.pool).await?)
    }

    pub async fn all_event_hashes(&self) -> LedgerResult<Vec<(Uuid, i64, String)>> {
        Ok(events::all_hashes(&self.pool).await?)
    }

    pub async fn states_in(&self, queue: &str) -> LedgerResult<Vec<(Uuid, String, i64)>> {
        Ok(jobs::states_in_queue(&self.pool, queue).await?)
    }

    /// A page of the log between two positions (auditors' replay), in
    /// position order, after `after`.
    pub async fn log_page(
        &self,
        from: i64,
        to: i64,
        job: Option<Uuid>,
        after: i64,
        limit: i64,
    ) -> LedgerResult<Vec<LogEntry>> {
        let rows = events::events_between(&self.pool, from, to, job, after, limit).await?;
        rows.into_iter()
            .map(|r| {
                let position = r.position;
                if r.job_id == crate::domain::checkpoint::LOG_STREAM {
                    return Ok(LogEntry::Log { position, row: r });
                }
                Ok(LogEntry::Job(HistoryEntry {
                    position,
                    event: r.into_event()?,
                }))
            })
            .collect()
    }

    pub async fn txid_of_position(&self, position: i64) -> LedgerResult<Option<i64>> {
        Ok(events::txid_of_position(&self.pool, position).await?)
    }

    pub async fn projection_rows(&self, view: &str, job: Option<Uuid>) -> LedgerResult<Vec<Value>> {
        let mut rows = events::projection_rows(&self.pool, view, job).await?;
        if view == "jobs_rebuilt" {
            crate::rebuilt::show_documents(&mut rows);
        }
        Ok(rows)
    }

    /// The overview's figures: events per minute by type over the last
    /// `minutes`, refused writes by outcome over the same time, dead jobs by
    /// reason code.
    pub async fn overview(&self, minutes: i32) -> LedgerResult<Overview> {
        use crate::store::overview as o;
        Ok(Overview {
            per_minute: o::events_per_minute(&self.pool, minutes).await?,
            refused: o::refusals_since(&self.pool, minutes).await?,
            dead_by_reason: o::dead_by_reason(&self.pool).await?,
        })
    }
}

/// What the console's overview shows besides the projections.
#[derive(Debug, Clone)]
pub struct Overview {
    pub per_minute: Vec<(DateTime<Utc>, String, i64)>,
    pub refused: Vec<(String, i64)>,
    pub dead_by_reason: Vec<(String, i64)>,
}
