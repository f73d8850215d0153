//! A log written by the format of 2026-12-02 (event schema 1), kept under
//! tests/fixtures/log-v1 and replayed by every later build: each event's
//! stored hash still checks, every job replays through today's `apply` to
//! the projection that code wrote, and the projections rebuild from it.
//! `write_the_fixture` (ignored) is how it was made; it must never be run
//! again by later code (the point is that the bytes are old).

mod common;

use common::{fresh, new_job, TestDb};
use jobledger::domain::workflow::DependencyPolicy;
use jobledger::domain::{ErrorClass, JobState, ReceiptStatus};
use jobledger::ledger::Lease;
use serde_json::{json, Value};
use std::time::Duration;

use common::fixture::{load, DIR};

async fn claim(db: &TestDb, queue: &str) -> Lease {
    claim_as(db, queue, "fixture-worker").await
}

async fn claim_as(db: &TestDb, queue: &str, holder: &str) -> Lease {
    let mut l = db
        .ledger
        .claim(queue, holder, Duration::from_secs(60), 1)
        .await
        .unwrap();
    assert_eq!(l.len(), 1, "one lease from {queue}");
    l.pop().unwrap()
}

async fn ok(r: jobledger::ledger::LedgerResult<jobledger::ledger::WriteResult>) {
    let r = r.unwrap();
    assert!(r.committed(), "{r:?}");
}

