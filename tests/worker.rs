//! The docs/scenarios.md scenarios driven through real `Worker`s: zombie worker,
//! takeover with reconcile, cancel at a step boundary, retries, permanent
//! and exhausted failures, graceful shutdown, two workers on one queue.

mod common;
// The fake refund provider is a tool, not the library's: its one file is
// shared with the binary's tools.
#[path = "../src/tools/fake_provider.rs"]
mod fake_provider;

use common::workers::{base, notified_only, start, stop};
use common::{eventually, fresh, new_job, within};
use fake_provider::FakeProvider;
use jobledger::domain::{JobState, NextAction, Policy, Reason};
use jobledger::worker::{BoxFuture, HandlerOutcome, Hooks, JobContext};
use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch, Notify};

fn fast_retries(max_attempts: i32) -> Policy {
    Policy {
        max_attempts,
        backoff_base_ms: 0,
        backoff_cap_ms: 0,
        ..Policy::default()
    }
}

/// Scenarios 1, 6 through workers: worker A calls the provider and freezes
/// (handler and heartbeats) past its lease; worker B takes over with next
/// action reconcile, finds the refund, completes. A thaws: its late
/// completion writes nothing and is counted as a lost lease.
#[tokio::test]
async fn frozen_worker_is_taken_over_and_its_late_write_is_stale() {
    let db = fresh().await;
    let provider = Arc::new(FakeProvider::new());
    let job = db.enqueue(Some("refund-1"), json!({"amount": 1})).await;

    let (thaw_tx, thaw_rx) = watch::channel(false);
    let (called_tx, mut called_rx) = mpsc::channel(1);
    let frozen = {
        let t = thaw_rx.clone();
        Arc::new(move || {
            let mut t = t.clone();
            Box::pin(async move {
                let _ = t.wait_for(|v| *v).await;
            }) as BoxFuture<()>
        })
    };
    let p = provider.clone();
    // One slot and no prefetch: while frozen, A cannot claim (or take over)
    // anything itself, just like a stalled process.
    let a = base(&db, "a")
        .concurrency(1)
        .prefetch(0)
        .heartbeat_every(Duration::from_millis(100))
        .lease(Duration::from_secs(1))
        .hooks(Hooks {
            before_heartbeat: Some(frozen),
            ..Hooks::default()
        })
        .handler("refund", move |ctx: JobContext| {
            let (p, mut thaw, called) = (p.clone(), thaw_rx.clone(), called_tx.clone());
            async move {
                let id = p.refund(ctx.job_key().unwrap()).unwrap();
                called.send(()).await.unwrap();
                let _ = thaw.wait_for(|v| *v).await;
                HandlerOutcome::success(json!({ "refund_id": id }))
            }
        })
        .build()
        .unwrap();
    let a = start(a);
    within("A called the provider", called_rx.recv()).await.unwrap();
    db.expire_lease(job.job_id).await;

    let p = provider.clone();
    let seen = Arc::new(std::sync::Mutex::new(None));
    let s2 = seen.clone();
    let b = base(&db, "b")
        .handler("refund", move |ctx: JobContext| {
            let (p, seen) = (p.clone(), s2.clone());
            async move {
                *seen.lock().unwrap() = Some(ctx.next_action());
                match p.lookup(ctx.job_key().unwrap()) {
                    Some(id) => HandlerOutcome::success(json!({ "refund_id": id, "reconciled": true })),
                    None => HandlerOutcome::transient("not_found_yet"),
                }
            }
        })
        .build()
        .unwrap();
    let b = start(b);
    eventually("B completes the job", || async {
        db.state_of(job.job_id).await == JobState::Succeeded
    })
    .await;
    assert_eq!(*seen.lock().unwrap(), Some(NextAction::Reconcile));

    thaw_tx.send(true).unwrap();
    let a = stop(a).await;
    let b = stop(b).await;
    assert_eq!(
        (a.succeeded, a.lost_leases),
        (0, 1),
        "A's late completion is refused: {a:?}"
    );
    assert_eq!((b.succeeded, b.takeovers), (1, 1), "{b:?}");
    assert_eq!(provider.executions("refund-1"), 1, "no second refund");
    let j = db.job(job.job_id).await;
    assert_eq!(j.result.unwrap()["reconciled"], true);
    let refused = db
        .count("SELECT count(*) FROM jobledger.rejections WHERE outcome = 'stale'")
        .await;
    assert!(refused >= 1, "the refused write is on record");
}

