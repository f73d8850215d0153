//! The one write path. Every transition: lock the job's row, decide with the
//! pure state machine, then (1) update the projection conditioned on the
//! generation decided against and (2) append the event, in the caller's
//! transaction. A rejection writes nothing.

use rand::Rng;
use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

use super::error::{LedgerError, LedgerResult};
use crate::domain::{apply, decide, Command, Ctx, Event, EventBody, Job, Outcome, Rejection};
use crate::store::jobs::{self, Locked};
use crate::store::rejections::{self, RejectionRow};
use crate::store::{events, tombstones, writes, EventRow, StoreError, TombstoneRow};
use crate::telemetry::{job_attrs, parent_for, Spans};

/// The answer to one write.
#[derive(Debug, Clone, Serialize)]
pub struct WriteResult {
    pub outcome: Outcome,
    pub job_id: Uuid,
    /// The job as it is now (after the write, or as found when rejected);
    /// `None` when the job was purged.
    #[serde(skip)]
    pub job: Option<Job>,
    /// Global log position of the appended event.
    pub position: Option<i64>,
    #[serde(skip)]
    pub event: Option<Event>,
    pub detail: Option<String>,
    pub purged: bool,
}

impl WriteResult {
    pub fn committed(&self) -> bool {
        self.outcome == Outcome::Committed
    }

    pub(crate) fn rejected(job: Job, r: Rejection) -> Self {
        WriteResult {
            outcome: r.outcome,
            job_id: job.job_id,
            job: Some(job),
            position: None,
            event: None,
            detail: Some(r.detail),
            purged: false,
        }
    }

    pub(crate) fn purged(job_id: Uuid) -> Self {
        WriteResult {
            outcome: Outcome::Stale,
            job_id,
            job: None,
            position: None,
            event: None,
            detail: Some("the job was purged; its lifecycle is over".into()),
            purged: true,
        }
    }
}

pub(crate) fn to_jobs(locked: Vec<Locked>) -> LedgerResult<Vec<(Job, chrono::DateTime<chrono::Utc>)>> {
    locked
        .into_iter()
        .map(|l| Ok((Job::try_from(l.row)?, l.db_now)))
        .collect()
}

pub(crate) fn ctx(now: chrono::DateTime<chrono::Utc>, actor: &str) -> Ctx {
    Ctx {
        now,
        actor: actor.to_string(),
        jitter: rand::thread_rng().gen(),
        trace: None,
    }
}

/// An event row stamped with the span writing it, when tracing is on
/// (`telemetry::write_trace`: every write path appends through here).
pub(crate) fn traced(mut row: EventRow, job_trace: Option<&str>) -> EventRow {
    row.trace = crate::telemetry::write_trace(row.job_id, job_trace);
    row
}

/// Decides `cmd_for(job)` for each locked job and writes the committed ones.
pub(crate) async fn decide_and_write(
    conn: &mut PgConnection,
    locked: Vec<Locked>,
    actor: &str,
    cmd_for: impl Fn(&Job) -> Command,
) -> LedgerResult<Vec<WriteResult>> {
    let decided = to_jobs(locked)?
        .into_iter()
        .map(|(job, now)| {
            let d = decide(&job, &cmd_for(&job), &ctx(now, actor));
            (job, d)
        })
        .collect();
    write_decisions(conn, decided).await
}

/// Writes every accepted decision, then what follows from them in the same
/// transaction (workflow parents and the steps waiting on a finished one).
pub(crate) async fn write_decisions(
    conn: &mut PgConnection,
    decided: Vec<(Job, Result<Event, Rejection>)>,
) -> LedgerResult<Vec<WriteResult>> {
    let results = write_wave(conn, decided).await?;
    super::follow::follow(conn, &results).await?;
    Ok(results)
}