/// Every kind of edge the ledger writes today, on a few jobs.
async fn scenario(db: &TestDb) {
    let l = &db.ledger;
    // A job that ended and was purged (first: nothing else has ended yet).
    l.enqueue(new_job("fx-h", Some("old-1"), json!({})))
        .await
        .unwrap();
    ok(claim(db, "fx-h").await.complete(None).await).await;
    assert_eq!(l.purge(Duration::ZERO, 100).await.unwrap(), 1);
    // Succeeded with a result, with a heartbeat, progress and two observations.
    l.enqueue(new_job(
        "fx-a",
        Some("order-1"),
        json!({ "amount": 120, "currency": "EUR" }),
    ))
    .await
    .unwrap();
    let a = claim(db, "fx-a").await;
    ok(a.heartbeat(Duration::from_secs(60)).await).await;
    ok(a.progress("calling_provider", None).await).await;
    ok(a.observe("provider-ack", json!({ "ref": "re_1" })).await).await;
    ok(a.complete(Some(json!({ "refund_id": "re_1" }))).await).await;
    let a_id = a.job().unwrap().job_id;
    ok(l.observe(
        a_id,
        None,
        "webhook",
        json!({ "status": "paid" }),
        "webhook-receiver",
    )
    .await)
    .await;

    // Transient failure, retried, then permanent: dead; replayed; dead again;
    // resolved by an operator; an annotation of its first failure.
    let mut n = new_job("fx-b", Some("order-2"), json!({ "amount": 5 }));
    n.policy = Some(jobledger::domain::Policy {
        max_attempts: 3,
        backoff_base_ms: 1,
        backoff_cap_ms: 1,
        ..Default::default()
    });
    let b_id = l.enqueue(n).await.unwrap().job.job_id;
    let b = claim(db, "fx-b").await;
    ok(
        b.fail(ErrorClass::Transient, "timeout", Some("provider timed out"))
            .await,
    )
    .await;
    db.make_due(b_id).await;
    let b = claim(db, "fx-b").await;
    ok(b.fail(ErrorClass::Permanent, "card_declined", None).await).await;
    ok(l.replay(b_id, "alice", "card updated").await).await;
    let b = claim(db, "fx-b").await;
    ok(b.fail(ErrorClass::Permanent, "card_declined", None).await).await;
    let version = db.job(b_id).await.version;
    ok(l.resolve(
        b_id,
        "bob",
        JobState::Succeeded,
        "refunded by hand",
        json!({ "ticket": "OPS-7" }),
        version,
    )
    .await)
    .await;
    let first_failure: i64 = db
        .count(&format!(
            "SELECT min(position) FROM jobledger.events WHERE job_id = '{b_id}' AND type = 'failed'"
        ))
        .await;
    ok(l.annotate(
        b_id,
        "carol",
        first_failure,
        "it was the provider's outage, not a timeout",
    )
    .await)
    .await;

    // Cancelled before start; cancel requested while running and confirmed.
    let c_id = l
        .enqueue(new_job("fx-c", None, json!({})))
        .await
        .unwrap()
        .job
        .job_id;
    ok(l.cancel(c_id, Some("customer withdrew")).await).await;
    let d_id = l
        .enqueue(new_job("fx-c", None, json!({ "d": true })))
        .await
        .unwrap()
        .job
        .job_id;
    let d = claim(db, "fx-c").await;
    assert_eq!(d.job().unwrap().job_id, d_id);
    ok(l.cancel(d_id, Some("stop")).await).await;
    ok(d.confirm_cancel().await).await;

    // Submitted outside, a pending receipt, then the receipt.
    let e_id = l
        .enqueue(new_job("fx-e", Some("payout-9"), json!({ "iban": "x" })))
        .await
        .unwrap()
        .job
        .job_id;
    let e = claim(db, "fx-e").await;
    ok(e.submit("rcpt-9").await).await;
    ok(l.receipt(e_id, "rcpt-9", ReceiptStatus::Pending).await).await;
    ok(l.receipt(e_id, "rcpt-9", ReceiptStatus::Succeeded).await).await;

    // A lease that expired and was taken over (reconcile), a snooze, a release.
    let f_id = l
        .enqueue(new_job("fx-f", None, json!({ "f": 1 })))
        .await
        .unwrap()
        .job
        .job_id;
    let f = claim(db, "fx-f").await;
    db.expire_lease(f_id).await;
    let f2 = claim_as(db, "fx-f", "fixture-worker-2").await;
    assert!(f.complete(None).await.unwrap().outcome != jobledger::domain::Outcome::Committed);
    ok(f2.snooze(Duration::from_millis(1)).await).await;
    db.make_due(f_id).await;
    let f3 = claim(db, "fx-f").await;
    ok(f3.release().await).await;
    let f4 = claim(db, "fx-f").await;
    ok(f4.complete(None).await).await;

    // A workflow: render → review → publish (hold), plus a fan-in; review
    // dies, publish is held, released by a person, and runs.
    let mut spec = common::workflows::seed("note-7", DependencyPolicy::Hold);
    spec.queue = "fx-w".into();
    spec.finally = Some(jobledger::domain::workflow::FinallySpec {
        name: "report".into(),
        queue: None,
        kind: "report".into(),
        priority: 0,
        policy: None,
    });
    let created = l.workflow(&spec).await.unwrap();
    ok(claim(db, "fx-w")
        .await
        .complete(Some(json!({ "pages": 3 })))
        .await)
    .await;
    ok(claim(db, "fx-w")
        .await
        .fail(ErrorClass::Permanent, "rejected", None)
        .await)
    .await;
    let publish = common::workflows::id_of(&created, "publish");
    ok(l.release_hold(publish, "dana", "publish anyway").await).await;
    ok(claim(db, "fx-w").await.complete(None).await).await;
    ok(claim(db, "fx-w").await.complete(None).await).await;

    // A concurrency key with a uniqueness window, and a purged job.
    let mut g = new_job("fx-g", Some("merchant-3:1"), json!({ "g": 1 }));
    g.concurrency_key = Some("merchant-3".into());
    g.unique_for_ms = Some(3_600_000);
    l.enqueue(g).await.unwrap();
    ok(claim(db, "fx-g").await.complete(None).await).await;
}

async fn rows(db: &TestDb, sql: &str) -> Vec<Value> {
    sqlx::query_scalar(sql).fetch_all(db.ledger.pool()).await.unwrap()
}

fn write(name: &str, rows: &[Value]) {
    let body: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(format!("{DIR}/{name}"), body).unwrap();
}

