//! Issue 15, the fall-off with history: a claim walks the index that gives
//! its order (`jobs_due`), whatever the statistics say. With statistics
//! taken while no job was queued, the planner used to read a burst of
//! queued jobs through the search index `jobs_search_state` and sort all of
//! them, on every claim (docs/benchmarks.md).

mod common;

use common::workers::{base, start, stop};
use common::{fresh, new_job};
use jobledger::worker::{HandlerOutcome, JobContext};
use serde_json::json;
use sqlx::Connection;

/// Index scans of `index` in the current transaction of `conn`.
async fn scans(conn: &mut sqlx::PgConnection, index: &str) -> i64 {
    sqlx::query_scalar("SELECT pg_stat_get_xact_numscans($1::regclass)")
        .bind(index)
        .fetch_one(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_claim_walks_the_due_index_even_when_statistics_say_nothing_is_queued() {
    let db = fresh().await;
    // A finished history in two queues, their rows interleaved on disk.
    let n = 3000;
    let news = (0..n)
        .map(|i| new_job(if i % 2 == 0 { "q" } else { "old" }, None, json!({ "i": i })))
        .collect();
    db.ledger.enqueue_many_as(news, "test").await.unwrap();
    let noop = |_ctx: JobContext| async { HandlerOutcome::success(json!({})) };
    let worker = start(base(&db, "history").queue("old").handler("refund", noop).build().unwrap());
    common::eventually("the history ran", || async {
        db.count("SELECT count(*) FROM jobledger.jobs WHERE state = 'succeeded'")
            .await
            == n as i64
    })
    .await;
    stop(worker).await;
    // Statistics taken now say that no job is queued (autoanalyze waits for
    // a tenth of the table to change); then a burst arrives.
    sqlx::query("ANALYZE jobledger.jobs")
        .execute(db.ledger.pool())
        .await
        .unwrap();
    let burst = (0..500).map(|i| new_job("q", None, json!({ "burst": i }))).collect();
    db.ledger.enqueue_many_as(burst, "test").await.unwrap();

    let mut conn = db.conn().await;
    let mut tx = conn.begin().await.unwrap();
    let got = jobledger::store::jobs::lock_claimable(&mut tx, "q", "plans", 5)
        .await
        .unwrap();
    assert_eq!(got.len(), 5);
    let (due, search) = (
        scans(&mut tx, "jobledger.jobs_due").await,
        scans(&mut tx, "jobledger.jobs_search_state").await,
    );
    tx.rollback().await.unwrap();
    assert_eq!(search, 0, "the claim read the search index (and sorted every queued job)");
    assert!(due >= 1, "the claim did not walk jobs_due ({due} scans)");
}
