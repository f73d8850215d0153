//! Issue 15: by default a worker fetches ahead as far as its handlers' pace
//! says (`worker::pace`): fast handlers get more jobs per claim, slow ones
//! exactly the concurrency ahead, as before.

mod common;

use common::workers::{base, start, stop};
use common::{fresh, new_job, within};
use jobledger::worker::{BoxFuture, HandlerOutcome, Hooks, JobContext};
use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A hook that records the largest claim, and a channel the handlers use
/// to say the last job ran.
fn largest_claim(largest: Arc<AtomicUsize>) -> Hooks {
    let hook = Arc::new(move |ids: Vec<uuid::Uuid>| {
        largest.fetch_max(ids.len(), Ordering::SeqCst);
        Box::pin(async {}) as BoxFuture<()>
    });
    Hooks {
        after_claim: Some(hook),
        ..Hooks::default()
    }
}

async fn enqueue_many(db: &common::TestDb, n: usize) {
    let news = (0..n).map(|i| new_job("q", None, json!({ "i": i }))).collect();
    db.ledger.enqueue_many_as(news, "test").await.unwrap();
}

/// Enqueues `n` jobs and runs them with a worker of 2 slots and the
/// default prefetch, each handler run taking `run` (none when zero);
/// returns the worker's report, the handler runs and the largest claim.
async fn run_all(
    db: &common::TestDb,
    n: usize,
    run: Duration,
) -> (jobledger::worker::WorkerReport, usize, usize) {
    enqueue_many(db, n).await;
    let largest = Arc::new(AtomicUsize::new(0));
    let (tx, mut done) = mpsc::channel(1);
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let w = base(db, "pace")
        .concurrency(2)
        .hooks(largest_claim(largest.clone()))
        .handler("refund", move |_ctx: JobContext| {
            let (r, tx) = (r.clone(), tx.clone());
            async move {
                if !run.is_zero() {
                    tokio::time::sleep(run).await;
                }
                if r.fetch_add(1, Ordering::SeqCst) + 1 == n {
                    tx.send(()).await.unwrap();
                }
                HandlerOutcome::success(json!({}))
            }
        })
        .build()
        .unwrap();
    let running = start(w);
    within("every job ran", done.recv()).await.unwrap();
    let report = stop(running).await;
    (
        report,
        runs.load(Ordering::SeqCst),
        largest.load(Ordering::SeqCst),
    )
}

/// No-op handlers: after the first runs, the worker asks for far more than
/// its 2 slots and 2 ahead (the old fixed default, which never claimed more
/// than 4 at once). Every job still runs exactly once.
#[tokio::test]
async fn fast_handlers_fetch_ahead_beyond_the_concurrency_by_default() {
    let db = fresh().await;
    let n = 600;
    let (report, runs, got) = run_all(&db, n, Duration::ZERO).await;
    assert_eq!(report.succeeded as usize, n, "{report:?}");
    assert_eq!(runs, n, "each job ran once");
    assert!(
        got > 4,
        "the largest claim was {got}: the prefetch did not follow the pace"
    );
    assert!(got <= 2 + 256, "the largest claim was {got}, beyond the cap");
    let succeeded = db
        .count("SELECT count(*) FROM jobledger.jobs WHERE state = 'succeeded'")
        .await;
    assert_eq!(succeeded as usize, n);
}

/// Handlers of 100 ms (the workload, not a gate: at that pace 50 ms of
/// work ahead is less than one job per slot): the worker never holds more
/// than its slots and as many ahead, exactly the fixed default before.
#[tokio::test]
async fn slow_handlers_fetch_no_more_than_the_concurrency_ahead() {
    let db = fresh().await;
    let n = 16;
    let (report, _, got) = run_all(&db, n, Duration::from_millis(100)).await;
    assert_eq!(report.succeeded as usize, n, "{report:?}");
    let held = db
        .count("SELECT count(*) FROM jobledger.jobs WHERE state <> 'succeeded'")
        .await;
    assert_eq!(held, 0);
    assert!(got <= 4, "claimed {got} at once for 2 slots of slow handlers");
}

/// Review of issue 15: fast jobs raise the prefetch, then slow ones follow
/// in the same queue. The worker must not sit on hundreds of them while
/// two run: once the running ones have taken longer than the pace said,
/// the jobs held ahead beyond the new prefetch are given back unstarted
/// (no attempt burned), and every job still runs once.
#[tokio::test]
async fn jobs_held_ahead_are_given_back_when_the_handlers_slow_down() {
    let db = fresh().await;
    let (fast, slow) = (40, 200);
    let news = (0..fast + slow)
        .map(|i| new_job("q", None, json!({ "slow": i >= fast })))
        .collect();
    db.ledger.enqueue_many_as(news, "test").await.unwrap();
    let largest = Arc::new(AtomicUsize::new(0));
    let (open, gate) = tokio::sync::watch::channel(false);
    let w = base(&db, "shift")
        .concurrency(2)
        .hooks(largest_claim(largest.clone()))
        .handler("refund", move |ctx: JobContext| {
            let mut gate = gate.clone();
            async move {
                if ctx.payload()["slow"] == json!(true) {
                    let _ = gate.wait_for(|o| *o).await;
                }
                HandlerOutcome::success(json!({}))
            }
        })
        .build()
        .unwrap();
    let running = start(w);
    let leased = || db.count("SELECT count(*) FROM jobledger.jobs WHERE state = 'leased'");
    common::eventually("the fast jobs raised the prefetch", || async {
        largest.load(Ordering::SeqCst) > 4
    })
    .await;
    // Shedding starts only when more than twice the prefetch waits, and
    // then gives back down to the prefetch (worker::pace): with 2 slots and
    // the floor of 2 ahead, at most 2 running and 2 * 2 waiting stay held,
    // whichever moment of the slowdown the shed came at.
    common::eventually(
        "only the running jobs and at most twice the floor ahead are held",
        || async { leased().await <= 2 + 2 * 2 },
    )
    .await;
    let given_back = db
        .count("SELECT count(*) FROM jobledger.events WHERE reason = 'released_unstarted'")
        .await;
    assert!(given_back > 0, "nothing was given back");
    open.send(true).unwrap();
    common::eventually("every job ran", || async {
        db.count("SELECT count(*) FROM jobledger.jobs WHERE state = 'succeeded'")
            .await
            == (fast + slow) as i64
    })
    .await;
    let report = stop(running).await;
    assert_eq!(report.succeeded as usize, fast + slow, "{report:?}");
    let burned = db
        .count("SELECT count(*) FROM jobledger.jobs WHERE attempt <> 1")
        .await;
    assert_eq!(burned, 0, "a job given back kept its attempt");
}
