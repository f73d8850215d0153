//! Receipts and deadlines, the sweeper's lease-expiry policies, release and
//! snooze: the edges that give a job back or end it without its holder.

mod common;

use chrono::Utc;
use common::fresh;
use jobledger::domain::{
    ExpiryPolicy, JobState, NextAction, Outcome, Policy, Reason, ReceiptPolicy, ReceiptStatus,
};
use serde_json::json;
use std::time::Duration;

/// Receipts: submit releases the lease; succeeded / failed / pending; a
/// wrong receipt id conflicts; a deadline ends the wait by policy.
#[tokio::test]
async fn receipts_and_deadlines() {
    let db = fresh().await;
    let policy = Policy {
        receipt_timeout_ms: 60_000,
        max_attempts: 3,
        ..Policy::default()
    };
    let a = db.enqueue_with(policy.clone()).await;
    let l = db.claim_one("w").await;
    let r = l.submit("rcpt-a").await.unwrap();
    let j = r.job.unwrap();
    assert_eq!(
        (j.state, j.lease_until, j.holder),
        (JobState::AwaitingReceipt, None, None)
    );
    assert_eq!(
        l.submit("rcpt-a").await.unwrap().outcome,
        Outcome::AlreadyCommitted
    );
    assert_eq!(
        l.heartbeat(Duration::from_secs(1)).await.unwrap().outcome,
        Outcome::InvalidTransition
    );
    assert_eq!(
        db.ledger
            .receipt(a.job_id, "rcpt-x", ReceiptStatus::Succeeded)
            .await
            .unwrap()
            .outcome,
        Outcome::Conflict
    );
    let p = db
        .ledger
        .receipt(a.job_id, "rcpt-a", ReceiptStatus::Pending)
        .await
        .unwrap();
    assert_eq!(p.job.unwrap().state, JobState::AwaitingReceipt);
    let f = db
        .ledger
        .receipt(a.job_id, "rcpt-a", ReceiptStatus::Failed)
        .await
        .unwrap()
        .job
        .unwrap();
    assert_eq!((f.state, f.reason), (JobState::Queued, Reason::ReceiptFailed));

    // Deadline under the dead policy.
    let b = db.enqueue_with(policy.clone()).await;
    db.make_due(a.job_id).await;
    let leases = db
        .ledger
        .claim("q", "w", Duration::from_secs(30), 10)
        .await
        .unwrap();
    let lb = leases.iter().find(|l| l.job_id() == b.job_id).unwrap();
    lb.submit("rcpt-b").await.unwrap();
    assert!(
        db.ledger
            .sweep(100)
            .await
            .unwrap()
            .iter()
            .all(|r| r.job_id != b.job_id),
        "not yet due"
    );
    db.expire_receipt(b.job_id).await;
    let swept = db.ledger.sweep(100).await.unwrap();
    let jb = swept
        .iter()
        .find(|r| r.job_id == b.job_id)
        .unwrap()
        .job
        .clone()
        .unwrap();
    assert_eq!((jb.state, jb.reason), (JobState::Dead, Reason::ReceiptTimeout));

    // Deadline under the reconcile policy: back to the queue, to reconcile.
    let c = db
        .enqueue_with(Policy {
            on_receipt_timeout: ReceiptPolicy::Reconcile,
            ..policy
        })
        .await;
    let lc = db.claim_one("w").await;
    assert_eq!(lc.job_id(), c.job_id);
    lc.submit("rcpt-c").await.unwrap();
    db.expire_receipt(c.job_id).await;
    db.ledger.sweep(100).await.unwrap();
    let lc2 = db.claim_one("w").await;
    assert_eq!(
        (lc2.job_id(), lc2.next_action()),
        (c.job_id, NextAction::Reconcile)
    );
    // No verify here: the time-travel hooks edited the projection on purpose.
}

