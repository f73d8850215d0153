//! Issue 10 item 4: a job fetched ahead (prefetch) is kept alive while it
//! waits for a slot and given back on shutdown; a handler that outlives the
//! drain timeout is told to stop and abandoned, its lease left to expire.

mod common;

use common::workers::{base, start};
use common::{eventually, fresh, within};
use jobledger::domain::{JobState, Reason};
use jobledger::worker::{HandlerOutcome, JobContext, StopReason};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Notify};

#[tokio::test]
async fn a_prefetched_job_is_kept_alive_and_given_back_on_shutdown() {
    let db = fresh().await;
    let first = db.enqueue(Some("first"), json!({})).await;
    let waiting = db.enqueue(Some("waiting"), json!({})).await;
    let (started_tx, mut started) = mpsc::channel(2);
    let finish = Arc::new(Notify::new());
    let f = finish.clone();
    let w = base(&db, "w")
        .concurrency(1)
        .prefetch(1)
        .lease(Duration::from_secs(3))
        .heartbeat_every(Duration::from_millis(50))
        .handler("refund", move |ctx: JobContext| {
            let (started_tx, finish) = (started_tx.clone(), f.clone());
            async move {
                started_tx.send(ctx.job_key().unwrap().to_string()).await.unwrap();
                finish.notified().await;
                HandlerOutcome::success(json!({}))
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = start(w);
    assert_eq!(
        within("the first job starts", started.recv()).await.unwrap(),
        "first"
    );
    eventually("the second job is fetched ahead", || async {
        db.state_of(waiting.job_id).await == JobState::Leased
    })
    .await;
    let fetched = db.job(waiting.job_id).await.lease_until.unwrap();
    eventually("its lease is renewed while it waits for the slot", || async {
        db.job(waiting.job_id).await.lease_until.unwrap() > fetched
    })
    .await;
    assert_eq!(db.job(waiting.job_id).await.step, None, "it never started");

    stop.cancel(); // the first job still runs: the waiting one goes back now
    eventually("the waiting job is given back", || async {
        db.state_of(waiting.job_id).await == JobState::Queued
    })
    .await;
    finish.notify_one();
    let report = within("the worker drains", handle).await.unwrap();
    assert_eq!((report.succeeded, report.released), (1, 1), "{report:?}");
    assert!(started.try_recv().is_err(), "the waiting job never started");
    let j = db.job(waiting.job_id).await;
    assert_eq!(
        (j.attempt, j.reason),
        (0, Reason::ReleasedUnstarted),
        "no attempt burned"
    );
    assert_eq!(db.state_of(first.job_id).await, JobState::Succeeded);
}

#[tokio::test]
async fn a_handler_past_the_drain_timeout_is_told_to_stop_and_abandoned() {
    let db = fresh().await;
    let job = db.enqueue(Some("stuck"), json!({})).await;
    let (started_tx, mut started) = mpsc::channel(1);
    let (told_tx, mut told) = mpsc::channel(1);
    let w = base(&db, "w")
        .drain_timeout(Duration::from_millis(300))
        .handler("refund", move |ctx: JobContext| {
            let (started_tx, told_tx) = (started_tx.clone(), told_tx.clone());
            async move {
                started_tx.send(()).await.unwrap();
                ctx.cancelled().await;
                let _ = told_tx.send(ctx.stop_reason()).await;
                std::future::pending::<HandlerOutcome>().await // ignores it
            }
        })
        .build()
        .unwrap();
    let (stop, handle) = start(w);
    within("the handler starts", started.recv()).await.unwrap();
    let before = db.job(job.job_id).await;
    stop.cancel();
    let report = within("the worker gives up after its drain timeout", handle)
        .await
        .unwrap();
    assert_eq!(
        within("the handler was told", told.recv()).await.unwrap(),
        Some(StopReason::Shutdown)
    );
    assert_eq!(report.succeeded + report.released, 0, "{report:?}");
    let after = db.job(job.job_id).await;
    assert_eq!(
        (after.state, after.version, after.token),
        (JobState::Leased, before.version, before.token),
        "abandoned as it was: its lease expires and is taken over"
    );
}
