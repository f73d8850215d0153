//! Enqueue: idempotent on `(queue, job_key)`, usable inside the caller's
//! own transaction.

use serde::Serialize;
use sqlx::PgConnection;
use std::collections::{HashMap, HashSet};
use tracing::instrument;
use uuid::Uuid;

use super::context::{ContextCache, BLOCK};
use super::engine::traced;
use super::error::{LedgerError, LedgerResult};
use super::Ledger;
use crate::domain::workflow::WorkflowTie;
use crate::domain::{apply, decide_enqueue_tied, Ctx, Job, NewJob, Policy};
use crate::store::{jobs, policies, EventRow, StoreError};

#[derive(Debug, Clone, Serialize)]
pub struct Enqueued {
    #[serde(skip)]
    pub job: Job,
    /// False when an existing job with the same key and payload was returned.
    pub created: bool,
    pub position: Option<i64>,
}

impl Ledger {
    pub async fn enqueue(&self, new: NewJob) -> LedgerResult<Enqueued> {
        self.enqueue_as(new, "api").await
    }

    /// `enqueue`, with `actor` (for example the API token's name) recorded
    /// in the `enqueued` event.
    pub async fn enqueue_as(&self, new: NewJob, actor: &str) -> LedgerResult<Enqueued> {
        self.limits.name("actor", actor)?;
        self.enqueue_single(new, actor).await
    }

    /// Enqueues inside the caller's transaction: the job exists exactly when
    /// the caller's own writes commit. In the rare case that the job's key
    /// had a lifecycle purged between this call's epoch draw and its insert,
    /// the statement fails with SQLSTATE JL002 (`is_retryable`) and the
    /// caller's transaction must be retried, as for a serialization failure.
    pub async fn enqueue_in(&self, conn: &mut PgConnection, new: NewJob) -> LedgerResult<Enqueued> {
        Ok(self
            .enqueue_many_in(conn, vec![new])
            .await?
            .pop()
            .expect("one in, one out"))
    }

    /// Enqueues a batch atomically, each job idempotent by its key; each
    /// answer says whether its key already named a job. In a transaction:
    /// a key that names a job with another payload is found after the
    /// statement wrote the others, and then none of them may stay.
    pub async fn enqueue_many_as(&self, news: Vec<NewJob>, actor: &str) -> LedgerResult<Vec<Enqueued>> {
        self.limits.name("actor", actor)?;
        let mut tries = 0;
        loop {
            let items = news.iter().cloned().map(|n| (n, None)).collect();
            let mut tx = self.pool.begin().await?;
            match self.enqueue_drafts_in(&mut tx, items, actor, None).await {
                Ok(done) => {
                    tx.commit().await?;
                    return Ok(done);
                }
                // As in `enqueue_as`: nothing was written; draw again.
                Err(LedgerError::Store(e))
                    if e.sqlstate().as_deref() == Some(crate::store::EPOCH_BELOW_PURGED) && tries < 5 =>
                {
                    tries += 1;
                }
                other => return other,
            }
        }
    }

    #[instrument(skip_all, fields(n = news.len()))]
    pub async fn enqueue_many_in(
        &self,
        conn: &mut PgConnection,
        news: Vec<NewJob>,
    ) -> LedgerResult<Vec<Enqueued>> {
        self.enqueue_drafts_in(conn, news.into_iter().map(|n| (n, None)).collect(), "api", None)
            .await
    }

    /// Jobs tied to a workflow, with the ids their ties already name.
    pub(crate) async fn enqueue_tied_in(
        &self,
        conn: &mut PgConnection,
        news: Vec<(NewJob, Uuid, WorkflowTie)>,
        actor: &str,
    ) -> LedgerResult<Vec<Enqueued>> {
        self.enqueue_drafts_in(
            conn,
            news.into_iter()
                .map(|(n, id, tie)| (n, Some((id, tie))))
                .collect(),
            actor,
            None,
        )
        .await
    }