/// Scenario 8 through a worker: the cancel reaches the running handler
/// (LISTEN/NOTIFY), which stops at its next step boundary and confirms. The
/// worker renews leases once an hour, so no refused heartbeat can carry the
/// cancel instead: with the listener dead this test fails.
#[tokio::test]
async fn cancel_reaches_the_handler_at_a_step_boundary() {
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    let (at_step_tx, mut at_step_rx) = mpsc::channel(1);
    let side_effects = Arc::new(AtomicUsize::new(0));
    let se = side_effects.clone();
    let w = notified_only(&db, "w")
        .handler("refund", move |ctx: JobContext| {
            let (tx, se) = (at_step_tx.clone(), se.clone());
            async move {
                if let Err(s) = ctx.step("first").await {
                    return s.into();
                }
                tx.send(()).await.unwrap();
                ctx.cancelled().await; // the signal fires: no sleep, no poll
                if let Err(s) = ctx.step("second").await {
                    return s.into();
                }
                se.fetch_add(1, Ordering::SeqCst);
                HandlerOutcome::success(json!({}))
            }
        })
        .build()
        .unwrap();
    let w = start(w);
    within("the handler reaches its first step", at_step_rx.recv())
        .await
        .unwrap();
    let r = db
        .ledger
        .cancel(job.job_id, Some("user clicked cancel"))
        .await
        .unwrap();
    assert_eq!(r.job.unwrap().state, JobState::CancelRequested);
    eventually("the cancel is confirmed", || async {
        db.state_of(job.job_id).await == JobState::Cancelled
    })
    .await;
    let report = stop(w).await;
    assert_eq!(report.cancelled, 1);
    assert_eq!(
        side_effects.load(Ordering::SeqCst),
        0,
        "no side effect after the cancel"
    );
    assert_eq!(db.job(job.job_id).await.reason, Reason::CancelConfirmed);
}

/// Scenario 9 through a worker: transient then success; permanent; exhausted.
#[tokio::test]
async fn retries_permanent_and_exhausted_through_a_worker() {
    let db = fresh().await;
    let mut flaky = new_job("q", Some("flaky"), json!({"mode": "flaky"}));
    flaky.policy = Some(fast_retries(3));
    let flaky = db.ledger.enqueue(flaky).await.unwrap().job;
    let mut perm = new_job("q", Some("perm"), json!({"mode": "permanent"}));
    perm.policy = Some(fast_retries(3));
    let perm = db.ledger.enqueue(perm).await.unwrap().job;
    let mut never = new_job("q", Some("never"), json!({"mode": "always"}));
    never.policy = Some(fast_retries(2));
    let never = db.ledger.enqueue(never).await.unwrap().job;

    let w = base(&db, "w")
        .handler("refund", |ctx: JobContext| async move {
            match (ctx.payload()["mode"].as_str(), ctx.attempt()) {
                (Some("flaky"), 1) => HandlerOutcome::transient("provider_busy"),
                (Some("flaky"), _) => HandlerOutcome::success(json!({"attempt": ctx.attempt()})),
                (Some("permanent"), _) => HandlerOutcome::permanent("account_closed"),
                _ => HandlerOutcome::transient("provider_busy"),
            }
        })
        .build()
        .unwrap();
    let w = start(w);
    eventually("all three end", || async { db.open_jobs().await == 0 }).await;
    let report = stop(w).await;

    let f = db.job(flaky.job_id).await;
    assert_eq!(
        (f.state, f.attempt, f.result.unwrap()["attempt"].as_i64()),
        (JobState::Succeeded, 2, Some(2))
    );
    let p = db.job(perm.job_id).await;
    assert_eq!(
        (p.state, p.reason, p.attempt),
        (JobState::Dead, Reason::PermanentError, 1)
    );
    let n = db.job(never.job_id).await;
    assert_eq!(
        (n.state, n.reason, n.attempt),
        (JobState::Dead, Reason::AttemptsExhausted, 2)
    );
    assert_eq!(n.last_error.unwrap().code, "provider_busy");
    assert_eq!(
        (report.succeeded, report.dead, report.retried),
        (1, 2, 2),
        "{report:?}"
    );
}

