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

/// A batched write decides on the lease's copy of its job while the row has
/// not moved (ledger::engine::lock_batch). That holds only if the copy a
/// claim hands out is the row exactly: every field, through the database's
/// round trip (JSON numbers and strings, microseconds, a retried job's last
/// error, a key, a concurrency key, a workflow step).
#[tokio::test]
async fn a_lease_holds_its_job_exactly_as_the_row_holds_it() {
    let db = fresh().await;
    let odd = json!({ "f": 1.5, "e": 1e-7, "big": 12345678901234567890u64, "neg": -0.0,
                      "s": "ü 😀 \"q\" \\", "n": null, "a": [1, { "b": [] }, {}] });
    db.enqueue(Some("odd"), odd).await;
    let mut keyed = common::new_job("q", None, json!({ "k": 1 }));
    keyed.concurrency_key = Some("tenant-1".into());
    keyed.priority = 3;
    db.ledger.enqueue(keyed).await.unwrap();
    let mut leases = db
        .ledger
        .claim("q", "a", Duration::from_secs(30), 10)
        .await
        .unwrap();

    // A retried job carries its last error into the next claim.
    let retried = db.enqueue(Some("retried"), json!({})).await;
    let first = db.claim_one("a").await;
    let failed = first
        .fail(jobledger::domain::ErrorClass::Transient, "flaky", Some("boom ü"))
        .await
        .unwrap();
    assert!(failed.committed(), "{failed:?}");
    db.make_due(retried.job_id).await;
    leases.push(db.claim_one("a").await);

    let created = db
        .ledger
        .workflow(&common::workflows::seed(
            "wf",
            jobledger::domain::workflow::DependencyPolicy::Cancel,
        ))
        .await
        .unwrap();
    leases.push(db.claim_one("a").await);

    assert_eq!(leases.len(), 4);
    for lease in &leases {
        let copy = lease.job().expect("a claim's lease carries its job");
        assert_eq!(copy, &db.job(lease.job_id()).await, "lease of {}", copy.kind);
    }
    let step = leases[3].job().unwrap();
    assert!(step.workflow.is_some(), "the workflow's first step: {created:?}");
    assert!(leases[2].job().unwrap().last_error.is_some());
    assert!(leases.iter().any(|l| l.job().unwrap().admission.is_some()));
}

/// A lease whose job moved since the claim (its own heartbeat here) has a
/// stale copy: the batch reads that row in full and decides on it. Decided
/// on the copy, the event would link to the claim's hash instead of the
/// heartbeat's, and the database would refuse the whole batch.
#[tokio::test]
async fn a_batch_decides_on_the_row_when_a_lease_copy_is_behind() {
    let db = fresh().await;
    let [moved, kept, _, _] = four_leases(&db, "m").await;
    assert!(moved
        .heartbeat(Duration::from_secs(60))
        .await
        .unwrap()
        .committed());
    let answers = Lease::complete_many(&db.ledger, vec![(&moved, None), (&kept, None)])
        .await
        .unwrap();
    assert_eq!(
        answered(&answers),
        vec![
            (moved.job_id(), Outcome::Committed),
            (kept.job_id(), Outcome::Committed)
        ]
    );
    assert_eq!(
        db.job(moved.job_id()).await.version,
        4,
        "enqueued, claimed, heartbeat, succeeded"
    );
    let hb = Lease::heartbeat_many(&db.ledger, &[&moved], Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        hb[0].outcome,
        Outcome::InvalidTransition,
        "a finished job is not extended"
    );
    db.assert_verified().await;
}

/// A row whose fenced columns were changed around the log (its token here,
/// version and chain head as they were) is refused on its own; the others
/// in the batch still commit. Review of issue 15: decided on the lease's
/// copy, the fenced update missed that row and the whole batch failed, and
/// a worker's heartbeat batches kept failing for every lease it held.
#[tokio::test]
async fn a_row_changed_around_the_log_is_refused_alone() {
    let db = fresh().await;
    let [a, forged, b, _] = four_leases(&db, "f").await;
    db.around_the_log(
        "UPDATE jobledger.jobs SET token = token + 7 WHERE job_id = $1",
        forged.job_id(),
    )
    .await;
    let expected = vec![
        (a.job_id(), Outcome::Committed),
        (forged.job_id(), Outcome::Stale),
        (b.job_id(), Outcome::Committed),
    ];
    let hb = Lease::heartbeat_many(&db.ledger, &[&a, &forged, &b], Duration::from_secs(60))
        .await
        .expect("one forged row does not fail the batch");
    assert_eq!(answered(&hb), expected, "heartbeats");
    let done = Lease::complete_many(&db.ledger, vec![(&a, None), (&forged, None), (&b, None)])
        .await
        .expect("one forged row does not fail the batch");
    assert_eq!(answered(&done), expected, "completions");
}

