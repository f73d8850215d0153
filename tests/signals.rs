//! What reaches a running worker without polling: a lost lease stops the
//! handler before its next side effect, and LISTEN/NOTIFY wakes an idle
//! worker. Workers here poll and renew once an hour (`notified_only`), far
//! beyond the tests' time budget, unless a test says otherwise.

mod common;

use common::workers::{base, notified_only, start, stop};
use common::{eventually, fresh, within};
use jobledger::domain::JobState;
use jobledger::worker::{BoxFuture, HandlerOutcome, Hooks, JobContext, Stop, StopReason};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// Issue 10 item 1: a handler whose lease is taken over while it runs is
/// told at once by its worker's refused heartbeat (`ctx.cancelled()` fires
/// with `LeaseLost`), and its next `ctx.step()` is refused without even
/// trying to write: the zombie's next side effect never starts.
#[tokio::test]
async fn a_handler_that_lost_its_lease_is_stopped_before_its_next_step() {
    let db = fresh().await;
    let job = db.enqueue(Some("lost"), json!({})).await;
    let (running_tx, mut running) = mpsc::channel(1);
    let (stopped_tx, mut stopped) = mpsc::channel(1);
    // A's heartbeats wait until B took over (else one could renew the lease
    // the test expires); then the next one is refused.
    let (beats, beats_rx) = watch::channel(false);
    let gate = Arc::new(move || {
        let mut rx = beats_rx.clone();
        Box::pin(async move {
            let _ = rx.wait_for(|open| *open).await;
        }) as BoxFuture<()>
    });
    let w = base(&db, "a")
        .heartbeat_every(Duration::from_millis(50))
        .hooks(Hooks {
            before_heartbeat: Some(gate),
            ..Hooks::default()
        })
        .handler("refund", move |ctx: JobContext| {
            let (running_tx, stopped_tx) = (running_tx.clone(), stopped_tx.clone());
            async move {
                if let Err(s) = ctx.step("first").await {
                    return s.into();
                }
                running_tx.send(()).await.unwrap();
                ctx.cancelled().await; // no step, no poll: only the heartbeat can say
                let reason = ctx.stop_reason();
                let next = ctx.step("second side effect").await;
                stopped_tx
                    .send((reason, matches!(next, Err(Stop::LeaseLost))))
                    .await
                    .unwrap();
                match next {
                    Err(s) => s.into(),
                    Ok(_) => HandlerOutcome::success(json!({"zombie": true})),
                }
            }
        })
        .build()
        .unwrap();
    let w = start(w);
    within("the handler runs", running.recv()).await.unwrap();
    db.expire_lease(job.job_id).await;
    let b = db.claim_one("b").await; // the takeover
    assert!(b.taken_over());
    beats.send(true).unwrap();
    let (reason, refused) = within("the handler is told its lease is lost", stopped.recv())
        .await
        .unwrap();
    assert_eq!(reason, Some(StopReason::LeaseLost));
    assert!(refused, "the next step is refused");
    let report = stop(w).await;
    assert_eq!(report.succeeded, 0);
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM jobledger.rejections WHERE job_id = '{}' AND command = 'progress'",
            job.job_id
        ))
        .await,
        0,
        "the refused step did not even try to write"
    );
    assert!(
        db.count(&format!(
            "SELECT count(*) FROM jobledger.rejections WHERE job_id = '{}' AND command = 'heartbeat'",
            job.job_id
        ))
        .await
            >= 1,
        "it was the heartbeat that was refused"
    );
    let j = db.job(job.job_id).await;
    assert_eq!(
        (j.state, j.token),
        (JobState::Leased, b.fence().token),
        "B still holds it"
    );
}

/// Issue 10 item 5: an idle worker that polls once an hour starts a job
/// enqueued after it went idle: LISTEN/NOTIFY woke it. The `idle` hook says
/// when the claim loop has claimed what there was and waits.
#[tokio::test]
async fn an_idle_worker_is_woken_by_a_notification() {
    let db = fresh().await;
    let (idle_tx, mut idle) = mpsc::unbounded_channel();
    let hook = Arc::new(move || {
        let _ = idle_tx.send(());
        Box::pin(async {}) as BoxFuture<()>
    });
    let w = notified_only(&db, "w")
        .hooks(Hooks {
            idle: Some(hook),
            ..Hooks::default()
        })
        .handler("refund", |_ctx: JobContext| async {
            HandlerOutcome::success(json!({}))
        })
        .build()
        .unwrap();
    let w = start(w);
    // The listener connects and wakes the loop once (for anything missed
    // while connecting); wait until the loop has gone idle after that too.
    within("the worker goes idle", idle.recv()).await.unwrap();
    eventually("the worker listens", || async {
        db.count(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND query LIKE 'LISTEN%jobledger_cancel%'",
        )
        .await
            > 0
    })
    .await;
    within("the worker goes idle after its listener woke it", idle.recv())
        .await
        .unwrap();
    while idle.try_recv().is_ok() {}
    let job = db.enqueue(None, json!({})).await;
    eventually("the notified worker ran the job", || async {
        db.state_of(job.job_id).await == JobState::Succeeded
    })
    .await;
    let report = stop(w).await;
    assert_eq!(report.succeeded, 1);
}