/// Graceful shutdown: running handlers finish within the drain timeout;
/// a job claimed but not yet started is released without burning an
/// attempt; stopping twice is harmless.
#[tokio::test]
async fn graceful_shutdown_drains_and_releases_unstarted_work() {
    let db = fresh().await;
    let running = db.enqueue(Some("running"), json!({})).await;
    let (started_tx, mut started_rx) = mpsc::channel(1);
    let finish = Arc::new(Notify::new());
    let f2 = finish.clone();
    let w = base(&db, "w")
        .concurrency(1)
        .handler("refund", move |_ctx: JobContext| {
            let (tx, finish) = (started_tx.clone(), f2.clone());
            async move {
                tx.send(()).await.unwrap();
                finish.notified().await;
                HandlerOutcome::success(json!({"finished": true}))
            }
        })
        .build()
        .unwrap();
    let (stop_token, handle) = start(w);
    within("the handler started", started_rx.recv()).await.unwrap();
    stop_token.cancel();
    stop_token.cancel();
    // The drain waits for the in-flight job: it succeeds after the stop.
    finish.notify_one();
    let report = within("the drain", handle).await.unwrap();
    assert_eq!(report.succeeded, 1);
    assert_eq!(db.state_of(running.job_id).await, JobState::Succeeded);

    // Claimed, then shutdown before it starts: released, attempt not burned.
    let unstarted = db.enqueue(Some("unstarted"), json!({})).await;
    let (claimed_tx, mut claimed_rx) = mpsc::channel(1);
    let go = Arc::new(Notify::new());
    let g2 = go.clone();
    let hook = Arc::new(move |_ids| {
        let (tx, go) = (claimed_tx.clone(), g2.clone());
        Box::pin(async move {
            tx.send(()).await.unwrap();
            go.notified().await;
        }) as BoxFuture<()>
    });
    let w = base(&db, "w2")
        .hooks(Hooks {
            after_claim: Some(hook),
            ..Hooks::default()
        })
        .handler("refund", |_ctx: JobContext| async {
            HandlerOutcome::success(json!({}))
        })
        .build()
        .unwrap();
    let (stop_token, handle) = start(w);
    within("the claim", claimed_rx.recv()).await.unwrap();
    stop_token.cancel();
    go.notify_one();
    let report = within("the drain", handle).await.unwrap();
    assert_eq!(
        (report.claimed, report.released, report.succeeded),
        (1, 1, 0),
        "{report:?}"
    );
    let j = db.job(unstarted.job_id).await;
    assert_eq!(
        (j.state, j.attempt, j.reason),
        (JobState::Queued, 0, Reason::ReleasedUnstarted)
    );
}