    pub(super) async fn enqueue_drafts_in(
        &self,
        conn: &mut PgConnection,
        items: Vec<(NewJob, Option<(Uuid, WorkflowTie)>)>,
        actor: &str,
        cache: Option<&ContextCache>,
    ) -> LedgerResult<Vec<Enqueued>> {
        for (n, _) in &items {
            self.check_draft(n, actor)?;
        }
        let done = insert_drafts(conn, items, Some(&self.hooks), actor, cache).await;
        if done.is_err() {
            // Whatever failed (a key's floor above a remembered epoch, say),
            // the retry reads afresh.
            cache.inspect(|c| c.forget());
        }
        done
    }
}

impl Ledger {
    /// A new job against the limits, before anything is read or written.
    pub(super) fn check_draft(&self, n: &NewJob, actor: &str) -> LedgerResult<()> {
        self.check_new(n)?;
        // Slot keys belong to the schedules: a job taking one would
        // stop the slot from firing (or pass for its firing).
        if actor != SCHEDULER && n.job_key.as_deref().is_some_and(|k| k.starts_with("schedule:")) {
            return Err(LedgerError::BadInput(
                "job keys starting with \"schedule:\" are the schedules' own".into(),
            ));
        }
        Ok(())
    }
}

/// The actor of a schedule's firings (the only one that may use slot keys).
pub(crate) const SCHEDULER: &str = "scheduler";

/// Decides and inserts new jobs (already checked against the limits): the
/// enqueue proper, also used for a workflow's fan-in, which the ledger
/// creates itself in the transaction of the last step's end.
#[instrument(name = "jobledger.enqueue", skip_all, fields(n = items.len(), actor = %actor))]
pub(crate) async fn insert_drafts(
    conn: &mut PgConnection,
    items: Vec<(NewJob, Option<(Uuid, WorkflowTie)>)>,
    hooks: Option<&super::LedgerHooks>,
    actor: &str,
    cache: Option<&ContextCache>,
) -> LedgerResult<Vec<Enqueued>> {
    let (news, ties): (Vec<NewJob>, Vec<Option<(Uuid, WorkflowTie)>>) = items.into_iter().unzip();
    let written = insert_decided(conn, &news, &ties, hooks, actor, cache, None).await?;
    resolve(conn, written, actor).await
}

/// What an insert of drafts wrote: each draft's event and job, in the
/// order given, and the position of each job it wrote (a draft whose key
/// names a job already is not among them).
pub(super) struct Written {
    pub drafts: Vec<(crate::domain::Event, Job)>,
    pub inserted: HashMap<Uuid, i64>,
}

/// Decides and inserts `news` (each with its workflow tie, if any),
/// leaving the drafts whose keys name jobs already to the caller
/// (`resolve`). `traces`: each job's trace context (the span of the call
/// that enqueues it), when that is not the current span's. Borrowed: a
/// caller whose statement the database refuses still holds its jobs.
pub(super) async fn insert_decided(
    conn: &mut PgConnection,
    news: &[NewJob],
    ties: &[Option<(Uuid, WorkflowTie)>],
    hooks: Option<&super::LedgerHooks>,
    actor: &str,
    cache: Option<&ContextCache>,
    traces: Option<&[Option<String>]>,
) -> LedgerResult<Written> {
    if news.is_empty() {
        return Ok(Written {
            drafts: vec![],
            inserted: HashMap::new(),
        });
    }
    let wanted: HashSet<(String, String)> = news
        .iter()
        .filter(|n| n.policy.is_none())
        .map(|n| (n.queue.clone(), n.kind.clone()))
        .collect();
    let pairs: Vec<(String, String)> = wanted.into_iter().collect();
    let Context {
        epochs,
        now,
        registered,
        check,
    } = context(conn, news.len(), &pairs, cache).await?;
    if let Some(h) = hooks.and_then(|h| h.after_epochs.as_ref()) {
        h().await;
    }
    let drafts = decide_drafts(news, epochs, ties, registered, now, actor, traces)?;
    let drafted: Vec<&Job> = drafts.iter().map(|(_, j)| j).collect();
    let evs: Vec<EventRow> = drafts
        .iter()
        .map(|(e, j)| traced(EventRow::from(e), j.traceparent.as_deref()))
        .collect();
    let inserted = match &check {
        None => jobs::insert_new_jobs(conn, &drafted, evs).await?,
        Some(check) => {
            // From the moment the insert is sent until its wake-up is out: a
            // caller that stops waiting (drops this future) may do so after
            // the commit, and the guard then sends the wake-up from the pool.
            // One too many, when nothing was written, only makes a worker look.
            let queues = drafts.iter().map(|(_, j)| j.queue.clone()).collect();
            let mut guard = WakeOnDrop(cache.and_then(|c| c.pool()).map(|p| (p, queues)));
            let answer = jobs::insert_new_jobs_checked(conn, &drafted, evs, check).await?;
            let Some(done) = answer else {
                guard.0 = None;
                // Refused, nothing written: read afresh and decide again.
                cache.expect("only a remembered context is checked").forget();
                return Box::pin(insert_decided(conn, news, ties, hooks, actor, None, traces)).await;
            };
            if let Some(h) = hooks.and_then(|h| h.before_wake.as_ref()) {
                h().await;
            }
            wake(conn, &drafts, &done).await;
            guard.0 = None;
            done
        }
    };
    Ok(Written {
        drafts,
        inserted: inserted.into_iter().collect(),
    })
}

