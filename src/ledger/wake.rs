//! Wake-ups for the listeners of the log (`jobledger_events`: the relay,
//! log readers), of queues (`jobledger_queued`: workers) and of cancels
//! (`jobledger_cancel`: the worker running the job), sent after the
//! transaction that wrote them commits, not from inside it.
//!
//! Why: PostgreSQL takes one database-wide lock when a transaction that
//! called `NOTIFY` commits, and holds it across the commit's WAL flush, so
//! every notifying transaction commits after the one before it has reached
//! the disk: no group commit. Eight clients inserting a row each reach
//! 14,900 transactions/s here without a `NOTIFY` and 4,100 with one
//! (pgbench, docs/benchmarks.md). The ledger's own transactions (those it
//! begins and commits: `deferred`) only record what to wake; after the
//! commit, one notifier per pool sends what every transaction recorded
//! meanwhile, in one statement whose commit does not wait for its flush.
//!
//! A write inside the caller's transaction (`enqueue_in`, a write on a
//! caller's connection) notifies inside it, as PostgreSQL's `NOTIFY`
//! always did: delivered exactly when that transaction commits.
//!
//! What a wake-up may do: arrive late (a crash between the commit and the
//! notifier loses it; listeners poll, docs/architecture.md) or arrive for a
//! transaction that rolled back. Listeners treat it as "look again", never
//! as news: nothing is read from it but which queue or job to look at.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};

use sqlx::{PgConnection, PgPool};

use crate::domain::{Job, JobState};
use crate::store::{wake as sql, StoreResult};

pub(crate) const EVENTS: &str = "jobledger_events";
pub(crate) const QUEUED: &str = "jobledger_queued";
pub(crate) const CANCEL: &str = "jobledger_cancel";

/// What a write wakes: `(channel, payload)`, each once.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Notes(BTreeSet<(&'static str, String)>);

impl Notes {
    /// The log grew.
    pub(crate) fn events() -> Self {
        let mut n = Notes::default();
        n.0.insert((EVENTS, String::new()));
        n
    }

    /// A job written (`before` is `None` for a new one): its queue when it
    /// became claimable, itself when its cancel was requested.
    pub(crate) fn job(&mut self, before: Option<&Job>, after: &Job) {
        let was = before.map(|b| b.state);
        if after.state == JobState::Queued && was != Some(JobState::Queued) {
            self.0.insert((QUEUED, after.queue.clone()));
        }
        if after.state == JobState::CancelRequested && was != Some(JobState::CancelRequested) {
            self.0.insert((CANCEL, after.job_id.to_string()));
        }
    }

    fn merge(&mut self, other: Notes) {
        self.0.extend(other.0);
    }

    fn columns(&self) -> (Vec<&'static str>, Vec<String>) {
        self.0.iter().map(|(c, p)| (*c, p.clone())).unzip()
    }
}

tokio::task_local! {
    /// What the writes inside `deferred` recorded.
    static DEFERRED: RefCell<Notes>;
}

/// Records what a write on `conn` wakes: for `deferred`'s notifier when the
/// write runs inside it, else as a `NOTIFY` in `conn`'s transaction.
pub(crate) async fn note(conn: &mut PgConnection, notes: Notes) -> StoreResult<()> {
    let notes = match DEFERRED.try_with(|d| d.borrow_mut().merge(notes.clone())) {
        Ok(()) => return Ok(()),
        Err(_) => notes,
    };
    let (channels, payloads) = notes.columns();
    sql::notify_in(conn, &channels, &payloads).await
}

/// Runs `f`, which begins and commits its own transactions on `pool`, and
/// then sends what its writes recorded. Only for code that commits inside
/// `f`: a write left for a caller to commit must not be announced first.
pub(crate) async fn deferred<F: Future>(pool: &PgPool, f: F) -> F::Output {
    // On the heap: the scope would otherwise hold a copy of every write
    // path's whole state machine, moved on the stack (a debug build's test
    // thread overflowed).
    let f = Box::pin(f);
    let (out, notes) = DEFERRED
        .scope(RefCell::new(Notes::default()), async {
            let out = f.await;
            (out, DEFERRED.with(|d| d.take()))
        })
        .await;
    send(pool, notes);
    out
}

/// Per pool: what waits to be sent, and whether a send is under way. A
/// send takes everything recorded so far, so wake-ups of transactions that
/// commit together leave in one statement.
#[derive(Default)]
struct Pending {
    notes: Notes,
    sending: bool,
}

/// Keyed by the pool's shared options (one allocation per pool, shared by
/// its clones). An entry holds no pool: a send borrows a clone for as long
/// as it runs, so a pool that is dropped closes as before.
fn pending(pool: &PgPool) -> Arc<Mutex<Pending>> {
    static ALL: OnceLock<Mutex<HashMap<usize, Arc<Mutex<Pending>>>>> = OnceLock::new();
    let key = Arc::as_ptr(&pool.connect_options()) as usize;
    ALL.get_or_init(Default::default)
        .lock()
        .expect("wake registry")
        .entry(key)
        .or_default()
        .clone()
}

fn send(pool: &PgPool, notes: Notes) {
    if notes.0.is_empty() {
        return;
    }
    let p = pending(pool);
    {
        let mut g = p.lock().expect("pending wake-ups");
        g.notes.merge(notes);
        if g.sending {
            return;
        }
        g.sending = true;
    }
    let pool = pool.clone();
    tokio::spawn(async move {
        loop {
            let batch = {
                let mut g = p.lock().expect("pending wake-ups");
                if g.notes.0.is_empty() {
                    g.sending = false;
                    return;
                }
                std::mem::take(&mut g.notes)
            };
            let (channels, payloads) = batch.columns();
            if let Err(e) = sql::notify_detached(&pool, &channels, &payloads).await {
                // Listeners poll: a lost wake-up costs latency, not work.
                tracing::warn!(
                    "could not send {} wake-ups ({e}); listeners will find the work by polling",
                    channels.len()
                );
            }
        }
    });
}
