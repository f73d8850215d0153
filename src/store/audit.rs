//! Whole-log checks for an independent checker (`jobledger chaos`): each
//! answers the rows that break one invariant, so an empty answer is a pass.

use serde_json::Value;
use sqlx::PgExecutor;
use uuid::Uuid;

use super::StoreResult;

/// Jobs neither terminal nor explained: not succeeded, cancelled, dead or
/// awaiting a receipt, or dead without a reason code.
pub async fn unexplained_jobs<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(Uuid, String, String)>> {
    Ok(sqlx::query_as(
        "SELECT job_id, state, reason FROM jobledger.jobs \
         WHERE state NOT IN ('succeeded', 'cancelled', 'dead', 'awaiting_receipt') \
            OR (state = 'dead' AND coalesce(reason, '') = '') ORDER BY job_id",
    )
    .fetch_all(exec)
    .await?)
}

/// Jobs that entered `succeeded` more than once.
pub async fn double_successes<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(Uuid, i64)>> {
    Ok(sqlx::query_as(
        "SELECT job_id, count(*) FROM jobledger.events \
         WHERE to_state = 'succeeded' AND from_state IS DISTINCT FROM 'succeeded' \
         GROUP BY job_id HAVING count(*) > 1",
    )
    .fetch_all(exec)
    .await?)
}

/// Jobs whose versions are not exactly 1..n, or whose current row is not at
/// the last event's version.
pub async fn version_gaps<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT coalesce(j.job_id, e.job_id) FROM jobledger.jobs j \
         FULL JOIN (SELECT job_id, count(*) AS n, min(version) AS lo, max(version) AS hi \
                    FROM jobledger.events GROUP BY job_id) e ON e.job_id = j.job_id \
         WHERE e.job_id IS NULL OR e.lo <> 1 OR e.n <> e.hi \
            OR (j.job_id IS NOT NULL AND j.version <> e.hi)",
    )
    .fetch_all(exec)
    .await?)
}

/// State-changing events written with an older (epoch, token) than the
/// event before them: a write that should have been fenced out.
/// Observations are exempt: any worker may record one.
pub async fn token_regressions<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(Uuid, i64)>> {
    Ok(sqlx::query_as(
        "SELECT job_id, version FROM ( \
            SELECT job_id, version, type, epoch, token, \
                   max(epoch) OVER w AS max_epoch, \
                   max(token) FILTER (WHERE type <> 'observed') OVER w AS max_token \
            FROM jobledger.events WINDOW w AS (PARTITION BY job_id ORDER BY version \
                                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)) t \
         WHERE type <> 'observed' AND (epoch < max_epoch OR (epoch = max_epoch AND token < max_token))",
    )
    .fetch_all(exec)
    .await?)
}

/// Every job's key, state, epoch and result, with the token of the event
/// that made it succeed (if it did).
pub async fn outcomes<'e>(
    exec: impl PgExecutor<'e>,
) -> StoreResult<Vec<(Uuid, Option<String>, String, i64, Option<i64>, Option<Value>)>> {
    Ok(sqlx::query_as(
        "SELECT j.job_id, j.job_key, j.state, j.epoch, \
                (SELECT e.token FROM jobledger.events e WHERE e.job_id = j.job_id \
                   AND e.to_state = 'succeeded' ORDER BY e.version LIMIT 1), j.result \
         FROM jobledger.jobs j ORDER BY j.job_id",
    )
    .fetch_all(exec)
    .await?)
}

/// Jobs that recorded a failure with this code at least once.
pub async fn jobs_that_failed_with<'e>(exec: impl PgExecutor<'e>, code: &str) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT DISTINCT job_id FROM jobledger.events WHERE type = 'failed' AND data->>'code' = $1",
    )
    .bind(code)
    .fetch_all(exec)
    .await?)
}

/// Refused writes by outcome (stale, conflict, ...).
pub async fn rejections_by_outcome<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(String, i64)>> {
    Ok(
        sqlx::query_as(
            "SELECT outcome, count(*) FROM jobledger.rejections GROUP BY outcome ORDER BY outcome",
        )
        .fetch_all(exec)
        .await?,
    )
}

/// Events carrying this reason code.
pub async fn count_reason<'e>(exec: impl PgExecutor<'e>, reason: &str) -> StoreResult<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM jobledger.events WHERE reason = $1")
            .bind(reason)
            .fetch_one(exec)
            .await?,
    )
}