/// Writes every accepted decision in one statement per table.
pub(crate) async fn write_wave(
    conn: &mut PgConnection,
    decided: Vec<(Job, Result<Event, Rejection>)>,
) -> LedgerResult<Vec<WriteResult>> {
    let mut results = Vec::with_capacity(decided.len());
    let (mut prev, mut evs, mut gone, mut graves) = (vec![], vec![], vec![], vec![]);
    let mut purge_evs = vec![];
    let mut updated: Vec<usize> = vec![];
    for (job, decision) in &decided {
        match decision {
            Err(r) => results.push(WriteResult::rejected(job.clone(), r.clone())),
            Ok(ev) => {
                let after = apply(Some(job), ev).map_err(|e| {
                    StoreError::Corrupt(format!("decide produced an event apply refuses: {e}"))
                })?;
                if matches!(ev.body, EventBody::Purged {}) {
                    purge_evs.push(traced(EventRow::from(ev), job.traceparent.as_deref()));
                    gone.push(job.job_id);
                    graves.push(TombstoneRow::of(&after, ev.recorded_at));
                } else {
                    evs.push(traced(EventRow::from(ev), job.traceparent.as_deref()));
                    prev.push(job);
                    // The answer pushed next holds the job after its event.
                    updated.push(results.len());
                }
                results.push(WriteResult {
                    outcome: Outcome::Committed,
                    job_id: job.job_id,
                    purged: matches!(ev.body, EventBody::Purged {}),
                    job: Some(after),
                    position: None,
                    event: Some(ev.clone()),
                    detail: None,
                });
            }
        }
    }
    let mut positions: std::collections::HashMap<Uuid, i64> = std::collections::HashMap::new();
    if !gone.is_empty() {
        jobs::delete_jobs(conn, &gone).await?;
        tombstones::insert_tombstones(conn, &graves).await?;
        let purged: Vec<EventRow> = std::mem::take(&mut purge_evs);
        positions.extend(
            events::insert_events(conn, purged)
                .await?
                .into_iter()
                .map(|(id, _, p)| (id, p)),
        );
    }
    if !prev.is_empty() {
        // The jobs after their events, in the order of `prev`.
        let next: Vec<&Job> = updated
            .iter()
            .map(|&i| results[i].job.as_ref().expect("a committed update holds its job"))
            .collect();
        positions.extend(writes::write_transitions(conn, &prev, &next, evs).await?);
    }
    for r in results.iter_mut().filter(|r| r.committed()) {
        r.position = positions.get(&r.job_id).copied();
    }
    Ok(results)
}

/// Locks one job. `Err(WriteResult)` when it was purged (the answer is stale).
pub(crate) async fn lock_one(
    conn: &mut PgConnection,
    job_id: Uuid,
) -> LedgerResult<Result<Locked, WriteResult>> {
    if let Some(l) = jobs::lock_jobs(conn, &[job_id]).await?.pop() {
        return Ok(Ok(l));
    }
    match tombstones::find_tombstone(&mut *conn, job_id).await? {
        Some(_) => Ok(Err(WriteResult::purged(job_id))),
        None => Err(LedgerError::NotFound(job_id)),
    }
}

/// One transition of one job, inside the caller's transaction.
pub(crate) async fn transition_in(
    conn: &mut PgConnection,
    job_id: Uuid,
    actor: &str,
    cmd: Command,
) -> LedgerResult<WriteResult> {
    super::follow::lock_parent_first(conn, job_id, &cmd).await?;
    let locked = match lock_one(conn, job_id).await? {
        Ok(l) => l,
        Err(purged) => return Ok(purged),
    };
    let cmd = match cmd {
        Command::ReleaseHold { operator, note, .. } => {
            let job = Job::try_from(locked.row.clone())?;
            Command::ReleaseHold {
                operator,
                note,
                prerequisites: super::follow::prerequisites_of(conn, &job).await?,
            }
        }
        Command::Replay { .. } if crate::store::workflows::parent_purged(&mut *conn, job_id).await? => {
            let job = Job::try_from(locked.row)?;
            let why = Rejection::invalid("its workflow was purged: nothing could count this step any more");
            return Ok(WriteResult::rejected(job, why));
        }
        Command::Observe { fence, key, data, .. } => {
            let existing = events::observation_digest(&mut *conn, job_id, &key).await?;
            Command::Observe {
                fence,
                key,
                data,
                existing,
            }
        }
        other => other,
    };
    let mut out = decide_and_write(conn, vec![locked], actor, |_| cmd.clone()).await?;
    Ok(out.pop().expect("one locked job gives one result"))
}

/// One transition in its own short transaction; refused writes are recorded.
pub(crate) async fn run_transition(
    pool: &sqlx::PgPool,
    job_id: Uuid,
    actor: &str,
    cmd: Command,
) -> LedgerResult<WriteResult> {
    let mut tx = pool.begin().await?;
    let out = transition_in(&mut tx, job_id, actor, cmd.clone()).await?;
    if out.committed() {
        tx.commit().await?;
    } else {
        tx.rollback().await?;
        record_refusal(pool, &cmd, actor, &out).await?;
    }
    Ok(out)
}

/// Keeps a refused write (stale, conflict, invalid transition) for the job's
/// history. Outside the refused transaction, which was rolled back.
pub(crate) async fn record_refusal(
    pool: &sqlx::PgPool,
    cmd: &Command,
    actor: &str,
    out: &WriteResult,
) -> LedgerResult<()> {
    if matches!(out.outcome, Outcome::Committed | Outcome::AlreadyCommitted) {
        return Ok(());
    }
    let fence = cmd.fence();
    let row = RejectionRow {
        job_id: out.job_id,
        command: cmd.name().to_string(),
        outcome: out.outcome.as_str().to_string(),
        epoch: fence.map(|f| f.epoch),
        token: fence.map(|f| f.token),
        actor: actor.to_string(),
        detail: out.detail.clone().unwrap_or_default(),
        recorded_at: chrono::Utc::now(),
    };
    rejections::insert_rejection(pool, &row).await?;
    Ok(())
}

