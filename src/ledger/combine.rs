//! Single enqueues from concurrent callers share one statement and one
//! commit (issue 15, W1).
//!
//! Why: a single enqueue's CPU is almost all fixed cost per statement, not
//! per job. Profiled with 8 clients (`perf record -a`, docs/benchmarks.md):
//! the machine was busy, and PostgreSQL spent its time starting the
//! executor for the insert's plan (opening the indexes, reading the
//! tables' checks), running the statement checks and committing, about
//! 1 ms of CPU per job. A statement of several jobs pays that once.
//!
//! How: at most `RUNNING_MAX` shared inserts run at a time, each on a task
//! of its own. A call that finds one free starts one at once (an idle
//! ledger adds no wait); the others queue, and a task that finishes takes
//! everything queued as its next statement (one per actor: the events
//! record it). A caller that stops waiting before its statement is built
//! (while queued, or while the statement waits for its connection) takes
//! its job back; after that, its job may be written, as when a caller
//! alone stops waiting for a statement in flight. What each job gets does not
//! change: its own `enqueued` event and hash chain, its own epoch, its own
//! trace; the call returns once its job is committed (and its wake-up
//! sent). What changes is that a job commits together with jobs of other
//! calls, so one statement's failure concerns them all:
//! - the database refused the statement (nothing was written): each call
//!   enqueues its job again alone and gets its own answer;
//! - no answer came (a connection lost mid-statement): the jobs may be
//!   written, so no call retries; each gets the error, as it would alone.
//!
//! Only jobs without a key or uniqueness window share (`shares`): a keyed
//! job's insert may wait for another transaction that holds its key (an
//! enqueue of the same key in a caller's open transaction, a purge), and a
//! shared statement would make every job in it wait as long.
//!
//! Shared statements run on a task of their own, so a caller that stops
//! waiting stops nobody else's job. The task runs on the runtime of the
//! call that started it: a `Ledger`, like its sqlx pool, belongs to one
//! runtime that keeps running (one whose `block_on` has returned runs no
//! task, and single enqueues from elsewhere would queue behind it). A
//! ledger with test hooks or its own context timing (`with_hooks`,
//! `remember_context_for`) shares with its own clones only; a hook runs on
//! the shared task, so a hook that makes a single enqueue without a key
//! through its own ledger waits for itself.

use sqlx::PgConnection;
use std::sync::Mutex;
use tokio::sync::oneshot;

use super::enqueue::{insert_decided, resolve, Enqueued};
use super::error::{LedgerError, LedgerResult};
use super::Ledger;
use crate::domain::NewJob;
use crate::store::StoreError;

/// Shared inserts running at once. One: W1 (8 clients) measured 3,258 and
/// 3,642 jobs/s with one, about 3,000 with two, 2,600 with three and 2,200
/// with four; the calls that wait while one statement commits make the
/// next statement larger. A shared statement waits on no other
/// transaction's row lock (only jobs without a key share: see `shares`);
/// a table lock (DDL, `LOCK TABLE`) holds it up as it holds up every
/// enqueue, and the queue with it.
const RUNNING_MAX: usize = 1;
/// The most jobs in one shared statement (the rest wait for the next).
const BATCH_MAX: usize = 256;

/// Single enqueues waiting to share a statement.
#[derive(Default)]
pub(crate) struct Combiner(Mutex<State>);

impl std::fmt::Debug for Combiner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Combiner")
    }
}

#[derive(Default)]
struct State {
    queued: Vec<Pending>,
    running: usize,
}

struct Pending {
    new: NewJob,
    actor: String,
    trace: Option<String>,
    reply: oneshot::Sender<Shared>,
}

/// What became of a shared enqueue.
pub(super) enum Shared {
    Done(Box<LedgerResult<Enqueued>>),
    /// Not written: the caller enqueues it alone.
    Alone(NewJob),
}

/// Whether a job may share a statement: one whose insert takes no lock
/// another transaction may hold (its key's unique index entry, its key's
/// floor).
pub(super) fn shares(new: &NewJob) -> bool {
    new.job_key.is_none() && new.unique_for_ms.is_none()
}

