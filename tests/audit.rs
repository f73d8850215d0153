//! The chaos checker's whole-log checks (`store::audit`): silent on an
//! honest log, and each finds the violation it is named after when history
//! is forged around the database's guards (superuser, triggers off).

mod common;

use common::fresh;
use jobledger::store::audit;
use serde_json::json;
use uuid::Uuid;

async fn succeeded_job(db: &common::TestDb, key: &str) -> Uuid {
    let job = db.enqueue(Some(key), json!({"amount": 5})).await;
    let lease = db.claim_one("w").await;
    assert!(lease
        .complete(Some(json!({"refund_id": "re_1"})))
        .await
        .unwrap()
        .committed());
    job.job_id
}

async fn forge(db: &common::TestDb, sql: &str, job: Uuid) {
    let mut conn = db.conn().await;
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(sql).bind(job).execute(&mut conn).await.unwrap();
}

/// A copy of the job's last event under a new version, with changes.
fn copy_last(changes: &str) -> String {
    format!(
        "INSERT INTO jobledger.events (job_id, version, type, from_state, to_state, reason, error_class, actor, \
           epoch, token, attempt, run, data, recorded_at, prev_hash, hash) \
         SELECT job_id, version + 1, type, from_state, to_state, reason, error_class, actor, epoch, token, attempt, \
           run, data, recorded_at, hash, 'forged' FROM jobledger.events WHERE job_id = $1 \
           AND version = (SELECT max(version) FROM jobledger.events WHERE job_id = $1); \
         UPDATE jobledger.events SET {changes} WHERE job_id = $1 AND hash = 'forged'"
    )
}

#[tokio::test]
async fn an_honest_log_passes_every_check() {
    let db = fresh().await;
    let a = succeeded_job(&db, "a").await;
    let _b = succeeded_job(&db, "b").await;
    db.ledger
        .cancel(db.enqueue(Some("c"), json!({})).await.job_id, None)
        .await
        .unwrap();
    let pool = db.ledger.pool();
    assert!(audit::unexplained_jobs(pool).await.unwrap().is_empty());
    assert!(audit::double_successes(pool).await.unwrap().is_empty());
    assert!(audit::version_gaps(pool).await.unwrap().is_empty());
    assert!(audit::token_regressions(pool).await.unwrap().is_empty());
    let outcomes = audit::outcomes(pool).await.unwrap();
    let (_, key, state, _, token, result) = outcomes.iter().find(|o| o.0 == a).unwrap();
    assert_eq!(
        (key.as_deref(), state.as_str(), *token),
        (Some("a"), "succeeded", Some(1))
    );
    assert_eq!(result.as_ref().unwrap()["refund_id"], "re_1");
    assert_eq!(
        audit::count_reason(pool, "lease_expired_takeover").await.unwrap(),
        0
    );
}

#[tokio::test]
async fn a_second_success_is_found() {
    let db = fresh().await;
    let a = succeeded_job(&db, "a").await;
    // Looks like leased → succeeded again.
    let sql = copy_last("from_state = 'leased'");
    for stmt in sql.split("; ") {
        forge(&db, stmt, a).await;
    }
    let found = audit::double_successes(db.ledger.pool()).await.unwrap();
    assert_eq!(found, vec![(a, 2)]);
    // The jobs row was not moved along: a version gap to the current row too.
    assert_eq!(audit::version_gaps(db.ledger.pool()).await.unwrap(), vec![a]);
}

#[tokio::test]
async fn an_older_token_writing_after_a_newer_one_is_found() {
    let db = fresh().await;
    let a = succeeded_job(&db, "a").await;
    for stmt in copy_last("token = 0, type = 'failed', from_state = 'succeeded'").split("; ") {
        forge(&db, stmt, a).await;
    }
    let found = audit::token_regressions(db.ledger.pool()).await.unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].0, a);
    // The same forged row as an observation is allowed: any worker may observe.
    forge(
        &db,
        "UPDATE jobledger.events SET type = 'observed' WHERE job_id = $1 AND hash = 'forged'",
        a,
    )
    .await;
    assert!(audit::token_regressions(db.ledger.pool())
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn a_missing_version_and_an_unexplained_job_are_found() {
    let db = fresh().await;
    let a = succeeded_job(&db, "a").await;
    forge(
        &db,
        "DELETE FROM jobledger.events WHERE job_id = $1 AND version = 2",
        a,
    )
    .await;
    assert_eq!(audit::version_gaps(db.ledger.pool()).await.unwrap(), vec![a]);
    let b = db.enqueue(Some("b"), json!({})).await.job_id;
    let unexplained = audit::unexplained_jobs(db.ledger.pool()).await.unwrap();
    assert_eq!(
        unexplained.iter().map(|u| u.0).collect::<Vec<_>>(),
        vec![b],
        "a queued job is not settled"
    );
    let failed = audit::jobs_that_failed_with(db.ledger.pool(), "provider_no_answer")
        .await
        .unwrap();
    assert!(failed.is_empty());
}

/// The workflow checks: silent on an honest workflow; a parent whose state
/// is not the rule table over its steps, and a step claimed before its
/// prerequisite succeeded, are each found.
#[tokio::test]
async fn the_workflow_checks_find_a_parent_off_the_table_and_a_step_run_early() {
    use common::workflows::{finish_next, id_of, seed};
    use jobledger::domain::workflow::DependencyPolicy;
    let db = fresh().await;
    let created = db
        .ledger
        .workflow(&seed("audit", DependencyPolicy::Cancel))
        .await
        .unwrap();
    finish_next(&db, "render", true).await;
    let pool = db.ledger.pool();
    assert!(audit::parents_off_the_rule_table(pool).await.unwrap().is_empty());
    assert!(audit::steps_run_before_prerequisites(pool)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(audit::workflow_counts(pool).await.unwrap(), (1, 3));
    assert!(audit::outcomes(pool)
        .await
        .unwrap()
        .iter()
        .all(|o| o.0 != created.parent.job.job_id));

    let parent = created.parent.job.job_id;
    forge(
        &db,
        "UPDATE jobledger.jobs SET state = 'succeeded' WHERE job_id = $1",
        parent,
    )
    .await;
    let off = audit::parents_off_the_rule_table(pool).await.unwrap();
    assert_eq!(
        off,
        vec![(parent, "succeeded".to_string(), "running".to_string())]
    );

    // publish claimed although review (its prerequisite) never succeeded.
    let publish = id_of(&created, "publish");
    for stmt in copy_last("type = 'claimed'").split("; ") {
        forge(&db, stmt, publish).await;
    }
    let early = audit::steps_run_before_prerequisites(pool).await.unwrap();
    assert_eq!(early, vec![(publish, "review".to_string())]);
}
