//! A log source that holds one chosen read until the test opens its gate,
//! so a test can stop a projection runner between its read and its write
//! (or between its last read and its switch) and move another runner in
//! that window.

use jobledger::reader::LogReader;
use jobledger_projections::{BoxFuture, Checkpoint, DataWanted, Event, LogSource, ProjectionError};
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::{mpsc, Mutex};

pub struct GatedLog<'a> {
    inner: &'a LogReader,
    at: Checkpoint,
    /// Reads from `at` still let through before the gated one; the gated
    /// read is the one that finds this at 0 (later reads pass again).
    pass: AtomicUsize,
    read_done: mpsc::Sender<()>,
    gate: Mutex<mpsc::Receiver<()>>,
}

/// The test's side of the gate: `held` answers once the gated read has
/// returned from the log (and waits), `open` lets it go on.
pub struct Gate {
    pub held: mpsc::Receiver<()>,
    pub open: mpsc::Sender<()>,
}

impl Gate {
    pub async fn wait_held(&mut self) {
        super::within("the gated read", self.held.recv())
            .await
            .expect("gate");
    }
    pub async fn release(&self) {
        self.open.send(()).await.expect("gate");
    }
}

/// Holds the read from `at` that comes after `pass` reads from `at`.
pub fn gated(inner: &LogReader, at: Checkpoint, pass: usize) -> (GatedLog<'_>, Gate) {
    let (read_done, held) = mpsc::channel(1);
    let (open, gate) = mpsc::channel(1);
    let log = GatedLog {
        inner,
        at,
        pass: AtomicUsize::new(pass + 1),
        read_done,
        gate: Mutex::new(gate),
    };
    (log, Gate { held, open })
}

impl LogSource for GatedLog<'_> {
    fn read(
        &self,
        after: Checkpoint,
        limit: i64,
        data: DataWanted,
    ) -> BoxFuture<'_, Result<(Vec<Event>, Checkpoint), ProjectionError>> {
        Box::pin(async move {
            let out = LogSource::read(self.inner, after, limit, data).await?;
            let left = (after == self.at)
                .then(|| {
                    self.pass
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                })
                .and_then(Result::ok);
            if left == Some(1) {
                self.read_done.send(()).await.expect("the test waits");
                self.gate.lock().await.recv().await;
            }
            Ok(out)
        })
    }
    fn behind(&self, after: Checkpoint) -> BoxFuture<'_, Result<bool, ProjectionError>> {
        LogSource::behind(self.inner, after)
    }
}