/// Two workers on one queue: every job runs to success exactly once, and
/// the race the name promises happens for real on one job: A completes it
/// while B, having taken it over, holds the lease. A's completion is
/// refused as stale (B's decision stands); B's commits. Without the fence's
/// token check A's late result would be the job's.
#[tokio::test]
async fn two_workers_never_both_complete_a_job() {
    let db = fresh().await;
    let race = db.enqueue(Some("race"), json!({})).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (a_in, mut a_running) = mpsc::channel(1);
    let (b_in, mut b_running) = mpsc::channel(1);
    let (open_a, gate_a) = watch::channel(false);
    let (open_b, gate_b) = watch::channel(false);
    let mk = |name: &'static str, inside: mpsc::Sender<NextAction>, gate: watch::Receiver<bool>| {
        let runs = runs.clone();
        base(&db, name)
            .concurrency(8)
            .handler("refund", move |ctx: JobContext| {
                let (runs, inside, mut gate) = (runs.clone(), inside.clone(), gate.clone());
                async move {
                    if ctx.job_key() == Some("race") {
                        inside.send(ctx.next_action()).await.unwrap();
                        let _ = gate.wait_for(|open| *open).await;
                        return HandlerOutcome::success(json!({ "by": name }));
                    }
                    runs.fetch_add(1, Ordering::SeqCst);
                    HandlerOutcome::success(json!({}))
                }
            })
    };
    // A's heartbeats never run: its lease on the race job can expire.
    let never = Arc::new(|| Box::pin(std::future::pending::<()>()) as BoxFuture<()>);
    let a = mk("a", a_in, gate_a)
        .hooks(Hooks {
            before_heartbeat: Some(never),
            ..Hooks::default()
        })
        .build()
        .unwrap();
    let a = start(a);
    assert_eq!(
        within("A runs the race job", a_running.recv()).await,
        Some(NextAction::Execute)
    );

    let n = 200;
    let news: Vec<_> = (0..n)
        .map(|i| new_job("q", Some(&format!("k{i}")), json!({"i": i})))
        .collect();
    let mut tx = db.ledger.pool().begin().await.unwrap();
    db.ledger.enqueue_many_in(&mut tx, news).await.unwrap();
    tx.commit().await.unwrap();
    db.expire_lease(race.job_id).await;
    let b = start(mk("b", b_in, gate_b).build().unwrap());
    assert_eq!(
        within("B takes the race job over", b_running.recv()).await,
        Some(NextAction::Reconcile),
        "B took over"
    );

    open_a.send(true).unwrap(); // A completes while B holds the lease
    eventually("A's completion is refused", || async {
        db.count(&format!(
            "SELECT count(*) FROM jobledger.rejections WHERE job_id = '{}' AND command = 'complete' \
             AND outcome = 'stale'",
            race.job_id
        ))
        .await
            == 1
    })
    .await;
    assert_eq!(
        db.state_of(race.job_id).await,
        JobState::Leased,
        "B still holds it"
    );
    open_b.send(true).unwrap();
    eventually("all jobs done", || async { db.open_jobs().await == 0 }).await;
    let (ra, rb) = (stop(a).await, stop(b).await);
    assert_eq!(ra.succeeded + rb.succeeded, n as u64 + 1);
    // (Who ran how many of the 200 is the claim race's business; the
    // takeover and the refused completion above show both took part.)
    assert_eq!((ra.lost_leases, rb.takeovers), (1, 1), "{ra:?} {rb:?}");
    assert_eq!(runs.load(Ordering::SeqCst), n);
    assert_eq!(db.job(race.job_id).await.result, Some(json!({ "by": "b" })));
    assert_eq!(
        db.count("SELECT count(*) FROM (SELECT job_id FROM jobledger.events WHERE type = 'succeeded' GROUP BY job_id HAVING count(*) > 1) d").await,
        0
    );
    db.assert_verified().await;
}

