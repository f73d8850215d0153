//! Batched completions: whatever completions are waiting when the previous
//! batch finishes go into one transaction, each still fenced on its own.

use serde_json::Value;
use std::collections::{HashSet, VecDeque};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use uuid::Uuid;

use super::metrics as m;
use crate::domain::workflow::Membership;
use crate::ledger::{Lease, Ledger, LedgerResult, WriteResult};

pub(crate) type Reply = oneshot::Sender<LedgerResult<WriteResult>>;
pub(crate) type Item = (Lease, Option<Value>, Reply);

/// Batches in flight at once: while one commits, the next gathers and
/// commits beside it (each batch locks its own jobs in id order, then their
/// workflow parents in id order, so two batches never deadlock).
const IN_FLIGHT: usize = 2;

/// The workflow parent a completion will lock (and hold to its commit).
fn parent_of(item: &Item) -> Option<Uuid> {
    match item.0.job().and_then(|j| j.workflow.as_ref()) {
        Some(Membership::Step(link)) => Some(link.parent),
        _ => None,
    }
}

pub(crate) async fn run(ledger: Ledger, rx: mpsc::Receiver<Item>, max_batch: usize) {
    let rules = Rules {
        max_batch,
        in_flight: IN_FLIGHT,
        parent: parent_of,
    };
    schedule(rx, rules, move |batch| {
        let ledger = ledger.clone();
        async move { commit(&ledger, batch).await }
    })
    .await;
}

struct Rules<T> {
    max_batch: usize,
    in_flight: usize,
    parent: fn(&T) -> Option<Uuid>,
}

/// Parents locked by the batches in flight. Two batches that count steps of
/// one parent would take turns on its row: the second waits for the first
/// one's commit with its own rows locked, which undoes having two in flight
/// (a fan-out's branches end together). So a completion whose parent is
/// busy waits for the next batch instead, where it joins its siblings.
/// (A set: a busy parent is never taken by a second batch.)
#[derive(Default)]
struct Busy(HashSet<Uuid>);

impl Busy {
    fn free(&self, parent: Option<Uuid>) -> bool {
        parent.is_none_or(|p| !self.0.contains(&p))
    }
    fn take(&mut self, parents: &[Uuid]) {
        self.0.extend(parents.iter().copied());
    }
    fn give_back(&mut self, parents: Vec<Uuid>) {
        for p in parents {
            self.0.remove(&p);
        }
    }
}

/// What `schedule` is gathering: the next batch, and the completions held
/// back because their parent is busy (they go first into a later batch).
struct Gather<T> {
    batch: Vec<T>,
    parents: Vec<Uuid>,
    deferred: VecDeque<(Option<Uuid>, T)>,
}

impl<T> Gather<T> {
    fn offer(&mut self, busy: &Busy, max: usize, parent: Option<Uuid>, item: T) {
        if self.batch.len() < max && busy.free(parent) {
            self.parents.extend(parent);
            self.batch.push(item);
        } else {
            self.deferred.push_back((parent, item));
        }
    }
    fn refill(&mut self, busy: &Busy, max: usize) {
        for (parent, item) in std::mem::take(&mut self.deferred) {
            self.offer(busy, max, parent, item);
        }
    }
}

/// Items held back at most, per batch size: beyond that the channel's own
/// bound pushes back on the handlers again.
const DEFERRED_PER_BATCH: usize = 4;