/// Each draft's answer: the job written, or for a key that names a job
/// already, that job (or a new lifecycle of the key: `existing_or_next`).
pub(super) async fn resolve(
    conn: &mut PgConnection,
    written: Written,
    actor: &str,
) -> LedgerResult<Vec<Enqueued>> {
    let Written { drafts, inserted } = written;
    let mut out = Vec::with_capacity(drafts.len());
    for (ev, job) in drafts {
        if let Some(position) = inserted.get(&ev.job_id) {
            out.push(Enqueued {
                job,
                created: true,
                position: Some(*position),
            });
            continue;
        }
        out.push(existing_or_next(conn, ev, job, actor).await?);
    }
    Ok(out)
}

/// Decides the `enqueued` event of each new job and the job it makes.
fn decide_drafts(
    news: &[NewJob],
    epochs: Vec<i64>,
    ties: &[Option<(Uuid, WorkflowTie)>],
    registered: Vec<(String, String, serde_json::Value)>,
    now: chrono::DateTime<chrono::Utc>,
    actor: &str,
    traces: Option<&[Option<String>]>,
) -> LedgerResult<Vec<(crate::domain::Event, Job)>> {
    let registered: HashMap<(String, String), Policy> = registered
        .into_iter()
        .map(|(q, k, v)| {
            let p = serde_json::from_value(v)
                .map_err(|e| StoreError::Corrupt(format!("policy of {q}/{k}: {e}")))?;
            Ok::<_, StoreError>(((q, k), p))
        })
        .collect::<Result<_, _>>()?;
    let mut ctx = Ctx {
        now,
        actor: actor.into(),
        jitter: 0.0,
        // The job joins the trace of the span enqueueing it: this one, or
        // each job's own call's (`traces`, set below).
        trace: traces.is_none().then(crate::telemetry::here).flatten(),
    };
    let mut drafts = Vec::with_capacity(news.len());
    for (i, ((new, epoch), tie)) in news.iter().zip(epochs).zip(ties).enumerate() {
        let policy = match &new.policy {
            Some(p) => p.clone(),
            None => registered
                .get(&(new.queue.clone(), new.kind.clone()))
                .cloned()
                .unwrap_or_default(),
        };
        let (id, tie) = match tie {
            Some((id, tie)) => (*id, Some(tie)),
            None => (Uuid::now_v7(), None),
        };
        if let Some(t) = traces {
            ctx.trace = t[i].clone();
        }
        let ev = decide_enqueue_tied(id, epoch, new, &policy, tie, &ctx);
        let job = apply(None, &ev).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        drafts.push((ev, job));
    }
    Ok(drafts)
}

/// Sends a single enqueue's wake-up when the enqueue is dropped (or fails)
/// between sending its insert and sending its wake-up.
struct WakeOnDrop(Option<(sqlx::PgPool, Vec<String>)>);