/// Kinds without a handler fail clearly; a panicking handler is a transient
/// error, not a dead worker; a worker's registered policy applies to jobs
/// enqueued without one.
#[tokio::test]
async fn unknown_kinds_panics_and_registered_policies() {
    let db = fresh().await;
    let mut stray = new_job("q", None, json!({}));
    stray.kind = "nobody-handles-this".into();
    let stray = db.ledger.enqueue(stray).await.unwrap().job;
    let mut boom = new_job("q", None, json!({"boom": true}));
    boom.kind = "boom".into();
    boom.policy = Some(fast_retries(1));
    let boom = db.ledger.enqueue(boom).await.unwrap().job;
    let w = base(&db, "w")
        .policy(
            "refund",
            Policy {
                max_attempts: 7,
                ..Policy::default()
            },
        )
        .handler("refund", |_ctx: JobContext| async {
            HandlerOutcome::success(json!({}))
        })
        .handler("boom", |_ctx: JobContext| async { panic!("handler bug") })
        .build()
        .unwrap();
    let w = start(w);
    eventually("both end", || async { db.open_jobs().await == 0 }).await;
    let s = db.job(stray.job_id).await;
    assert_eq!(
        (s.state, s.last_error.unwrap().code.as_str()),
        (JobState::Dead, "unknown_kind")
    );
    let b = db.job(boom.job_id).await;
    assert_eq!(
        (b.state, b.last_error.unwrap().code.as_str()),
        (JobState::Dead, "handler_panicked")
    );
    // Registered at start: later jobs of the kind get it.
    let later = db.enqueue(None, json!({})).await;
    assert_eq!(later.policy.max_attempts, 7);
    stop(w).await;
}

/// A handler finishes with its own business writes in the completion's
/// transaction: both commit together; when the fence refuses, neither does.
#[tokio::test]
async fn business_writes_commit_with_the_completion_or_not_at_all() {
    let db = fresh().await;
    sqlx::query("CREATE TABLE refunds_done (job_id uuid PRIMARY KEY)")
        .execute(db.ledger.pool())
        .await
        .unwrap();
    let ok = db.enqueue(Some("ok"), json!({"steal": false})).await;
    let stolen = db.enqueue(Some("stolen"), json!({"steal": true})).await;
    let ledger = db.ledger.clone();
    let thief_took_it = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stolen_flag = thief_took_it.clone();
    // One slot, no prefetch: the worker itself cannot take the job back
    // between the handler's "expire" and the thief's takeover.
    let w = base(&db, "w")
        .concurrency(1)
        .prefetch(0)
        .handler("refund", move |ctx: JobContext| {
            let (ledger, stolen_ok) = (ledger.clone(), stolen_flag.clone());
            async move {
                if ctx.payload()["steal"] == json!(true) {
                    // Another worker takes the job over before this one commits.
                    common::around_the_log(
                        ledger.pool(),
                        "UPDATE jobledger.jobs SET lease_until = now() - interval '1 second' WHERE job_id = $1",
                        ctx.job().job_id,
                    )
                    .await;
                    // (Checked by the test below: an assert here would be a
                    // panicking handler, i.e. a retried job, not a failure.)
                    let (r, _) = ledger.claim_job(ctx.job().job_id, "thief", Duration::from_secs(30)).await.unwrap();
                    stolen_ok.store(r.committed(), Ordering::SeqCst);
                }
                let mut tx = ctx.pool().begin().await.unwrap();
                sqlx::query("INSERT INTO refunds_done VALUES ($1)").bind(ctx.job().job_id).execute(&mut *tx).await.unwrap();
                let r = ctx.complete_in(&mut tx, Some(json!({"done": true}))).await.unwrap();
                if r.committed() {
                    tx.commit().await.unwrap();
                }
                HandlerOutcome::Written(Box::new(r))
            }
        })
        .build()
        .unwrap();
    let w = start(w);
    eventually("both handled", || async {
        db.state_of(ok.job_id).await == JobState::Succeeded
            && db.job(stolen.job_id).await.holder.as_deref() == Some("thief")
    })
    .await;
    let report = stop(w).await;
    assert!(
        thief_took_it.load(Ordering::SeqCst),
        "the thief's takeover committed"
    );
    assert_eq!((report.succeeded, report.lost_leases), (1, 1), "{report:?}");
    assert_eq!(
        (report.retried, report.errors),
        (0, 0),
        "no handler panicked: {report:?}"
    );
    let done: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT job_id FROM refunds_done")
        .fetch_all(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(
        done,
        vec![ok.job_id],
        "the refused completion took its business write with it"
    );
}
