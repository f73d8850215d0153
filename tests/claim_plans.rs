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
    let worker = start(
        base(&db, "history")
            .queue("old")
            .handler("refund", noop)
            .build()
            .unwrap(),
    );
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
    let burst = (0..500)
        .map(|i| new_job("q", None, json!({ "burst": i })))
        .collect();
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
    assert_eq!(
        search, 0,
        "the claim read the search index (and sorted every queued job)"
    );
    assert!(due >= 1, "the claim did not walk jobs_due ({due} scans)");
}

/// Review: the claim checks the queue's controls in the same snapshot as
/// its scans. A claim that waited for its lock on `jobs` while a pause
/// committed must claim nothing (checked in the calling statement, the
/// check read the older snapshot and the claim took the paused jobs).
#[tokio::test]
async fn a_claim_that_waited_for_its_lock_sees_a_pause_committed_meanwhile() {
    let db = fresh().await;
    for i in 0..3 {
        db.enqueue(None, json!({ "i": i })).await;
    }
    let mut holder = db.conn().await;
    let mut blocking = holder.begin().await.unwrap();
    sqlx::query("LOCK TABLE jobledger.jobs IN EXCLUSIVE MODE")
        .execute(&mut *blocking)
        .await
        .unwrap();
    let claim = tokio::spawn({
        let l = db.ledger.clone();
        async move { l.claim("q", "w", std::time::Duration::from_secs(30), 5).await }
    });
    common::eventually("the claim waits for its lock on jobs", || async {
        db.count(
            "SELECT count(*) FROM pg_locks WHERE NOT granted \
             AND relation = 'jobledger.jobs'::regclass",
        )
        .await
            > 0
    })
    .await;
    db.ledger
        .pause_queue("q", "alice", "the provider is down")
        .await
        .unwrap();
    blocking.commit().await.unwrap();
    let got = claim.await.unwrap().unwrap();
    assert!(got.is_empty(), "a paused queue was claimed: {} leases", got.len());
    let leased = db
        .count("SELECT count(*) FROM jobledger.jobs WHERE state = 'leased'")
        .await;
    assert_eq!(leased, 0);
}
