//! The relay's feed: reads the log and encodes each batch's messages on a
//! task of its own, one batch ahead of the loop that publishes them.

use sqlx::postgres::PgListener;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{message, RelayError};
use crate::ledger::{Ledger, LedgerError};
use crate::reader::{Batch, Checkpoint, LogEvent, LogReader};
use crate::store::jobs::{self, JobKeys};

/// A batch and its messages, in the batch's order.
pub(super) type Encoded = (Batch, Vec<message::Message>);

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
    /// ends the feed (the session then ends and starts again).
    pub async fn run(
        mut self,
        from: Checkpoint,
        out: mpsc::Sender<Result<Encoded, RelayError>>,
        shutdown: CancellationToken,
    ) {
        let mut at = from;
        let mut keys = KeyCache::default();
        let mut last_pin_report = Instant::now() - Duration::from_secs(60);
        while !shutdown.is_cancelled() {
            let encoded = match self.encoded(at, &mut keys).await {
                Ok(e) => e,
                Err(e) => {
                    let _ = out.send(Err(e)).await;
                    return;
                }
            };
            if encoded.0.events.is_empty() {
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
            at = encoded.0.next;
            if out.send(Ok(encoded)).await.is_err() {
                return;
            }
        }
    }

    /// The batch after `from` with its messages encoded (the queue, key and
    /// workflow tie of each job found in `keys`, else looked up).
    async fn encoded(&self, from: Checkpoint, keys: &mut KeyCache) -> Result<Encoded, RelayError> {
        let batch = self.reader.read(from, self.batch).await?;
        if batch.events.is_empty() {
            return Ok((batch, vec![]));
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
            keys.0.extend(found.into_iter().map(|k| (k.job_id, k)));
        }
        let messages = batch
            .events
            .iter()
            .map(|e| {
                let k = keys.0.get(&e.row.job_id);
                let queue = k.map_or("", |k| k.queue.as_str());
                let tie = k.and_then(|k| k.parent.as_deref().zip(k.step.as_deref()));
                message::message(e, queue, k.and_then(|k| k.job_key.as_deref()), tie)
            })
            .collect();
        Ok((batch, messages))
    }
}

/// Each job's queue, key and workflow tie, which never change after its
/// `enqueued` event: read off that event when the relay sees it, else
/// looked up once (a query per batch was a quarter of the relay's time).
/// Emptied when it would pass `KEY_CACHE_JOBS`, so its memory stays bounded.
#[derive(Default)]
struct KeyCache(HashMap<Uuid, JobKeys>);

const KEY_CACHE_JOBS: usize = 200_000;

impl KeyCache {
    fn learn(&mut self, events: &[LogEvent]) {
        if self.0.len() + events.len() > KEY_CACHE_JOBS {
            self.0.clear();
        }
        for e in events.iter().filter(|e| e.row.version == 1) {
            if let Some(k) = message::keys_of_enqueued(e) {
                self.0.insert(k.job_id, k);
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
