//! docs/scenarios.md scenarios 1-7: the fence under every interleaving the seeds name.
//! Interleavings are forced with gates; time moves by rewriting lease_until.

mod common;
// The fake refund provider is a tool, not the library's: its one file is
// shared with the binary's tools.
#[path = "../src/tools/fake_provider.rs"]
mod fake_provider;

use common::fresh;
use fake_provider::FakeProvider;
use jobledger::domain::{ErrorClass, JobState, NextAction, Outcome, Policy, Reason};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;

/// Scenario 1: A stalls after its external call; B takes over, reconciles,
/// succeeds. A's complete, retry and dead/manual-review writes are all stale,
/// and the history shows them refused.
#[tokio::test]
async fn zombie_late_writes_are_all_stale() {
    let db = fresh().await;
    let job = db.enqueue(Some("refund-1"), json!({"amount": 100})).await;
    let a = db.claim_one("worker-a").await;
    assert_eq!(a.fence().token, 1);
    assert_eq!(a.next_action(), NextAction::Execute);

    db.expire_lease(job.job_id).await;
    let b = db.claim_one("worker-b").await;
    assert_eq!(b.fence().token, 2, "takeover issues the next token");
    assert_eq!(
        b.next_action(),
        NextAction::Reconcile,
        "takeover must reconcile first"
    );
    assert!(
        b.taken_over() && !a.taken_over(),
        "the lease says how it was obtained"
    );
    assert_eq!(b.job().unwrap().attempt, 2);
    assert!(b
        .complete(Some(json!({"refund_id": "re_1"})))
        .await
        .unwrap()
        .committed());

    let late = [
        a.complete(Some(json!({"refund_id": "re_1"}))).await.unwrap(),
        a.fail(ErrorClass::Transient, "socket_timeout", Some("late"))
            .await
            .unwrap(),
        a.fail(ErrorClass::Permanent, "manual_review", None)
            .await
            .unwrap(),
    ];
    for r in &late {
        assert_eq!(r.outcome, Outcome::Stale, "{r:?}");
        assert!(r.position.is_none(), "a stale write appends nothing");
    }
    let now = db.job(job.job_id).await;
    assert_eq!(now.state, JobState::Succeeded);
    assert_eq!(now.token, 2);
    assert_eq!(now.result, Some(json!({"refund_id": "re_1"})));
    assert_eq!(now.version, 4, "enqueued, claimed, taken_over, succeeded");

    let refused = db.ledger.rejections(job.job_id).await.unwrap();
    assert_eq!(refused.len(), 3);
    assert!(refused
        .iter()
        .all(|r| r.outcome == "stale" && r.token == Some(1) && r.actor == "worker-a"));
    db.assert_verified().await;
}