/// One write of a batch: the job, the actor, the command, the span the
/// write continues (its lease's), if the caller knows one, and the job as
/// the caller last saw it, if it holds a copy (a lease's claimed job).
pub(crate) type BatchItem<'a> = (Uuid, String, Command, Option<String>, Option<&'a Job>);

type Read = std::collections::HashMap<Uuid, (Job, chrono::DateTime<chrono::Utc>)>;

/// Locks the batch's rows (in id order) and reads each job: the caller's
/// copy when the row is still at that copy's generation (version and chain
/// head, and the epoch, token and state the fenced update checks), the row
/// itself otherwise. Why a copy can stand for the row: the version moves
/// by one with every event (the database refuses anything else), the head
/// hash names the whole chain up to it, and the row is `apply` folded over
/// that chain, which is where the copy came from. A row changed around the
/// log (by hand, triggers off) in a column no fence checks is decided on
/// the log's fold, and `verify` still reports the row until it is written.
/// Issue 15: reading and decoding every completed job's full row (its
/// payload and policy as JSON) was a tenth of a drain's client time, for
/// rows that had not moved.
async fn lock_batch(conn: &mut PgConnection, ids: &[Uuid], items: &[BatchItem<'_>]) -> LedgerResult<Read> {
    let known: std::collections::HashMap<Uuid, &Job> =
        items.iter().filter_map(|i| i.4.map(|j| (i.0, j))).collect();
    let mut read = Read::new();
    let mut moved = Vec::new();
    for g in jobs::lock_generations(&mut *conn, ids).await? {
        match known.get(&g.job_id) {
            Some(j) if same_generation(j, &g) => {
                read.insert(g.job_id, ((*j).clone(), g.db_now));
            }
            _ => moved.push(g.job_id),
        }
    }
    if !moved.is_empty() {
        // Locked above already: this reads them, in full.
        for (j, now) in to_jobs(jobs::lock_jobs(&mut *conn, &moved).await?)? {
            read.insert(j.job_id, (j, now));
        }
    }
    Ok(read)
}

fn same_generation(copy: &Job, row: &jobs::Generation) -> bool {
    copy.version == row.version
        && copy.last_hash == row.last_hash
        && copy.epoch == row.epoch
        && copy.token == row.token
        && copy.state.as_str() == row.state
}

/// Several transitions of different jobs in one transaction, each decided and
/// fenced on its own: the batched completions and heartbeats of a worker.
/// Each job's write is its own `span` (with tracing on), under its item's
/// trace or else `telemetry::parent_for` its job. Results come back in the
/// order of `items`.
pub(crate) async fn transition_many(
    pool: &sqlx::PgPool,
    items: Vec<BatchItem<'_>>,
    span: &'static str,
) -> LedgerResult<Vec<WriteResult>> {
    let started = std::time::SystemTime::now();
    let mut ids: Vec<Uuid> = items.iter().map(|(id, ..)| *id).collect();
    ids.sort();
    // Each job once: two writes of one job would be decided on the same
    // locked row, and the second would find it gone ("no such job").
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(super::error::LedgerError::BadInput(format!(
            "job {} appears twice in the batch",
            w[0]
        )));
    }
    let mut tx = pool.begin().await?;
    let mut locked = lock_batch(&mut tx, &ids, &items).await?;
    let mut decided = Vec::with_capacity(items.len());
    let mut missing = Vec::new();
    for (i, (id, actor, cmd, ..)) in items.iter().enumerate() {
        match locked.remove(id) {
            Some((job, now)) => {
                let d = decide(&job, cmd, &ctx(now, actor));
                decided.push((i, job, d));
            }
            None => missing.push(i),
        }
    }
    let order: Vec<usize> = decided.iter().map(|(i, _, _)| *i).collect();
    let spans = Spans::start(
        span,
        started,
        decided.iter().map(|(i, job, _)| {
            let parent = items[*i]
                .3
                .clone()
                .or_else(|| parent_for(job.traceparent.as_deref()));
            (job.job_id, parent, job_attrs(job.job_id, job.epoch, job.token))
        }),
    );
    let written = spans
        .around(write_decisions(
            &mut tx,
            decided.into_iter().map(|(_, j, d)| (j, d)).collect(),
        ))
        .await?;
    tx.commit().await?;
    spans.end();
    let mut out: Vec<Option<WriteResult>> = vec![None; items.len()];
    for (i, r) in order.into_iter().zip(written) {
        out[i] = Some(r);
    }
    for i in missing {
        let id = items[i].0;
        out[i] = Some(match tombstones::find_tombstone(pool, id).await? {
            Some(_) => WriteResult::purged(id),
            None => WriteResult {
                outcome: Outcome::Stale,
                job_id: id,
                job: None,
                position: None,
                event: None,
                detail: Some("no such job".into()),
                purged: false,
            },
        });
    }
    let out: Vec<WriteResult> = out.into_iter().map(|r| r.expect("every item answered")).collect();
    for ((_, actor, cmd, ..), r) in items.iter().zip(&out) {
        record_refusal(pool, cmd, actor, r).await?;
    }
    Ok(out)
}
