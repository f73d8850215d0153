//! Rebuilds beside the serving table: their batches commit without a
//! flush, and a batch read for a rebuild that has since switched in (and
//! been followed by another) never lands.

mod common;

use common::gated::gated;
use common::{fresh, within};
use jobledger::reader::LogReader;
use jobledger_projections::runner::Runner;
use jobledger_projections::shipped::JobTimeline;
use jobledger_projections::{BoxFuture, Event, Projection};
use serde_json::json;
use sqlx::PgConnection;

/// Records, per (job, version), the `synchronous_commit` its batch was
/// applied under.
struct FlushSeen;
impl Projection for FlushSeen {
    fn name(&self) -> &str {
        "flush_seen"
    }
    fn version(&self) -> i32 {
        1
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (job_id uuid, version bigint, flush text, PRIMARY KEY (job_id, version))"
            ))
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "INSERT INTO {table} SELECT j, v, current_setting('synchronous_commit') \
                 FROM UNNEST($1::uuid[], $2::int8[]) AS u(j, v) ON CONFLICT DO NOTHING"
            ))
            .bind(events.iter().map(|e| e.job_id).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.version).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
}

/// A rebuild's batches commit without waiting for their flush (no one reads
/// the table being built, and the switch's commit flushes them); a serving
/// table's batches wait for theirs, before the rebuild and after it.
#[tokio::test]
async fn only_a_rebuild_commits_without_a_flush() {
    let db = fresh().await;
    for i in 0..5 {
        db.enqueue(None, json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "flush").await.unwrap();
    let runner = Runner::new(db.ledger.pool().clone(), &reader, 2).await.unwrap();
    let flushes = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT flush FROM jobledger_proj.flush_seen ORDER BY job_id, version",
        )
        .fetch_all(db.ledger.pool())
        .await
        .unwrap()
    };
    within("a catch-up", runner.catch_up(&[&FlushSeen]))
        .await
        .unwrap();
    assert_eq!(
        flushes().await,
        vec!["on"; 5],
        "the serving table's first catch-up"
    );

    runner.start_rebuild(&FlushSeen).await.unwrap();
    let s = within("a rebuild", runner.catch_up(&[&FlushSeen])).await.unwrap();
    assert_eq!(s.switched_to, Some(1));
    assert_eq!(flushes().await, vec!["off"; 5], "the rebuilt table, now serving");

    db.enqueue(None, json!({ "i": 5 })).await;
    within("a catch-up", runner.catch_up(&[&FlushSeen]))
        .await
        .unwrap();
    let after = flushes().await;
    assert_eq!(after.iter().filter(|f| *f == "on").count(), 1, "{after:?}");
}

/// Review of issue 15: runner A reads a rebuild's first batch from position
/// 0 and stalls; meanwhile B finishes that rebuild, switches it in and
/// starts another, whose checkpoint is at position 0 again. A's batch must
/// not land: not in the table that now serves, and not as the new
/// rebuild's progress (the new table would miss those events for good).
#[tokio::test]
async fn a_batch_read_for_a_rebuild_that_switched_meanwhile_is_not_applied() {
    let db = fresh().await;
    for i in 0..30 {
        db.enqueue(Some(&format!("s{i}")), json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    let b = Runner::new(db.ledger.pool().clone(), &reader, 100).await.unwrap();
    within("a catch-up", b.catch_up(&[&JobTimeline])).await.unwrap();
    b.start_rebuild(&JobTimeline).await.unwrap();

    let (log, mut gate) = gated(&reader, jobledger_projections::Checkpoint::default(), 0);
    let a = Runner::new(db.ledger.pool().clone(), &log, 100).await.unwrap();
    let a_step = a.step(&[&JobTimeline]);
    let b_moves = async {
        gate.wait_held().await; // A holds the first rebuild's first batch
        let done = within("a rebuild", b.catch_up(&[&JobTimeline])).await.unwrap();
        assert_eq!(done.switched_to, Some(1), "the first rebuild switched in");
        b.start_rebuild(&JobTimeline).await.unwrap();
        gate.release().await;
    };
    let (a_result, ()) = tokio::join!(a_step, b_moves);
    assert_eq!(a_result.unwrap().rebuilt, 0, "A's stale batch is not applied");
    let building: (i64,) =
        sqlx::query_as("SELECT b_position FROM jobledger_proj.registry WHERE name = 'job_timeline'")
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(building.0, 0, "the new rebuild has not moved");

    let done = within("a rebuild", b.catch_up(&[&JobTimeline])).await.unwrap();
    assert_eq!(done.switched_to, Some(1));
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger_proj.job_timeline").await,
        30,
        "the second rebuilt table is complete"
    );
}