/// Scenario 2: an expired lease nobody took over still commits; the late
/// takeover then finds a terminal job and gives up. (Guards against anyone
/// adding `lease_until > now()` to a write condition.)
#[tokio::test]
async fn expired_but_not_taken_over_still_commits() {
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    let a = db.claim_one("worker-a").await;
    db.expire_lease(job.job_id).await;
    let r = a.complete(Some(json!({"ok": true}))).await.unwrap();
    assert_eq!(r.outcome, Outcome::Committed);
    db.claim_none("worker-b").await;
    let (r, lease) = db
        .ledger
        .claim_job(job.job_id, "worker-b", Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(r.outcome, Outcome::InvalidTransition);
    assert!(lease.is_none());
    assert_eq!(db.job(job.job_id).await.state, JobState::Succeeded);
}

/// Scenario 3: B took over but wrote nothing yet; A is already fenced out of
/// every write (seed 002: the issued token, not the applied one, is the fence).
#[tokio::test]
async fn takeover_alone_fences_the_old_holder() {
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    let a = db.claim_one("worker-a").await;
    db.expire_lease(job.job_id).await;
    let _b = db.claim_one("worker-b").await;
    for r in [
        a.heartbeat(Duration::from_secs(30)).await.unwrap(),
        a.progress("step-2", None).await.unwrap(),
        a.submit("rcpt-1").await.unwrap(),
        a.complete(None).await.unwrap(),
    ] {
        assert_eq!(r.outcome, Outcome::Stale, "{r:?}");
    }
    let now = db.job(job.job_id).await;
    assert_eq!(
        (now.state, now.token, now.holder.as_deref()),
        (JobState::Leased, 2, Some("worker-b"))
    );
}

async fn business_table(db: &common::TestDb) {
    sqlx::query("CREATE TABLE refunds_done (job_id uuid PRIMARY KEY, note text)")
        .execute(db.ledger.pool())
        .await
        .unwrap();
}

/// Waits (without sleeping blindly) until some backend is blocked on a lock.
async fn until_someone_waits_on_a_lock(db: &common::TestDb) {
    for _ in 0..2000 {
        let n = db
            .count("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()")
            .await;
        if n > 0 {
            return;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("nobody ever waited on the row lock");
}

/// Scenario 4, first order: A is inside its commit transaction (business
/// write + fence) when B tries to take over. B waits on the row lock, then
/// sees A's result and gives up; A's business write is kept.
#[tokio::test]
async fn commit_in_progress_makes_takeover_wait() {
    let db = fresh().await;
    business_table(&db).await;
    let job = db.enqueue(None, json!({})).await;
    let a = db.claim_one("worker-a").await;
    db.expire_lease(job.job_id).await;

    let mut tx = db.ledger.pool().begin().await.unwrap();
    sqlx::query("INSERT INTO refunds_done VALUES ($1, 'by a')")
        .bind(job.job_id)
        .execute(&mut *tx)
        .await
        .unwrap();
    let r = a.complete_in(&mut tx, Some(json!({"by": "a"}))).await.unwrap();
    assert_eq!(r.outcome, Outcome::Committed);

    // A skip-locked claim passes the locked row by...
    db.claim_none("worker-b").await;
    // ...and a targeted takeover waits for A's transaction.
    let ledger = db.ledger.clone();
    let b = tokio::spawn(async move {
        ledger
            .claim_job(job.job_id, "worker-b", Duration::from_secs(5))
            .await
    });
    until_someone_waits_on_a_lock(&db).await;
    assert!(!b.is_finished());
    tx.commit().await.unwrap();

    let (r, lease) = b.await.unwrap().unwrap();
    assert_eq!(r.outcome, Outcome::InvalidTransition, "B sees A's result: {r:?}");
    assert!(lease.is_none());
    assert_eq!(db.job(job.job_id).await.state, JobState::Succeeded);
    assert_eq!(db.count("SELECT count(*) FROM refunds_done").await, 1);
}

/// Scenario 4, second order: B's takeover commits first; A's commit matches
/// nothing and A's business writes in the same transaction roll back too.
#[tokio::test]
async fn takeover_first_rolls_back_the_old_holders_business_writes() {
    let db = fresh().await;
    business_table(&db).await;
    let job = db.enqueue(None, json!({})).await;
    let a = db.claim_one("worker-a").await;
    db.expire_lease(job.job_id).await;
    let _b = db.claim_one("worker-b").await;

    let mut tx = db.ledger.pool().begin().await.unwrap();
    sqlx::query("INSERT INTO refunds_done VALUES ($1, 'by a')")
        .bind(job.job_id)
        .execute(&mut *tx)
        .await
        .unwrap();
    let r = a.complete_in(&mut tx, Some(json!({"by": "a"}))).await.unwrap();
    assert_eq!(r.outcome, Outcome::Stale);
    drop(tx); // the caller's contract: anything but `committed` rolls back

    assert_eq!(db.count("SELECT count(*) FROM refunds_done").await, 0);
    assert_eq!(db.job(job.job_id).await.state, JobState::Leased);
}

/// Scenario 5: the commit response was lost. Same token + same result (even
/// with keys in another order) is idempotent; a different result conflicts.
#[tokio::test]
async fn lost_commit_response_retries() {
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    let a = db.claim_one("worker-a").await;
    let first = a
        .complete(Some(json!({"refund_id": "re_9", "amount": 100})))
        .await
        .unwrap();
    assert_eq!(first.outcome, Outcome::Committed);
    let same = a
        .complete(Some(json!({"amount": 100, "refund_id": "re_9"})))
        .await
        .unwrap();
    assert_eq!(same.outcome, Outcome::AlreadyCommitted);
    let different = a
        .complete(Some(json!({"refund_id": "re_10", "amount": 100})))
        .await
        .unwrap();
    assert_eq!(different.outcome, Outcome::Conflict);
    let other_op = a.fail(ErrorClass::Transient, "timeout", None).await.unwrap();
    assert_eq!(other_op.outcome, Outcome::Conflict);
    assert_eq!(db.job(job.job_id).await.version, 3, "retries write nothing");

    // The lost-response case for a retry-with-backoff write too.
    let job2 = db.enqueue(None, json!({"n": 2})).await;
    let l = db.claim_one("worker-a").await;
    assert_eq!(l.job_id(), job2.job_id);
    assert!(l
        .fail(ErrorClass::Transient, "timeout", None)
        .await
        .unwrap()
        .committed());
    let again = l
        .fail(ErrorClass::Transient, "timeout", Some("other text"))
        .await
        .unwrap();
    assert_eq!(
        again.outcome,
        Outcome::AlreadyCommitted,
        "the message is not part of the result"
    );
}

/// Scenario 6: the provider executed but the response was lost. B's
/// reconcile uses the same job_key, makes no second call, and A's late
/// success is kept as an observation (evidence), not as a state change.
#[tokio::test]
async fn lost_external_response_is_reconciled_not_repeated() {
    let db = fresh().await;
    let provider = FakeProvider::new();
    let job = db.enqueue(Some("refund-42"), json!({"amount": 42})).await;
    let a = db.claim_one("worker-a").await;
    let key = a.job().unwrap().job_key.clone().unwrap();
    let refund = provider.refund(&key).unwrap(); // executed; A never hears back
    db.expire_lease(job.job_id).await;

    let b = db.claim_one("worker-b").await;
    assert_eq!(b.next_action(), NextAction::Reconcile);
    let found = provider
        .lookup(b.job().unwrap().job_key.as_deref().unwrap())
        .expect("provider knows the key");
    assert!(b
        .complete(Some(json!({"refund_id": found, "reconciled": true})))
        .await
        .unwrap()
        .committed());
    assert_eq!(provider.executions(&key), 1, "no second refund");

    let obs = a
        .observe("provider-response", json!({"refund_id": refund}))
        .await
        .unwrap();
    assert_eq!(
        obs.outcome,
        Outcome::Committed,
        "evidence is kept even from a fenced worker"
    );
    let dup = a
        .observe("provider-response", json!({"refund_id": refund}))
        .await
        .unwrap();
    assert_eq!(
        dup.outcome,
        Outcome::AlreadyCommitted,
        "observations dedupe by key"
    );
    let clash = a
        .observe("provider-response", json!({"refund_id": "other"}))
        .await
        .unwrap();
    assert_eq!(clash.outcome, Outcome::Conflict);
    assert_eq!(
        a.complete(Some(json!({"refund_id": refund})))
            .await
            .unwrap()
            .outcome,
        Outcome::Stale
    );

    let now = db.job(job.job_id).await;
    assert_eq!(
        (now.state, now.reason),
        (JobState::Succeeded, Reason::Observation)
    );
    let history = db.ledger.history(job.job_id).await.unwrap();
    let last = &history.last().unwrap().event;
    assert_eq!(last.body.type_name(), "observed");
    assert_eq!(last.actor, "worker-a");
    db.assert_verified().await;
}

/// Scenario 7: concurrent claims of one job: exactly one wins, for a queued
/// job and for an expired lease alike.
#[tokio::test]
async fn concurrent_claims_one_winner() {
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    for round in 0..2 {
        let barrier = Arc::new(Barrier::new(8));
        let mut tasks = vec![];
        for w in 0..8 {
            let (ledger, barrier) = (db.ledger.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                ledger
                    .claim("q", &format!("w{round}-{w}"), Duration::from_secs(30), 1)
                    .await
                    .unwrap()
                    .len()
            }));
        }
        let mut won = 0;
        for t in tasks {
            won += t.await.unwrap();
        }
        assert_eq!(won, 1, "round {round}: exactly one claim wins");
        db.expire_lease(job.job_id).await; // round 2 races for the takeover
    }
    let now = db.job(job.job_id).await;
    assert_eq!((now.token, now.attempt), (2, 2));
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events WHERE type IN ('claimed', 'taken_over')")
            .await,
        2
    );
}