/// Lease-expiry policies other than reconcile belong to the sweeper; a lease
/// that expires on the last attempt ends the job.
#[tokio::test]
async fn sweeper_policies() {
    let db = fresh().await;
    let requeue = db
        .enqueue_with(Policy {
            on_lease_expiry: ExpiryPolicy::Requeue,
            ..Policy::default()
        })
        .await;
    let dead = db
        .enqueue_with(Policy {
            on_lease_expiry: ExpiryPolicy::Dead,
            ..Policy::default()
        })
        .await;
    let last = db
        .enqueue_with(Policy {
            max_attempts: 1,
            ..Policy::default()
        })
        .await;
    let leases = db
        .ledger
        .claim("q", "w", Duration::from_secs(30), 3)
        .await
        .unwrap();
    assert_eq!(leases.len(), 3);
    assert!(
        db.ledger.sweep(100).await.unwrap().is_empty(),
        "nothing expired yet"
    );
    for id in [requeue.job_id, dead.job_id, last.job_id] {
        db.expire_lease(id).await;
    }
    // A claim does not take over requeue/dead-policy leases; the reconcile-
    // policy lease on its last attempt is ended by the claim that finds it.
    db.claim_none("w2").await;
    let j = db.job(last.job_id).await;
    assert_eq!((j.state, j.reason), (JobState::Dead, Reason::AttemptsExhausted));
    assert_eq!(j.last_error.unwrap().code, "lease_expired");
    let swept = db.ledger.sweep(100).await.unwrap();
    assert_eq!(swept.len(), 2);
    let state = |id| {
        swept
            .iter()
            .find(|r| r.job_id == id)
            .unwrap()
            .job
            .clone()
            .unwrap()
    };
    assert_eq!(
        (state(requeue.job_id).state, state(requeue.job_id).reason),
        (JobState::Queued, Reason::LeaseExpiredRequeued)
    );
    assert_eq!(
        (state(dead.job_id).state, state(dead.job_id).reason),
        (JobState::Dead, Reason::LeaseExpiredUncertain)
    );
    // The holder whose lease the sweeper revoked is stale now.
    let l = leases.iter().find(|l| l.job_id() == requeue.job_id).unwrap();
    assert_eq!(l.complete(None).await.unwrap().outcome, Outcome::Stale);
    // No verify here: the time-travel hooks edited the projection on purpose.
}

/// Release (graceful shutdown of unstarted work) and snooze give the job
/// back without burning an attempt.
#[tokio::test]
async fn release_and_snooze_keep_attempts() {
    let db = fresh().await;
    let job = db.enqueue(None, json!({})).await;
    let l = db.claim_one("w").await;
    let j = l.release().await.unwrap().job.unwrap();
    assert_eq!(
        (j.state, j.attempt, j.reason),
        (JobState::Queued, 0, Reason::ReleasedUnstarted)
    );
    let l = db.claim_one("w").await;
    assert_eq!((l.fence().token, l.job().unwrap().attempt), (2, 1));
    let j = l.snooze(Duration::from_secs(600)).await.unwrap().job.unwrap();
    assert_eq!((j.state, j.attempt), (JobState::Queued, 0));
    db.claim_none("w").await;
    db.make_due(job.job_id).await;
    let l = db.claim_one("w").await;
    let j = l.heartbeat(Duration::from_secs(120)).await.unwrap().job.unwrap();
    assert!(j.lease_until.unwrap() > Utc::now() + chrono::Duration::seconds(100));
    let j = l.progress("uploaded-images", None).await.unwrap().job.unwrap();
    assert_eq!(j.step.as_deref(), Some("uploaded-images"));
    // No verify here: the time-travel hooks edited the projection on purpose.
}

/// An expired lease under the `requeue` (or `dead`) policy is the
/// sweeper's: neither a queue claim nor a targeted claim of the job takes
/// it over (a takeover would reconcile, which the policy says not to).
#[tokio::test]
async fn only_a_reconcile_policy_lets_a_claim_take_over_an_expired_lease() {
    for policy in [ExpiryPolicy::Requeue, ExpiryPolicy::Dead] {
        let db = fresh().await;
        let job = db
            .enqueue_with(Policy {
                on_lease_expiry: policy,
                ..Policy::default()
            })
            .await;
        let a = db.claim_one("worker-a").await;
        assert_eq!(a.job_id(), job.job_id);
        db.expire_lease(job.job_id).await;
        db.claim_none("worker-b").await;
        let (r, lease) = db
            .ledger
            .claim_job(job.job_id, "worker-b", Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(
            (r.outcome, lease.is_none()),
            (Outcome::InvalidTransition, true),
            "{policy:?}: {r:?}"
        );
        let j = db.job(job.job_id).await;
        assert_eq!(
            (j.state, j.token, j.holder.as_deref()),
            (JobState::Leased, 1, Some("worker-a")),
            "{policy:?}"
        );
        // The sweeper ends it by the policy.
        assert_eq!(db.ledger.sweep(10).await.unwrap().len(), 1);
    }
}
