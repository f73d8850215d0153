//! The figures of the console's overview page.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::StoreResult;

/// Per minute of the last `minutes`, events by type (claims, successes,
/// failures, takeovers...): the throughput line of the overview.
pub async fn events_per_minute<'e>(
    exec: impl PgExecutor<'e>,
    minutes: i32,
) -> StoreResult<Vec<(DateTime<Utc>, String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT date_trunc('minute', recorded_at), type, count(*) FROM jobledger.events \
         WHERE recorded_at > now() - make_interval(mins => $1) GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .bind(minutes)
    .fetch_all(exec)
    .await?)
}

/// Refused writes of the last `minutes`, by outcome (stale, conflict, ...).
pub async fn refusals_since<'e>(exec: impl PgExecutor<'e>, minutes: i32) -> StoreResult<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT outcome, count(*) FROM jobledger.rejections \
         WHERE recorded_at > now() - make_interval(mins => $1) GROUP BY 1 ORDER BY 1",
    )
    .bind(minutes)
    .fetch_all(exec)
    .await?)
}

/// Dead jobs by the reason code they died with.
pub async fn dead_by_reason<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT reason, count(*) FROM jobledger.jobs WHERE state = 'dead' GROUP BY 1 ORDER BY 2 DESC, 1",
    )
    .fetch_all(exec)
    .await?)
}
