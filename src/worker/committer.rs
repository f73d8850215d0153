//! Batched completions: whatever completions are waiting when the previous
//! batch finishes go into one transaction, each still fenced on its own.

use serde_json::Value;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

use super::metrics as m;
use crate::ledger::{Lease, Ledger, LedgerResult, WriteResult};

pub(crate) type Reply = oneshot::Sender<LedgerResult<WriteResult>>;
pub(crate) type Item = (Lease, Option<Value>, Reply);

pub(crate) async fn run(ledger: Ledger, mut rx: mpsc::Receiver<Item>, max_batch: usize) {
    let mut batch: Vec<Item> = Vec::with_capacity(max_batch);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let started = Instant::now();
        let items: Vec<(&Lease, Option<Value>)> = batch.iter().map(|(l, r, _)| (l, r.clone())).collect();
        match Lease::complete_many(&ledger, items).await {
            Ok(results) => {
                for ((_, _, reply), r) in batch.drain(..).zip(results) {
                    let _ = reply.send(Ok(r));
                }
            }
            // One bad batch must not fail its neighbours: fall back to one
            // transaction each, so every completion gets its own answer.
            Err(e) => {
                tracing::warn!("batched completion failed ({e}); completing one by one");
                for (lease, result, reply) in batch.drain(..) {
                    let _ = reply.send(lease.complete(result).await);
                }
            }
        }
        metrics::histogram!(m::COMPLETE_SECONDS).record(started.elapsed().as_secs_f64());
    }
}
