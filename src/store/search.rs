//! Job search, newest first (by enqueue time, then id), cursor-paginated.
//!
//! Answered from the indexes of migration 20261202000004 without a
//! sequential scan or a sort of the whole match: one `LATERAL` descent per
//! state in (queue, state, created_at, job_id) or (state, created_at,
//! job_id), each stopping after `limit` rows, merged. `kind` and `reason`
//! filter those descents. A key names at most one job per queue and is
//! looked up by the unique index instead.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;
use uuid::Uuid;

use super::rows::{JobRow, JOB_COLUMNS};
use super::StoreResult;

/// The filters of a search; absent means "any".
#[derive(Debug, Clone, Default)]
pub struct JobFilter {
    pub queue: Option<String>,
    /// The states to include (empty: every state).
    pub states: Vec<String>,
    pub kind: Option<String>,
    pub reason: Option<String>,
    /// Enqueued at or after.
    pub since: Option<DateTime<Utc>>,
    /// Enqueued before.
    pub until: Option<DateTime<Utc>>,
}

/// Strictly older than this (created_at, job_id): the previous page's last.
pub type After = (DateTime<Utc>, Uuid);

fn search_sql(by_queue: bool) -> String {
    // $7 is referenced in both forms so the parameters keep their numbers.
    let queue = if by_queue {
        "AND queue = $7"
    } else {
        "AND $7::text IS NOT NULL"
    };
    let cols = JOB_COLUMNS
        .split(", ")
        .map(|c| format!("j.{c}"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "SELECT {cols} FROM unnest($1::text[]) AS s(state) CROSS JOIN LATERAL ( \
           SELECT {JOB_COLUMNS} FROM jobledger.jobs \
           WHERE state = s.state {queue} \
             AND created_at >= coalesce($2, '-infinity') AND created_at < coalesce($3, 'infinity') \
             AND (created_at, job_id) < ($4, $5) \
             AND ($8::text IS NULL OR kind = $8) AND ($9::text IS NULL OR reason = $9) \
           ORDER BY created_at DESC, job_id DESC LIMIT $6) AS j \
         ORDER BY j.created_at DESC, j.job_id DESC LIMIT $6"
    )
}

/// One page of jobs matching `f`, newest first, strictly after `after`.
pub async fn search_jobs<'e>(
    exec: impl PgExecutor<'e>,
    f: &JobFilter,
    after: Option<After>,
    limit: i64,
) -> StoreResult<Vec<JobRow>> {
    let sql = search_sql(f.queue.is_some());
    let (at, id) = after.unwrap_or((DateTime::<Utc>::MAX_UTC, Uuid::max()));
    let mut q = sqlx::query_as(&sql)
        .bind(&f.states)
        .bind(f.since)
        .bind(f.until)
        .bind(at)
        .bind(id)
        .bind(limit);
    q = q.bind(f.queue.as_deref().unwrap_or(""));
    Ok(q.bind(&f.kind).bind(&f.reason).fetch_all(exec).await?)
}

/// The plan PostgreSQL picks for a search (what the tests and the bench
/// check for sequential scans).
pub async fn explain_search<'e>(exec: impl PgExecutor<'e>, f: &JobFilter) -> StoreResult<String> {
    let sql = format!("EXPLAIN {}", search_sql(f.queue.is_some()));
    let rows: Vec<(String,)> = sqlx::query_as(&sql)
        .bind(&f.states)
        .bind(f.since)
        .bind(f.until)
        .bind(DateTime::<Utc>::MAX_UTC)
        .bind(Uuid::max())
        .bind(50_i64)
        .bind(f.queue.as_deref().unwrap_or(""))
        .bind(&f.kind)
        .bind(&f.reason)
        .fetch_all(exec)
        .await?;
    Ok(rows.into_iter().map(|r| r.0).collect::<Vec<_>>().join("\n"))
}