/// Batches whatever is waiting, at most `in_flight` batches committing at
/// once, never two with the same parent; every item received is committed
/// before it returns (also the deferred ones once the channel closes), and a
/// deferred item goes before anything received after it.
async fn schedule<T, F, Fut>(mut rx: mpsc::Receiver<T>, rules: Rules<T>, commit: F)
where
    T: Send + 'static,
    F: Fn(Vec<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let max = rules.max_batch.max(1);
    let mut running: JoinSet<Vec<Uuid>> = JoinSet::new();
    let mut busy = Busy::default();
    let mut g = Gather {
        batch: vec![],
        parents: vec![],
        deferred: VecDeque::new(),
    };
    let mut open = true;
    loop {
        if running.len() >= rules.in_flight {
            if let Some(done) = running.join_next().await {
                busy.give_back(done.unwrap_or_default());
            }
        }
        g.refill(&busy, max);
        if g.batch.is_empty() && !open {
            if g.deferred.is_empty() {
                break;
            }
            // Only a finishing batch frees a deferred item's parent; with
            // nothing in flight every parent is free.
            match running.join_next().await {
                Some(done) => busy.give_back(done.unwrap_or_default()),
                None => busy.0.clear(),
            }
            continue;
        }
        let room = g.deferred.len() < DEFERRED_PER_BATCH * max;
        if g.batch.is_empty() {
            tokio::select! {
                item = rx.recv(), if room => match item {
                    Some(item) => g.offer(&busy, max, (rules.parent)(&item), item),
                    None => open = false,
                },
                Some(done) = running.join_next(), if !running.is_empty() => {
                    // Back to the top: the deferred items go first (else a
                    // later item of the same parent, already in the channel,
                    // could take the parent again, and again). Only a
                    // multi-threaded runtime opens that window (both branches
                    // ready at once), which no test here can force.
                    busy.give_back(done.unwrap_or_default());
                    continue;
                }
                else => busy.0.clear(),
            }
        }
        while open && g.batch.len() < max && g.deferred.len() < DEFERRED_PER_BATCH * max {
            match rx.try_recv() {
                Ok(item) => g.offer(&busy, max, (rules.parent)(&item), item),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
        }
        if g.batch.is_empty() {
            continue;
        }
        let mut parents = std::mem::take(&mut g.parents);
        parents.sort();
        parents.dedup();
        busy.take(&parents);
        let done = commit(std::mem::take(&mut g.batch));
        // A commit that panics must still give its parents back: it runs in
        // a task of its own, whose end (even a panic) this one waits for.
        running.spawn(async move {
            let _ = tokio::spawn(done).await;
            parents
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    type Batches = mpsc::UnboundedReceiver<Vec<u32>>;
    type Started = (
        mpsc::Sender<(u32, Option<Uuid>)>,
        Batches,
        tokio::task::JoinHandle<()>,
    );

    /// Items are (id, parent); the k-th batch committed waits for `gates[k]`
    /// (batches beyond the gates commit at once).
    fn start(gates: Vec<oneshot::Receiver<()>>) -> Started {
        let (tx, rx) = mpsc::channel(64);
        let (seen_tx, seen) = mpsc::unbounded_channel();
        let gates = Arc::new(Mutex::new(VecDeque::from(gates)));
        let rules = Rules {
            max_batch: 8,
            in_flight: 2,
            parent: |i: &(u32, Option<Uuid>)| i.1,
        };
        let task = tokio::spawn(schedule(rx, rules, move |batch: Vec<(u32, Option<Uuid>)>| {
            let gate = gates.lock().unwrap().pop_front();
            let _ = seen_tx.send(batch.iter().map(|i| i.0).collect());
            async move {
                if let Some(g) = gate {
                    let _ = g.await;
                }
            }
        }));
        (tx, seen, task)
    }

    async fn next(seen: &mut Batches) -> Vec<u32> {
        tokio::time::timeout(std::time::Duration::from_secs(10), seen.recv())
            .await
            .expect("a batch within 10 s")
            .expect("the scheduler is alive")
    }

    /// Lets every task that can run do so (the test runtime has one thread).
    async fn settle() {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_completion_waits_for_the_batch_that_holds_its_parent() {
        let (p, q) = (Uuid::now_v7(), Uuid::now_v7());
        let (open, gate) = oneshot::channel();
        let (tx, mut seen, task) = start(vec![gate]);
        tx.send((1, Some(p))).await.unwrap();
        assert_eq!(next(&mut seen).await, vec![1]);
        // Batch [1] holds p: 2 (same parent) must not commit beside it; 3 may.
        tx.send((2, Some(p))).await.unwrap();
        tx.send((3, Some(q))).await.unwrap();
        tx.send((4, None)).await.unwrap();
        let second = next(&mut seen).await;
        assert!(
            !second.contains(&2),
            "2 shared p with the batch in flight: {second:?}"
        );
        open.send(()).unwrap();
        let mut rest = second;
        while rest.len() < 3 {
            rest.extend(next(&mut seen).await);
        }
        rest.sort();
        assert_eq!(rest, vec![2, 3, 4]);
        drop(tx);
        task.await.unwrap();
    }

    #[tokio::test]
    async fn a_deferred_completion_is_still_committed_after_the_channel_closes() {
        let (p, q) = (Uuid::now_v7(), Uuid::now_v7());
        let ((open_p, gate_p), (open_q, gate_q)) = (oneshot::channel(), oneshot::channel());
        let (tx, mut seen, task) = start(vec![gate_p, gate_q]);
        tx.send((1, Some(p))).await.unwrap();
        assert_eq!(next(&mut seen).await, vec![1]);
        // 2 is held back (p is busy), 3 commits beside [1], then the channel
        // closes: all before the scheduler runs again (one thread).
        tx.send((2, Some(p))).await.unwrap();
        tx.send((3, Some(q))).await.unwrap();
        drop(tx);
        assert_eq!(next(&mut seen).await, vec![3]);
        // The batch of q ends first: p is still busy, 2 must wait on.
        open_q.send(()).unwrap();
        settle().await;
        open_p.send(()).unwrap();
        assert_eq!(next(&mut seen).await, vec![2]);
        task.await.unwrap();
        assert!(seen.recv().await.is_none(), "nothing committed twice");
    }

    #[tokio::test]
    async fn a_commit_that_panics_gives_its_parent_back() {
        let p = Uuid::now_v7();
        let (tx, rx) = mpsc::channel(8);
        let (seen_tx, mut seen) = mpsc::unbounded_channel();
        let rules = Rules {
            max_batch: 8,
            in_flight: 2,
            parent: |i: &(u32, Option<Uuid>)| i.1,
        };
        let task = tokio::spawn(schedule(rx, rules, move |batch: Vec<(u32, Option<Uuid>)>| {
            let ids: Vec<u32> = batch.iter().map(|i| i.0).collect();
            let seen_tx = seen_tx.clone();
            async move {
                let _ = seen_tx.send(ids.clone());
                assert!(ids != vec![1], "the first commit fails");
            }
        }));
        tx.send((1, Some(p))).await.unwrap();
        assert_eq!(next(&mut seen).await, vec![1]);
        settle().await;
        tx.send((2, Some(p))).await.unwrap();
        assert_eq!(
            next(&mut seen).await,
            vec![2],
            "p was freed by the panicking batch"
        );
        drop(tx);
        task.await.unwrap();
    }
}
