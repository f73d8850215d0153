//! `job_timeline` inserts each batch plainly and falls back to the
//! idempotent insert only when a (job, version) comes again: a redelivered
//! row changes nothing, and the rest of its batch is still written.

mod common;

use common::fresh;
use jobledger_projections::shipped::JobTimeline;
use jobledger_projections::{Event, Projection};
use serde_json::Value;
use uuid::Uuid;

fn event(job_id: Uuid, version: i64, actor: &str) -> Event {
    Event {
        position: version,
        job_id,
        version,
        kind: "observed".into(),
        from_state: Some("queued".into()),
        to_state: "queued".into(),
        reason: "observed".into(),
        error_class: None,
        actor: actor.into(),
        epoch: 1,
        token: 0,
        attempt: 0,
        run: 0,
        data: Value::Null,
        recorded_at: chrono::Utc::now(),
        prev_hash: None,
        hash: String::new(),
        schema: 1,
    }
}

/// After the fallback, no savepoint of the insert is left open either: a
/// caller applying many batches in one transaction does not nest
/// subtransactions.
#[tokio::test]
async fn a_redelivered_version_changes_nothing_and_the_batch_is_written() {
    let db = fresh().await;
    let table = "public.timeline_redelivery";
    let mut tx = db.ledger.pool().begin().await.unwrap();
    JobTimeline.create(&mut tx, table).await.unwrap();
    let job = Uuid::now_v7();
    JobTimeline
        .apply(&mut tx, table, &[event(job, 1, "first"), event(job, 2, "first")])
        .await
        .unwrap();
    // Version 2 again (handed out early, then met in log order), with a
    // different actor that must not land, beside a new version 3.
    JobTimeline
        .apply(&mut tx, table, &[event(job, 2, "again"), event(job, 3, "first")])
        .await
        .expect("a redelivered version is not an error");
    let rows: Vec<(i64, String)> =
        sqlx::query_as(&format!("SELECT version, actor FROM {table} ORDER BY version"))
            .fetch_all(&mut *tx)
            .await
            .unwrap();
    let want: Vec<(i64, String)> = vec![(1, "first".into()), (2, "first".into()), (3, "first".into())];
    assert_eq!(rows, want);
    let left = sqlx::query("RELEASE SAVEPOINT job_timeline_plain")
        .execute(&mut *tx)
        .await
        .expect_err("no savepoint left to release");
    assert!(left.to_string().contains("does not exist"), "{left}");
}
