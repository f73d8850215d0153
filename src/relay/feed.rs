//! The relay's feed: reads the log and finds each event's job keys on a
//! task of its own, a batch ahead of the task that encodes and sends it
//! (`send.rs`), which is itself ahead of the loop that waits for the
//! broker's acknowledgements and moves the checkpoint.

use sqlx::postgres::PgListener;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{message, RelayError};
use crate::ledger::{Ledger, LedgerError};
use crate::reader::{Batch, Checkpoint, LogEvent, LogReader};
use crate::store::jobs::{self, JobKeys};

/// A batch read, with each event's job keys (its queue, key and workflow
/// tie) in the batch's order; `None` for a job the log no longer names.
pub(super) struct Read {
    pub batch: Batch,
    pub keys: Vec<Option<Arc<JobKeys>>>,
}

pub(super) struct Feed {
    pub ledger: Ledger,
    pub reader: LogReader,
    pub batch: i64,
    pub poll: Duration,
    /// Woken by `jobledger_events`; without it the feed polls.
    pub listener: Option<PgListener>,
}

/// Aborts the feed when the session ends, however it ends.
pub(super) struct AbortOnDrop(pub tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Feed {
    /// Hands out every non-empty batch after `from`, in order, until the
    /// shutdown or the receiver goes away. An error is handed out too, and
    /// ends the feed (the session then ends and starts again from the
    /// database checkpoint).
    pub async fn run(
        mut self,
        from: Checkpoint,
        out: mpsc::Sender<Result<Read, RelayError>>,
        shutdown: CancellationToken,
    ) {
        let mut at = from;
        let mut keys = KeyCache::default();
        let mut last_pin_report = Instant::now() - Duration::from_secs(60);
        while !shutdown.is_cancelled() {
            let read = match self.read(at, &mut keys).await {
                Ok(e) => e,
                Err(e) => {
                    let _ = out.send(Err(e)).await;
                    return;
                }
            };
            if read.batch.events.is_empty() {
                if last_pin_report.elapsed() > Duration::from_secs(10) {
                    report_pin(&self.reader, at).await;
                    last_pin_report = Instant::now();
                }
                let wait = tokio::time::sleep(self.poll);
                match self.listener.as_mut() {
                    Some(l) => {
                        tokio::select! { _ = shutdown.cancelled() => {}, _ = l.recv() => {}, _ = wait => {} }
                    }
                    None => tokio::select! { _ = shutdown.cancelled() => {}, _ = wait => {} },
                }
                continue;
            }
            at = read.batch.next;
            if out.send(Ok(read)).await.is_err() {
                return;
            }
        }
    }

    /// The batch after `from` with each event's keys, found in `keys`, else
    /// looked up.
    async fn read(&self, from: Checkpoint, keys: &mut KeyCache) -> Result<Read, RelayError> {
        let batch = self.reader.read_raw(from, self.batch).await?;
        if batch.events.is_empty() {
            return Ok(Read { batch, keys: vec![] });
        }
        keys.learn(&batch.events);
        let mut ids: Vec<Uuid> = batch
            .events
            .iter()
            .map(|e| e.row.job_id)
            .filter(|id| !keys.0.contains_key(id))
            .collect();
        ids.sort();
        ids.dedup();
        if !ids.is_empty() {
            let found = jobs::job_keys(self.ledger.pool(), &ids)
                .await
                .map_err(LedgerError::from)?;
            keys.0.extend(found.into_iter().map(|k| (k.job_id, Arc::new(k))));
        }
        let keys = batch
            .events
            .iter()
            .map(|e| keys.0.get(&e.row.job_id).cloned())
            .collect();
        Ok(Read { batch, keys })
    }
}

/// Each job's queue, key and workflow tie, which never change after its
/// `enqueued` event: read off that event when the relay sees it, else
/// looked up once (a query per batch was a quarter of the relay's time).
/// Emptied when it would pass `KEY_CACHE_JOBS`, so its memory stays bounded.
#[derive(Default)]
struct KeyCache(HashMap<Uuid, Arc<JobKeys>>);

const KEY_CACHE_JOBS: usize = 200_000;

impl KeyCache {
    fn learn(&mut self, events: &[LogEvent]) {
        if self.0.len() + events.len() > KEY_CACHE_JOBS {
            self.0.clear();
        }
        for e in events.iter().filter(|e| e.row.version == 1) {
            if let Some(k) = message::keys_of_enqueued(e) {
                self.0.insert(k.job_id, Arc::new(k));
            }
        }
    }
}

/// The relay's lag, and the open transaction that holds it back if any.
async fn report_pin(reader: &LogReader, cp: Checkpoint) {
    if let Ok(lag) = reader.lag(cp).await {
        metrics::gauge!("jobledger_relay_lag_events").set(lag.events as f64);
        metrics::gauge!("jobledger_relay_lag_seconds").set(lag.seconds);
        if lag.events > 0 {
            if let Some(h) = lag.horizon_holder {
                tracing::warn!(
                    "relay: {} event(s) wait behind an open {} transaction (xid {}): pid {:?} gid {:?} in database {:?}, open {:.1}s ({:?})",
                    lag.events, h.kind, h.xid, h.pid, h.gid, h.database, h.open_seconds.unwrap_or(0.0), h.query
                );
            }
        }
    }
}