/// A JSON null result is no result: the job's row and its replay agree.
/// Review of issue 15 (older than it): the row kept `null` while the
/// `succeeded` event read back as no result, and `verify` refused the job.
/// A subprocess handler that prints `null` completes this way.
#[tokio::test]
async fn a_null_result_is_no_result() {
    let db = fresh().await;
    let [one, two, three, _] = four_leases(&db, "n").await;
    assert!(one
        .complete(Some(serde_json::Value::Null))
        .await
        .unwrap()
        .committed());
    let batch = Lease::complete_many(
        &db.ledger,
        vec![
            (&two, Some(serde_json::Value::Null)),
            (&three, Some(json!({ "ok": true }))),
        ],
    )
    .await
    .unwrap();
    assert!(batch.iter().all(|r| r.committed()), "{batch:?}");
    assert_eq!(db.job(one.job_id()).await.result, None);
    assert_eq!(db.job(two.job_id()).await.result, None);
    let again = one.complete(None).await.unwrap();
    assert_eq!(
        again.outcome,
        Outcome::AlreadyCommitted,
        "null and none are one answer"
    );
    db.assert_verified().await;
}

/// A row that kept a JSON `null` result (written before `decide` turned a
/// null result into none) reads as no result, as its `succeeded` event does,
/// so `verify` agrees with it (review of issue 15: it reported the job, with
/// an empty detail, for as long as the job lived).
#[tokio::test]
async fn a_row_that_kept_a_null_result_reads_as_none() {
    let db = fresh().await;
    let [done, _, _, _] = four_leases(&db, "o").await;
    assert!(done.complete(None).await.unwrap().committed());
    db.around_the_log(
        "UPDATE jobledger.jobs SET result = 'null'::jsonb WHERE job_id = $1",
        done.job_id(),
    )
    .await;
    assert_eq!(db.job(done.job_id()).await.result, None);
    db.assert_verified().await;
}

/// A batch that waits for its rows' locks decides at the database clock read
/// once it holds them, on both paths: a lease's copy (`lock_generations`)
/// and a resumed lease read in full (`lock_jobs`). Review of issue 15: the
/// clock was read as each row was scanned, before the wait, so a heartbeat
/// queued behind a transaction that rolled back extended its lease from the
/// past. The holder reads the clock only after the batch is seen waiting.
#[tokio::test]
async fn a_batch_that_waits_for_its_locks_decides_after_it_got_them() {
    let db = fresh().await;
    let [copy, other, _, _] = four_leases(&db, "w").await;
    let resumed = Lease::resume(
        db.ledger.clone(),
        other.job_id(),
        other.fence().epoch,
        other.fence().token,
        "a",
    );
    let mut holder = db.conn().await;
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("SELECT 1 FROM jobledger.jobs WHERE job_id = ANY($1) FOR UPDATE")
        .bind(vec![copy.job_id(), other.job_id()])
        .execute(&mut holder)
        .await
        .unwrap();
    let ledger = db.ledger.clone();
    let (c, r) = (copy.clone(), resumed.clone());
    let batch =
        tokio::spawn(async move { Lease::heartbeat_many(&ledger, &[&c, &r], Duration::from_secs(60)).await });
    common::eventually("the batch waits for the locks", || async {
        db.count(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND datname = current_database()",
        )
        .await
            > 0
    })
    .await;
    let released: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&mut holder)
        .await
        .unwrap();
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let answers = batch.await.unwrap().unwrap();
    assert!(answers.iter().all(|a| a.committed()), "{answers:?}");
    for id in [copy.job_id(), other.job_id()] {
        let job = db.job(id).await;
        assert!(
            job.updated_at >= released,
            "decided at {} before the lock was let go at {released}",
            job.updated_at
        );
        assert!(job.lease_until.unwrap() >= released + chrono::Duration::seconds(60));
    }
    db.assert_verified().await;
}