/// Targeted takeovers racing: one wins, the rest are told precisely why not.
#[tokio::test]
async fn concurrent_targeted_takeovers_one_winner() {
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    db.claim_one("worker-a").await;
    db.expire_lease(job.job_id).await;
    let barrier = Arc::new(Barrier::new(6));
    let mut tasks = vec![];
    for w in 0..6 {
        let (ledger, barrier) = (db.ledger.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            ledger
                .claim_job(job.job_id, &format!("b{w}"), Duration::from_secs(30))
                .await
                .unwrap()
                .0
                .outcome
        }));
    }
    let mut outcomes = vec![];
    for t in tasks {
        outcomes.push(t.await.unwrap());
    }
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Committed).count(),
        1,
        "{outcomes:?}"
    );
    assert!(outcomes
        .iter()
        .all(|o| matches!(o, Outcome::Committed | Outcome::InvalidTransition)));
}

/// A holder never takes over its own expired lease (the job still runs in
/// that process); another holder does.
#[tokio::test]
async fn a_holder_does_not_take_over_its_own_lease() {
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    db.claim_one("worker-a").await;
    db.expire_lease(job.job_id).await;
    db.claim_none("worker-a").await;
    let (r, lease) = db
        .ledger
        .claim_job(job.job_id, "worker-a", Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!((r.outcome, lease.is_none()), (Outcome::InvalidTransition, true));
    assert!(db.claim_one("worker-b").await.taken_over());
}

/// Issue 9 item 6: a claim decides on the row version it locked. The claim
/// statement takes its snapshot, then stops inside its scan of the job (a
/// gate: a row-level security policy that waits on an advisory lock the
/// test holds; RLS applies to `jobledger_worker`, not to the owner). Meanwhile
/// an observation appends v2 and commits. The claim then locks the row at
/// v2: it must decide on v2, not on its snapshot's v1 (whose fenced write
/// would miss and roll the whole claim back).
#[tokio::test]
async fn a_claim_decides_on_the_row_version_it_locked() {
    use sqlx::Connection;
    let db = fresh().await;
    let job = db.enqueue(Some("k"), json!({})).await;
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION public.jl_test_gate(id uuid) RETURNS boolean LANGUAGE plpgsql AS $$ \
         BEGIN IF id = '{}' THEN PERFORM pg_advisory_lock_shared(4242); PERFORM pg_advisory_unlock_shared(4242); \
         END IF; RETURN true; END $$; \
         ALTER TABLE jobledger.jobs ENABLE ROW LEVEL SECURITY; \
         CREATE POLICY gate ON jobledger.jobs USING (public.jl_test_gate(job_id));",
        job.job_id
    ))
    .execute(db.ledger.pool())
    .await
    .unwrap();
    let mut gate = db.conn().await;
    sqlx::query("SELECT pg_advisory_lock(4242)")
        .execute(&mut gate)
        .await
        .unwrap();

    let worker_url = db
        .url
        .replacen("postgres://postgres@", "postgres://jobledger_worker@", 1);
    let worker = jobledger::ledger::Ledger::connect(&worker_url, 2).await.unwrap();
    let claim = tokio::spawn(async move { worker.claim("q", "w", Duration::from_secs(30), 5).await });
    common::eventually("the claim waits at the gate, inside its statement", || async {
        db.count(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND usename = 'jobledger_worker' AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
        )
        .await
            > 0
    })
    .await;
    let r = db
        .ledger
        .observe(job.job_id, None, "receipt", json!({"seen": true}), "webhook")
        .await
        .unwrap();
    assert!(r.committed(), "v2 committed while the claim's statement runs");
    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut gate)
        .await
        .unwrap();
    gate.close().await.unwrap();

    let leases = claim
        .await
        .unwrap()
        .expect("the claim decides on the locked version, not its snapshot");
    assert_eq!(leases.len(), 1);
    let j = db.job(job.job_id).await;
    assert_eq!(
        (j.state, j.version),
        (JobState::Leased, 3),
        "claimed after the observation"
    );
    db.assert_verified().await;
}

