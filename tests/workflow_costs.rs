//! What a workflow step costs beyond a plain job (issue 11's throughput
//! target): the parent's count must not touch the table's indexes, and the
//! release of waiting steps must find them by their key alone.

mod common;

use common::workflows::{spec, step};
use common::{fresh, new_job};
use jobledger::domain::workflow::WorkflowSpec;
use serde_json::json;
use sqlx::Connection;
use uuid::Uuid;

/// Hot-updated rows of `jobledger.jobs` in the transaction so far.
async fn in_place(tx: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar("SELECT pg_stat_get_xact_tuples_hot_updated('jobledger.jobs'::regclass)")
        .fetch_one(&mut *tx)
        .await
        .unwrap()
}

/// A step's end in the caller's transaction: the step's own row moves to
/// `succeeded` (new index entries), and its parent's count changes no
/// indexed column (running → running, reason `step_finished` again), so
/// PostgreSQL updates the parent in place (HOT). Before `ended_at`, the
/// index of ended jobs on `updated_at` made every count a full update.
#[tokio::test]
async fn a_parents_count_is_an_update_in_place() {
    let db = fresh().await;
    db.ledger
        .workflow(&spec("hot", vec![step("a", &[]), step("b", &[]), step("c", &[])]))
        .await
        .unwrap();
    let mut seen = vec![];
    for _ in 0..2 {
        let lease = db.claim_one("w").await;
        let mut tx = db.ledger.pool().begin().await.unwrap();
        let r = lease.complete_in(&mut tx, None).await.unwrap();
        assert!(r.committed(), "{r:?}");
        seen.push(in_place(&mut tx).await);
        tx.commit().await.unwrap();
    }
    // The first count also changes the parent's reason (workflow_started →
    // step_finished), an indexed column: a full update.
    assert_eq!(seen, vec![0, 1], "updates in place per step end");
    db.assert_verified().await;
}

fn chain(key: &str, n: usize) -> WorkflowSpec {
    let names: Vec<String> = (0..n).map(|i| format!("s{i}")).collect();
    spec(
        key,
        (0..n)
            .map(|i| {
                let after: Vec<&str> = if i == 0 {
                    vec![]
                } else {
                    vec![names[i - 1].as_str()]
                };
                step(&names[i], &after)
            })
            .collect(),
    )
}

/// The planner's statistics lag behind a burst of new workflows: analysed
/// while waiting steps were rare, it once answered "which of these 26 jobs
/// are waiting" by walking every waiting step of the search index on
/// `state` (1.9 ms a call in the workflow bench). The release must look the
/// jobs up by their key whatever the statistics say.
#[tokio::test]
async fn the_release_finds_waiting_steps_by_key_whatever_the_statistics_say() {
    let db = fresh().await;
    let mut conn = db.conn().await;
    sqlx::query("ALTER TABLE jobledger.jobs SET (autovacuum_enabled = false)")
        .execute(&mut conn)
        .await
        .unwrap();
    db.ledger
        .enqueue_many_as(
            (0..3000)
                .map(|i| new_job("plain", None, json!({ "i": i })))
                .collect(),
            "test",
        )
        .await
        .unwrap();
    db.ledger.workflow(&chain("first", 3)).await.unwrap();
    sqlx::query("ANALYZE jobledger.jobs")
        .execute(&mut conn)
        .await
        .unwrap();
    let mut waiting: Vec<Uuid> = vec![];
    for w in 0..300 {
        let created = db.ledger.workflow(&chain(&format!("wf{w}"), 10)).await.unwrap();
        if w % 12 == 0 {
            waiting.extend(created.steps.iter().skip(1).take(2).map(|(_, s)| s.job.job_id));
        }
    }
    waiting.truncate(26);
    let plan = jobledger::store::workflows::explain_lock_waiting(&mut conn, &waiting)
        .await
        .unwrap();
    assert!(plan.contains("jobs_pkey"), "{plan}");
    assert!(
        !plan.contains("jobs_search_state"),
        "walks the waiting steps:\n{plan}"
    );
    conn.close().await.unwrap();
}
