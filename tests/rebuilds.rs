//! Issue 10 item 4: a rebuild whose process died resumes from its own
//! checkpoint (it neither starts over nor skips), with a projection that
//! counts every application, so a double apply cannot hide.

mod common;

use common::{fresh, within};
use jobledger::reader::LogReader;
use jobledger_projections::runner::Runner;
use jobledger_projections::{BoxFuture, Event, Projection};
use serde_json::json;
use sqlx::PgConnection;

/// Counts how often each (job, version) was applied, in version `.0`.
struct Counts(i32);
impl Projection for Counts {
    fn name(&self) -> &str {
        "counts"
    }
    fn version(&self) -> i32 {
        self.0
    }
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>> {
        Box::pin(async move {
            sqlx::query(&format!(
                "CREATE TABLE {table} (job_id uuid, version bigint, applied int NOT NULL, PRIMARY KEY (job_id, version))"
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
                "INSERT INTO {table} AS t SELECT j, v, 1 FROM UNNEST($1::uuid[], $2::int8[]) AS u(j, v) \
                 ON CONFLICT (job_id, version) DO UPDATE SET applied = t.applied + 1"
            ))
            .bind(events.iter().map(|e| e.job_id).collect::<Vec<_>>())
            .bind(events.iter().map(|e| e.version).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await?;
            Ok(())
        })
    }
}

#[tokio::test]
async fn a_crashed_rebuild_resumes_from_its_own_checkpoint() {
    let db = fresh().await;
    for i in 0..10 {
        db.enqueue(Some(&format!("r{i}")), json!({ "i": i })).await;
    }
    let reader = LogReader::open(db.ledger.pool().clone(), "projections")
        .await
        .unwrap();
    {
        let first = Runner::new(db.ledger.pool().clone(), &reader, 4).await.unwrap();
        within("a catch-up", first.catch_up(&[&Counts(1)])).await.unwrap();
        let s = first.step(&[&Counts(1), &Counts(2)]).await.unwrap();
        assert!(s.rebuilt >= 1 && s.switched_to.is_none(), "{s:?}");
        // The process dies here: nothing but the database remembers.
    }
    let building: i64 = db.count("SELECT count(*) FROM jobledger_proj.counts_v2").await;
    assert!(
        (1..10).contains(&building),
        "part of the rebuild is done: {building}"
    );
    let second = Runner::new(db.ledger.pool().clone(), &reader, 4).await.unwrap();
    let done = within("the resumed rebuild", second.catch_up(&[&Counts(1), &Counts(2)]))
        .await
        .unwrap();
    assert_eq!(done.switched_to, Some(2));
    let rows: Vec<(i64, i32)> = sqlx::query_as("SELECT version, applied FROM jobledger_proj.counts")
        .fetch_all(db.ledger.pool())
        .await
        .unwrap();
    assert_eq!(rows.len(), 10, "nothing skipped");
    assert!(
        rows.iter().all(|(_, n)| *n == 1),
        "nothing applied twice: {rows:?}"
    );
}