/// Issue 10 item 2: a retried lease-ending write (its first response lost)
/// after the job moved on. A's transient `fail` re-queued the job and B
/// claimed it: A's retry with the same failure is `already_committed`, with
/// another one `conflict` (A's write is still the job's last lease-ending
/// write). Once B also ended its lease, A's retry is simply `stale`. None
/// of them writes anything or touches B's lease.
#[tokio::test]
async fn a_retried_fail_after_the_job_moved_on() {
    let db = fresh().await;
    let job = db
        .enqueue_with(Policy {
            backoff_base_ms: 0,
            backoff_cap_ms: 0,
            ..Policy::default()
        })
        .await;
    let a = db.claim_one("worker-a").await;
    assert!(a
        .fail(ErrorClass::Transient, "timeout", None)
        .await
        .unwrap()
        .committed());
    let b = db.claim_one("worker-b").await; // no backoff: due at once
    assert_eq!(b.fence().token, a.fence().token + 1);
    let version = db.job(job.job_id).await.version;

    let same = a.fail(ErrorClass::Transient, "timeout", None).await.unwrap();
    assert_eq!(same.outcome, Outcome::AlreadyCommitted, "{same:?}");
    let other = a.fail(ErrorClass::Permanent, "declined", None).await.unwrap();
    assert_eq!(other.outcome, Outcome::Conflict, "{other:?}");
    let j = db.job(job.job_id).await;
    assert_eq!(
        (j.state, j.token, j.version),
        (JobState::Leased, b.fence().token, version)
    );

    assert!(b.complete(Some(json!({"by": "b"}))).await.unwrap().committed());
    let late = a.fail(ErrorClass::Transient, "timeout", None).await.unwrap();
    assert_eq!(late.outcome, Outcome::Stale, "{late:?}");
    let late_other = a.fail(ErrorClass::Permanent, "declined", None).await.unwrap();
    assert_eq!(late_other.outcome, Outcome::Stale, "{late_other:?}");
    let j = db.job(job.job_id).await;
    assert_eq!((j.state, j.version), (JobState::Succeeded, version + 1));
    db.assert_verified().await;
}