impl Ledger {
    /// A single enqueue outside a caller's transaction: its own span (the
    /// job's trace names it), then shared with concurrent single enqueues
    /// (ledger::combine), or alone.
    pub(super) async fn enqueue_single(&self, new: NewJob, actor: &str) -> LedgerResult<Enqueued> {
        use tracing::Instrument;
        self.check_draft(&new, actor)?;
        let span = tracing::info_span!("jobledger.enqueue", n = 1usize, actor = %actor);
        async {
            let trace = crate::telemetry::here();
            if !shares(&new) {
                return self.enqueue_alone(new, actor, trace).await;
            }
            match self.share(new, actor, trace.clone()).await {
                Shared::Done(done) => *done,
                Shared::Alone(new) => self.enqueue_alone(new, actor, trace).await,
            }
        }
        .instrument(span)
        .await
    }

    /// One checked job, in a statement of its own with the remembered
    /// context, its trace given (the caller's span, captured before the
    /// enqueue was handed on).
    pub(super) async fn enqueue_alone(
        &self,
        new: NewJob,
        actor: &str,
        trace: Option<String>,
    ) -> LedgerResult<Enqueued> {
        let mut conn = self.pool.acquire().await?;
        self.enqueue_alone_on(&mut conn, new, actor, trace).await
    }

    /// `enqueue_alone` on a connection already acquired.
    async fn enqueue_alone_on(
        &self,
        conn: &mut PgConnection,
        new: NewJob,
        actor: &str,
        trace: Option<String>,
    ) -> LedgerResult<Enqueued> {
        // No explicit transaction: the epoch/clock read needs none, and the
        // job and its first event are written by one (atomic) statement.
        // Two round trips instead of four.
        let mut tries = 0;
        let (news, traces) = (std::slice::from_ref(&new), std::slice::from_ref(&trace));
        loop {
            let hooks = Some(&self.hooks);
            let cache = Some(&self.context);
            let done = match insert_decided(conn, news, &[None], hooks, actor, cache, Some(traces)).await {
                Ok(written) => resolve(conn, written, actor).await,
                Err(e) => Err(e),
            };
            if done.is_err() {
                self.context.forget();
            }
            match done.map(|mut v| v.pop().expect("one in, one out")) {
                // The key's previous lifecycle was purged after our epoch was
                // drawn: nothing was written; draw again.
                Err(LedgerError::Store(e))
                    if e.sqlstate().as_deref() == Some(crate::store::EPOCH_BELOW_PURGED) && tries < 5 =>
                {
                    tries += 1;
                }
                other => return other,
            }
        }
    }

    /// Hands a checked job to a shared insert and waits for its answer.
    pub(super) async fn share(&self, new: NewJob, actor: &str, trace: Option<String>) -> Shared {
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut s = self.combiner.0.lock().expect("combiner lock");
            s.queued.push(Pending {
                new,
                actor: actor.to_string(),
                trace,
                reply,
            });
            let free = s.running < RUNNING_MAX;
            s.running += usize::from(free);
            free
        };
        if start {
            // The slot goes with the task from here: a task dropped before
            // it first runs (a runtime stopping) still gives it back.
            let slot = Slot(Some(self.clone()));
            tokio::spawn(async move { slot.run().await });
        }
        // The task ended without answering (a panic, or the runtime stopping
        // mid-statement): the job may be written, so it is not retried.
        answer.await.unwrap_or_else(|_| {
            Shared::Done(Box::new(Err(LedgerError::Store(StoreError::Db(
                sqlx::Error::WorkerCrashed,
            )))))
        })
    }

    /// For tests: whether a shared statement's task is running.
    #[doc(hidden)]
    pub fn shared_enqueue_running(&self) -> bool {
        self.combiner.0.lock().expect("combiner lock").running > 0
    }

    /// For tests: single enqueues queued for the next shared statement.
    #[doc(hidden)]
    pub fn enqueues_waiting(&self) -> usize {
        self.combiner.0.lock().expect("combiner lock").queued.len()
    }

    async fn answer(&self, mut together: Vec<Pending>, actor: &str) {
        // Checked before the connection is taken too: a group whose callers
        // all left takes none, so the next group does not wait behind it.
        together.retain(|p| !p.reply.is_closed());
        if together.is_empty() {
            return;
        }
        let mut conn = match self.pool.acquire().await {
            Ok(conn) => conn,
            // The pool's timeout is each call's answer, as alone: none
            // waits for it twice.
            Err(e) => {
                let e = LedgerError::from(e);
                for p in together {
                    let _ = p.reply.send(Shared::Done(Box::new(Err(unanswered(&e)))));
                }
                return;
            }
        };
        // A caller that stopped waiting before its statement is built
        // (while queued, or while this statement waited for its connection)
        // takes its job back: nothing of it is written, so a keyless job
        // retried after a timeout is not written twice.
        together.retain(|p| !p.reply.is_closed());
        if together.len() <= 1 {
            // One call: as alone, on the connection it waited for.
            if let Some(p) = together.pop() {
                let done = self.enqueue_alone_on(&mut conn, p.new, actor, p.trace).await;
                let _ = p.reply.send(Shared::Done(Box::new(done)));
            }
            return;
        }
        let n = together.len();
        let (mut news, mut traces, mut replies) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for p in together {
            news.push(p.new);
            traces.push(p.trace);
            replies.push(p.reply);
        }
        let ties = vec![None; n];
        let (hooks, cache) = (Some(&self.hooks), Some(&self.context));
        let written = insert_decided(&mut conn, &news, &ties, hooks, actor, cache, Some(&traces)).await;
        let replies = news.into_iter().zip(replies);
        match written {
            Ok(w) => {
                for ((new, reply), (_, job)) in replies.zip(w.drafts) {
                    let answer = match w.inserted.get(&job.job_id) {
                        Some(position) => Shared::Done(Box::new(Ok(Enqueued {
                            job,
                            created: true,
                            position: Some(*position),
                        }))),
                        // Cannot happen without a key; the call finds out alone.
                        None => Shared::Alone(new),
                    };
                    let _ = reply.send(answer);
                }
            }
            Err(e) => {
                self.context.forget();
                let unwritten = nothing_written(&e);
                for (new, reply) in replies {
                    let answer = match unwritten {
                        true => Shared::Alone(new),
                        false => Shared::Done(Box::new(Err(unanswered(&e)))),
                    };
                    let _ = reply.send(answer);
                }
            }
        }
    }
}