/// Made once, on 2026-12-02, with the code of that day. Never run it again.
#[tokio::test]
#[ignore]
async fn write_the_fixture() {
    let db = fresh().await;
    scenario(&db).await;
    db.assert_verified().await;
    write(
        "events.ndjson",
        &rows(
            &db,
            "SELECT to_jsonb(e) - 'txid' FROM jobledger.events e ORDER BY position",
        )
        .await,
    );
    write(
        "jobs.ndjson",
        &rows(
            &db,
            "SELECT to_jsonb(j) - 'ended_at' FROM jobledger.jobs j ORDER BY job_id",
        )
        .await,
    );
    write(
        "tombstones.ndjson",
        &rows(
            &db,
            "SELECT to_jsonb(t) FROM jobledger.tombstones t ORDER BY job_id",
        )
        .await,
    );
}

/// Today's code reads the old log: every stored hash checks, every job
/// replays to the projection the old code wrote, `jobs_rebuilt` rebuilds
/// from it to the same rows.
#[tokio::test]
async fn the_old_log_replays_verifies_and_rebuilds() {
    use jobledger::reader::LogReader;
    use jobledger_projections::{runner::Runner, Projection};
    let db = fresh().await;
    load(&db).await;
    let report = db.ledger.verify(None).await.unwrap();
    assert!(report.ok(), "{:?}", report.problems);
    assert_eq!((report.jobs, report.events), (13, 63));
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 7).await.unwrap();
    let rebuilt: &dyn Projection = &jobledger::rebuilt::JobsRebuilt;
    common::within("a catch-up", runner.catch_up(&[rebuilt]))
        .await
        .unwrap();
    let problems = db.ledger.compare_rebuilt().await.unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    use jobledger_projections::{shipped, workflows};
    let others: [&dyn Projection; 3] = [&shipped::JobTimeline, &shipped::QueueStats, &workflows::Workflows];
    for p in others {
        common::within("a catch-up", runner.catch_up(&[p])).await.unwrap();
    }
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger_proj.job_timeline").await,
        63,
        "one timeline row per event"
    );
}

/// The old observation reads as today's (its fence in `by`), a new event
/// appended to an old job is written in today's schema and the chain goes
/// on across the two; relabelling an old event's schema breaks its hash.
#[tokio::test]
async fn old_and_new_schemas_share_a_chain_and_the_schema_is_under_the_hash() {
    use jobledger::domain::{EventBody, Fence};
    let db = fresh().await;
    load(&db).await;
    let observed: Vec<jobledger::store::EventRow> = sqlx::query_as(&format!(
        "SELECT position, {} FROM jobledger.events WHERE type = 'observed' ORDER BY position",
        jobledger::store::rows::EVENT_COLUMNS
    ))
    .fetch_all(db.ledger.pool())
    .await
    .unwrap();
    assert_eq!(observed.len(), 2);
    assert!(observed
        .iter()
        .all(|r| r.schema == 1 && r.data.get("by_epoch").is_some()));
    let bys: Vec<Option<Fence>> = observed
        .iter()
        .map(|r| match r.to_event().unwrap().body {
            EventBody::Observed { by, .. } => by,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(bys, vec![Some(Fence { epoch: 2, token: 1 }), None]);

    let job = observed[0].job_id;
    let r = db
        .ledger
        .observe(
            job,
            None,
            "late-webhook",
            json!({ "again": true }),
            "webhook-receiver",
        )
        .await
        .unwrap();
    assert!(r.committed(), "{r:?}");
    assert_eq!(
        db.count(&format!(
            "SELECT schema::int8 FROM jobledger.events WHERE job_id = '{job}' ORDER BY version DESC LIMIT 1"
        ))
        .await,
        i64::from(jobledger::domain::schema::CURRENT)
    );
    db.assert_verified().await;

    db.around_the_log(
        "UPDATE jobledger.events SET schema = 2 WHERE job_id = $1 AND type = 'observed' AND schema = 1",
        job,
    )
    .await;
    let report = db.ledger.verify(Some(job)).await.unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.position == Some(observed[0].position) && p.detail.contains("hash mismatch")),
        "{:?}",
        report.problems
    );
}