/// Scenario 2 for every fenced write, not only `complete`: once the lease
/// expired and nobody took over, the holder's heartbeat, progress, submit,
/// fail, snooze, release and confirm-cancel still commit.
#[tokio::test]
async fn expired_but_not_taken_over_every_fenced_write_still_commits() {
    let db = fresh().await;
    for op in [
        "heartbeat",
        "progress",
        "submit",
        "fail",
        "snooze",
        "release",
        "confirm_cancel",
    ] {
        let job = db.enqueue(None, json!({ "op": op })).await;
        let (r, lease) = db
            .ledger
            .claim_job(job.job_id, "worker-a", Duration::from_secs(30))
            .await
            .unwrap();
        assert!(r.committed(), "{op}: {r:?}");
        let a = lease.unwrap();
        if op == "confirm_cancel" {
            assert!(db.ledger.cancel(job.job_id, None).await.unwrap().committed());
        }
        db.expire_lease(job.job_id).await;
        let r = match op {
            "heartbeat" => a.heartbeat(Duration::from_secs(30)).await,
            "progress" => a.progress("step-1", None).await,
            "submit" => a.submit("rcpt-1").await,
            "fail" => a.fail(ErrorClass::Transient, "timeout", None).await,
            "snooze" => a.snooze(Duration::from_secs(60)).await,
            "release" => a.release().await,
            _ => a.confirm_cancel().await,
        }
        .unwrap();
        assert_eq!(r.outcome, Outcome::Committed, "{op}: {r:?}");
    }
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.rejections").await,
        0,
        "nothing refused"
    );
}
