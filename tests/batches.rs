//! Issue 10 item 3: a worker's batched heartbeats and completions are one
//! transaction, but every item is fenced on its own and answered in order:
//! a refused item changes nothing and does not take the others down.

mod common;

use common::fresh;
use jobledger::domain::{JobState, Outcome};
use jobledger::ledger::Lease;
use serde_json::json;
use std::time::Duration;

/// Four jobs, each claimed by worker `a`.
async fn four_leases(db: &common::TestDb, prefix: &str) -> [Lease; 4] {
    let mut leases = vec![];
    for i in 0..4 {
        db.enqueue(Some(&format!("{prefix}{i}")), json!({ "i": i })).await;
        leases.push(db.claim_one("a").await);
    }
    <[Lease; 4]>::try_from(leases).ok().unwrap()
}

fn answered(answers: &[jobledger::ledger::WriteResult]) -> Vec<(uuid::Uuid, Outcome)> {
    answers.iter().map(|r| (r.job_id, r.outcome)).collect()
}

#[tokio::test]
async fn batched_completions_are_fenced_one_by_one_and_answered_in_order() {
    let db = fresh().await;
    let [live, taken, done, other] = four_leases(&db, "c").await;
    db.expire_lease(taken.job_id()).await;
    let successor = db.claim_one("b").await; // takes `taken` over
    assert_eq!(successor.job_id(), taken.job_id());
    assert!(done.complete(Some(json!({"n": 1}))).await.unwrap().committed());
    assert!(other.complete(Some(json!({"n": 1}))).await.unwrap().committed());
    let versions = db.count("SELECT sum(version)::bigint FROM jobledger.jobs").await;

    let answers = Lease::complete_many(
        &db.ledger,
        vec![
            (&taken, Some(json!({"late": true}))),
            (&live, Some(json!({"n": 0}))),
            (&done, Some(json!({"n": 1}))),  // the first answer was lost
            (&other, Some(json!({"n": 2}))), // a different result
        ],
    )
    .await
    .unwrap();
    let got = answered(&answers);
    assert_eq!(
        got,
        vec![
            (taken.job_id(), Outcome::Stale),
            (live.job_id(), Outcome::Committed),
            (done.job_id(), Outcome::AlreadyCommitted),
            (other.job_id(), Outcome::Conflict),
        ]
    );
    assert_eq!(
        db.count("SELECT sum(version)::bigint FROM jobledger.jobs").await,
        versions + 1,
        "only the live completion wrote"
    );
    assert_eq!(db.state_of(live.job_id()).await, JobState::Succeeded);
    assert_eq!(
        db.job(taken.job_id()).await.token,
        successor.fence().token,
        "B keeps it"
    );
    db.assert_verified().await;
}

#[tokio::test]
async fn batched_heartbeats_are_fenced_one_by_one_and_answered_in_order() {
    let db = fresh().await;
    let [cancelled, live, taken, finished] = four_leases(&db, "h").await;
    db.ledger.cancel(cancelled.job_id(), None).await.unwrap();
    db.expire_lease(taken.job_id()).await;
    db.claim_one("b").await;
    assert!(finished.complete(None).await.unwrap().committed());
    let before = db.job(live.job_id()).await.lease_until.unwrap();

    let answers = Lease::heartbeat_many(
        &db.ledger,
        &[&cancelled, &live, &taken, &finished],
        Duration::from_secs(600),
    )
    .await
    .unwrap();
    let got = answered(&answers);
    assert_eq!(
        got,
        vec![
            (cancelled.job_id(), Outcome::InvalidTransition),
            (live.job_id(), Outcome::Committed),
            (taken.job_id(), Outcome::Stale),
            (finished.job_id(), Outcome::InvalidTransition),
        ]
    );
    let after = db.job(live.job_id()).await.lease_until.unwrap();
    assert!(after > before, "the live lease was extended");
    assert_eq!(db.state_of(cancelled.job_id()).await, JobState::CancelRequested);
    db.assert_verified().await;
}