/// The one running slot, held by the task that runs shared statements.
/// Given back when the queue is empty, or when the task ends any other way
/// (a panic, a runtime stopping): then the calls still queued get an error
/// (`share`), and the next call starts a task again. Nothing can leave the
/// slot taken with no task to empty the queue.
/// (None once the task has given it back itself.)
struct Slot(Option<Ledger>);

impl Slot {
    /// Statements until nothing is queued.
    async fn run(mut self) {
        let ledger = self.0.clone().expect("a slot holds its ledger until it ends");
        loop {
            let mut batch = {
                let mut s = ledger.combiner.0.lock().expect("combiner lock");
                if s.queued.is_empty() {
                    s.running -= 1;
                    self.0 = None;
                    return;
                }
                let n = s.queued.len().min(BATCH_MAX);
                s.queued.drain(..n).collect::<Vec<_>>()
            };
            // One statement per actor (the events record it).
            while !batch.is_empty() {
                let actor = batch[0].actor.clone();
                let (same, rest): (Vec<Pending>, Vec<Pending>) =
                    batch.into_iter().partition(|p| p.actor == actor);
                batch = rest;
                ledger.answer(same, &actor).await;
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(ledger) = self.0.take() else {
            return;
        };
        let mut s = ledger.combiner.0.lock().unwrap_or_else(|p| p.into_inner());
        s.running -= 1;
        // Their answers go with them: each call gets an error.
        s.queued.clear();
    }
}

/// The database refused the statement, or it failed before anything was
/// sent: no job of it was written, and each call may try alone.
fn nothing_written(e: &LedgerError) -> bool {
    match e {
        LedgerError::Store(StoreError::Db(db)) => matches!(db, sqlx::Error::Database(_)),
        // Decided before anything was sent (a registered policy unreadable).
        _ => true,
    }
}

/// A shared statement's error, for each of its calls: of the same kind
/// (retryable or not, as `LedgerError::is_retryable` reads it) as the
/// error the call would have had alone.
fn unanswered(e: &LedgerError) -> LedgerError {
    let db = match e {
        LedgerError::Store(StoreError::Db(db)) => db,
        _ => return LedgerError::Store(StoreError::Db(sqlx::Error::Protocol(e.to_string()))),
    };
    let msg = format!("a shared enqueue's statement got no answer, the job may be written: {e}");
    let copy = match db {
        sqlx::Error::PoolTimedOut => sqlx::Error::PoolTimedOut,
        sqlx::Error::PoolClosed => sqlx::Error::PoolClosed,
        sqlx::Error::WorkerCrashed => sqlx::Error::WorkerCrashed,
        sqlx::Error::Io(io) => sqlx::Error::Io(std::io::Error::new(io.kind(), msg)),
        sqlx::Error::Tls(_) => sqlx::Error::Io(std::io::Error::other(msg)),
        _ => sqlx::Error::Protocol(msg),
    };
    LedgerError::Store(StoreError::Db(copy))
}
