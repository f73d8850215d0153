//! Batched completions: whatever completions are waiting when the previous
//! batch finishes go into one transaction, each still fenced on its own.

use serde_json::Value;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

use super::metrics as m;
use crate::ledger::{Lease, Ledger, LedgerResult, WriteResult};

pub(crate) type Reply = oneshot::Sender<LedgerResult<WriteResult>>;
pub(crate) type Item = (Lease, Option<Value>, Reply);

/// Batches in flight at once: while one commits, the next gathers and
/// commits beside it (each batch locks its own jobs in id order, then their
/// workflow parents in id order, so two batches never deadlock).
const IN_FLIGHT: usize = 2;

pub(crate) async fn run(ledger: Ledger, mut rx: mpsc::Receiver<Item>, max_batch: usize) {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut running = tokio::task::JoinSet::new();
    while let Some(first) = rx.recv().await {
        let slot = slots.clone().acquire_owned().await.expect("never closed");
        let mut batch: Vec<Item> = Vec::with_capacity(max_batch);
        batch.push(first);
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let ledger = ledger.clone();
        running.spawn(async move {
            commit(&ledger, batch).await;
            drop(slot);
        });
        while running.try_join_next().is_some() {}
    }
    while running.join_next().await.is_some() {}
}

async fn commit(ledger: &Ledger, mut batch: Vec<Item>) {
    let started = Instant::now();
    let items: Vec<(&Lease, Option<Value>)> = batch.iter().map(|(l, r, _)| (l, r.clone())).collect();
    match Lease::complete_many(ledger, items).await {
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
