//! Worker test support: a worker on queue `q` of a test database, started
//! and stopped as a task.

use super::TestDb;
use jobledger::worker::{Worker, WorkerBuilder, WorkerReport};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A worker on queue `q`, 4 handlers, no sweeper, polling every 50 ms.
pub fn base(db: &TestDb, name: &str) -> WorkerBuilder {
    Worker::builder(db.ledger.clone())
        .name(name)
        .queue("q")
        .concurrency(4)
        .lease(Duration::from_secs(30))
        .heartbeat_every(Duration::from_secs(10))
        .poll_every(Duration::from_millis(50))
        .sweeper(None)
}

/// The same, but nothing wakes it except LISTEN/NOTIFY: it polls once an
/// hour and renews leases once an hour, far beyond any test's time budget.
pub fn notified_only(db: &TestDb, name: &str) -> WorkerBuilder {
    base(db, name)
        .poll_every(Duration::from_secs(3600))
        .heartbeat_every(Duration::from_secs(3600))
        .lease(Duration::from_secs(7200))
}

pub type Running = (CancellationToken, JoinHandle<WorkerReport>);

pub fn start(worker: Worker) -> Running {
    let stop = CancellationToken::new();
    let s = stop.clone();
    (
        stop,
        tokio::spawn(async move { worker.run(s).await.expect("worker runs") }),
    )
}

/// Stops the worker; fails the test if it does not drain within 60 s.
pub async fn stop(handle: Running) -> WorkerReport {
    handle.0.cancel();
    tokio::time::timeout(Duration::from_secs(60), handle.1)
        .await
        .expect("the worker stops within 60 s")
        .unwrap()
}