impl Drop for WakeOnDrop {
    fn drop(&mut self) {
        let (Some((pool, queues)), Ok(rt)) = (self.0.take(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        rt.spawn(async move {
            if let Err(e) = jobs::wake(&pool, &queues).await {
                tracing::warn!(error = %e, "the wake-up of an enqueue dropped unfinished failed");
            }
        });
    }
}

/// Sends the wake-ups a checked insert left out: the queues of the jobs it
/// wrote (committed by now: a checked insert runs outside a transaction).
/// A failure is logged, not returned: the jobs exist, and an error would
/// make a caller enqueue a job without a key twice. Workers and readers
/// find them at their next poll.
async fn wake(conn: &mut PgConnection, drafts: &[(crate::domain::Event, Job)], done: &[(Uuid, i64)]) {
    if done.is_empty() {
        return;
    }
    let written: HashSet<Uuid> = done.iter().map(|(id, _)| *id).collect();
    let mut queues: Vec<String> = drafts
        .iter()
        .filter(|(_, j)| written.contains(&j.job_id) && j.state == crate::domain::JobState::Queued)
        .map(|(_, j)| j.queue.clone())
        .collect();
    queues.sort();
    queues.dedup();
    if let Err(e) = jobs::wake(conn, &queues).await {
        tracing::warn!(error = %e, ?queues, "enqueued, but the wake-up after the commit failed");
    }
}

/// What an enqueue needs before it can hash its events.
struct Context {
    epochs: Vec<i64>,
    now: chrono::DateTime<chrono::Utc>,
    registered: Vec<(String, String, serde_json::Value)>,
    /// Set when taken from memory: what the insert must check.
    check: Option<jobs::ContextCheck>,
}

/// The context of `n` new jobs: from `cache` when it remembers enough,
/// else read, drawing a block of epochs more for the cache to remember.
async fn context(
    conn: &mut PgConnection,
    n: usize,
    pairs: &[(String, String)],
    cache: Option<&ContextCache>,
) -> LedgerResult<Context> {
    if let Some(t) = cache.and_then(|c| c.take(n, pairs)) {
        return Ok(Context {
            epochs: t.epochs,
            now: t.now,
            registered: t.registered,
            check: Some(t.check),
        });
    }
    let extra = if cache.is_some() { BLOCK } else { 0 };
    let (queues, kinds): (Vec<String>, Vec<String>) = pairs.iter().cloned().unzip();
    let (mut epochs, now, registered) =
        jobs::enqueue_context(conn, (n + extra) as i64, &queues, &kinds).await?;
    let read_at = std::time::Instant::now();
    let rest = epochs.split_off(n);
    if let Some(c) = cache {
        c.remember(rest, now, read_at, pairs, &registered);
    }
    Ok(Context {
        epochs,
        now,
        registered,
        check: None,
    })
}

/// A draft whose key names a job already: that job, or, when the job's
/// uniqueness window has ended and it has finished, a new lifecycle of the
/// key — the finished one is retired exactly as `purge` retires a job (its
/// events stay; a tombstone answers `stale` to its lifecycle; the key's
/// epoch floor rises), in one transaction (a savepoint inside the
/// caller's) with the new job's insert. A job still open keeps its key:
/// one key never names two open jobs.
async fn existing_or_next(
    conn: &mut PgConnection,
    ev: crate::domain::Event,
    job: Job,
    actor: &str,
) -> LedgerResult<Enqueued> {
    use sqlx::Connection;
    for _ in 0..3 {
        let key = job.job_key.as_deref().expect("only keyed jobs conflict");
        let Some(row) = jobs::find_job_by_key(&mut *conn, &job.queue, key).await? else {
            // Retired by a concurrent enqueue between our insert and now.
            if let Some(done) = insert_one(conn, &ev, &job).await? {
                return Ok(done);
            }
            continue;
        };
        let existing = Job::try_from(row)?;
        let ended = existing
            .admission
            .as_ref()
            .and_then(|a| a.unique_until)
            .is_some_and(|until| until <= job.created_at);
        if !(ended && existing.state.is_terminal() && existing.workflow.is_none()) {
            return same_or_conflict(existing, &job);
        }
        let mut sp = conn.begin().await?;
        let locked = jobs::lock_jobs(&mut sp, &[existing.job_id]).await?;
        let retire = |_: &Job| crate::domain::Command::Purge;
        // Boxed: a fan-in enqueued by `follow` may come back here.
        let by = format!("unique-window:{actor}");
        Box::pin(super::engine::decide_and_write(&mut sp, locked, &by, retire)).await?;
        let done = insert_one(&mut sp, &ev, &job).await?;
        sp.commit().await?;
        if let Some(done) = done {
            return Ok(done);
        }
    }
    Err(StoreError::Corrupt("a key's lifecycle changed hands three times during one enqueue".into()).into())
}

/// Inserts one decided job; None when its key names a job (again).
async fn insert_one(
    conn: &mut PgConnection,
    ev: &crate::domain::Event,
    job: &Job,
) -> LedgerResult<Option<Enqueued>> {
    let at = jobs::insert_new_jobs(
        conn,
        &[job],
        vec![traced(EventRow::from(ev), job.traceparent.as_deref())],
    )
    .await?;
    Ok(at.first().map(|(_, position)| Enqueued {
        job: job.clone(),
        created: true,
        position: Some(*position),
    }))
}

/// The job already holding this key: the same request gets it back; a
/// different payload under the same key is an error, never a second job.
fn same_or_conflict(existing: Job, job: &Job) -> LedgerResult<Enqueued> {
    let key = job.job_key.as_deref().expect("only keyed jobs conflict");
    if existing.payload_digest != job.payload_digest || existing.kind != job.kind {
        return Err(LedgerError::KeyConflict {
            queue: job.queue.clone(),
            key: key.to_string(),
            job_id: existing.job_id,
        });
    }
    Ok(Enqueued {
        job: existing,
        created: false,
        position: None,
    })
}

impl Ledger {
    /// Registers the policy new jobs of (queue, kind) get when they bring none.
    pub async fn register_policy(&self, queue: &str, kind: &str, policy: &Policy) -> LedgerResult<()> {
        check_policy(policy)?;
        let v = serde_json::to_value(policy).expect("policy serialises");
        policies::upsert_kind_policy(&self.pool, queue, kind, &v).await?;
        Ok(())
    }

    pub(crate) fn check_new(&self, n: &NewJob) -> LedgerResult<()> {
        let l = &self.limits;
        l.name("queue", &n.queue)?;
        l.name("kind", &n.kind)?;
        if let Some(k) = &n.job_key {
            l.name("job key", k)?;
        }
        l.json("payload", &n.payload)?;
        if let Some(p) = &n.policy {
            check_policy(p)?;
        }
        if let Some(k) = &n.concurrency_key {
            l.name("concurrency key", k)?;
            super::validate::typed("concurrency key", k)?;
        }
        match n.unique_for_ms {
            Some(_) if n.job_key.is_none() => {
                return Err(LedgerError::BadInput(
                    "a uniqueness window needs a job key".into(),
                ))
            }
            Some(ms) if !(1..=MAX_DELAY_MS).contains(&ms) => {
                return Err(LedgerError::BadInput(
                    "a uniqueness window must be from 1 ms to 100 years".into(),
                ))
            }
            _ => {}
        }
        if n.delay_ms.is_some_and(|d| d < 0) {
            return Err(LedgerError::BadInput("delay must not be negative".into()));
        }
        if n.delay_ms.is_some_and(|d| d > MAX_DELAY_MS) {
            return Err(LedgerError::BadInput("delay is over 100 years".into()));
        }
        Ok(())
    }
}

/// A delay beyond this is a mistake, not a plan (and near i64::MAX the
/// date would not exist).
const MAX_DELAY_MS: i64 = 100 * 365 * 24 * 3600 * 1000;

fn check_policy(p: &Policy) -> LedgerResult<()> {
    if p.max_attempts < 1 || p.max_attempts > 1000 {
        return Err(LedgerError::BadInput(format!(
            "max attempts {} is not in 1..=1000",
            p.max_attempts
        )));
    }
    if p.backoff_base_ms < 0 || p.backoff_cap_ms < p.backoff_base_ms || p.receipt_timeout_ms <= 0 {
        return Err(LedgerError::BadInput(
            "backoff and receipt timeouts must be positive, cap >= base".into(),
        ));
    }
    Ok(())
}
