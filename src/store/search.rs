//! Job search, newest first (by enqueue time, then id), cursor-paginated.
//!
//! Answered from indexes without a sequential scan or a sort of the whole
//! match: one `LATERAL` descent per state in an index led by (filter,
//! state, created_at, job_id) for queue, kind or reason (or (state,
//! created_at, job_id) without one), each stopping after `limit` rows,
//! merged; other filters are checked on those rows. Leased and
//! cancel-requested jobs are only in `jobs_search_leased` (state,
//! created_at, job_id), and queued jobs only in `jobs_search_queued`
//! (created_at, job_id), walked the same way with the filters checked on
//! the way (a claim and an enqueue enter one search index, not four). A key
//! names at most one job per queue and is looked up by the unique index
//! instead.

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

/// The statement for the filters present: only their predicates appear
/// (each filter set is its own prepared statement, planned for what it
/// asks), and every equality filter has an index led by it and the state:
/// queue, kind and reason (migrations 20261202000004 and ...06), except for
/// leased and cancel-requested jobs, which only `jobs_search_leased` holds
/// (state first; the filters are checked on its rows; ...20261206000002),
/// and queued jobs, which only `jobs_search_queued` holds (or `jobs_due`
/// for a queue's, sorted; ...20261208000001).
/// One branch per state with the state written out, so the planner can
/// use an index that covers only some states (the claim's, the terminal one).
fn search_sql(f: &JobFilter) -> String {
    let mut n = 6; // $1 states, $2 since, $3 until, $4/$5 the cursor, $6 limit
    let mut preds = String::new();
    for (col, present) in [
        ("queue", f.queue.is_some()),
        ("kind", f.kind.is_some()),
        ("reason", f.reason.is_some()),
    ] {
        if present {
            n += 1;
            preds.push_str(&format!(" AND {col} = ${n}"));
        }
    }
    let branches: Vec<String> = f
        .states
        .iter()
        // The ledger passes only known state names; anything else is dropped
        // here rather than written into SQL.
        .filter(|s| crate::domain::JobState::parse(s).is_some())
        .map(|state| {
            format!(
                "(SELECT {JOB_COLUMNS} FROM jobledger.jobs \
                  WHERE state = '{state}' AND state = ANY($1::text[]){preds} \
                    AND created_at >= coalesce($2, '-infinity') AND created_at < coalesce($3, 'infinity') \
                    AND (created_at, job_id) < ($4, $5) \
                  ORDER BY created_at DESC, job_id DESC LIMIT $6)"
            )
        })
        .collect();
    let union = if branches.is_empty() {
        format!("SELECT {JOB_COLUMNS} FROM jobledger.jobs WHERE false AND state = ANY($1::text[]) AND $2::timestamptz IS NULL AND $3::timestamptz IS NULL AND $4::timestamptz IS NULL AND $5::uuid IS NULL AND $6::int8 IS NULL{preds}")
    } else {
        branches.join(" UNION ALL ")
    };
    format!("SELECT * FROM ({union}) AS j ORDER BY j.created_at DESC, j.job_id DESC LIMIT $6")
}

type Q<'q, O> = sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>;

/// The parameters in the order `search_sql` numbers them.
fn bind_all<'q, O>(q: Q<'q, O>, f: &'q JobFilter, after: Option<After>, limit: i64) -> Q<'q, O> {
    let (at, id) = after.unwrap_or((DateTime::<Utc>::MAX_UTC, Uuid::max()));
    let mut q = q
        .bind(&f.states)
        .bind(f.since)
        .bind(f.until)
        .bind(at)
        .bind(id)
        .bind(limit);
    for v in [&f.queue, &f.kind, &f.reason].into_iter().flatten() {
        q = q.bind(v);
    }
    q
}

/// One page of jobs matching `f`, newest first, strictly after `after`.
pub async fn search_jobs<'e>(
    exec: impl PgExecutor<'e>,
    f: &JobFilter,
    after: Option<After>,
    limit: i64,
) -> StoreResult<Vec<JobRow>> {
    let sql = search_sql(f);
    Ok(bind_all(sqlx::query_as(&sql), f, after, limit)
        .fetch_all(exec)
        .await?)
}

/// The plan PostgreSQL picks for a search (what the tests and the bench
/// check for sequential scans and for the index used).
pub async fn explain_search<'e>(exec: impl PgExecutor<'e>, f: &JobFilter) -> StoreResult<String> {
    let sql = format!("EXPLAIN {}", search_sql(f));
    let rows: Vec<(String,)> = bind_all(sqlx::query_as(&sql), f, None, 50)
        .fetch_all(exec)
        .await?;
    Ok(rows.into_iter().map(|r| r.0).collect::<Vec<_>>().join("\n"))
}
