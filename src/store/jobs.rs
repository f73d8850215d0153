//! Queries on `jobledger.jobs`, the inline projection and the fence.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::rows::{JobRow, JOB_COLUMNS};
use super::{StoreError, StoreResult};
use crate::domain::Job;

/// A locked row and the database clock read while holding its lock.
#[derive(Debug, sqlx::FromRow)]
pub struct Locked {
    #[sqlx(flatten)]
    pub row: JobRow,
    pub db_now: DateTime<Utc>,
}

/// Inserts new jobs; rows whose `(queue, job_key)` already exists are skipped.
/// Returns the ids actually inserted.
pub async fn insert_jobs(conn: &mut PgConnection, rows: &[JobRow]) -> StoreResult<Vec<Uuid>> {
    let sql = format!(
        "INSERT INTO jobledger.jobs ({JOB_COLUMNS}) \
         SELECT {JOB_COLUMNS} FROM jsonb_populate_recordset(NULL::jobledger.jobs, $1) \
         ON CONFLICT (queue, job_key) WHERE job_key IS NOT NULL DO NOTHING RETURNING job_id"
    );
    Ok(sqlx::query_scalar(&sql)
        .bind(serde_json::to_value(rows).expect("rows serialise"))
        .fetch_all(conn)
        .await?)
}

pub async fn find_job<'e>(exec: impl PgExecutor<'e>, job_id: Uuid) -> StoreResult<Option<JobRow>> {
    let sql = format!("SELECT {JOB_COLUMNS} FROM jobledger.jobs WHERE job_id = $1");
    Ok(sqlx::query_as(&sql).bind(job_id).fetch_optional(exec).await?)
}

pub async fn find_job_by_key<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
    key: &str,
) -> StoreResult<Option<JobRow>> {
    let sql = format!("SELECT {JOB_COLUMNS} FROM jobledger.jobs WHERE queue = $1 AND job_key = $2");
    Ok(sqlx::query_as(&sql)
        .bind(queue)
        .bind(key)
        .fetch_optional(exec)
        .await?)
}

/// Locks the rows (in id order, so two batches never deadlock) and reads the
/// database clock after the locks are granted.
pub async fn lock_jobs(conn: &mut PgConnection, ids: &[Uuid]) -> StoreResult<Vec<Locked>> {
    let sql = format!(
        "SELECT {JOB_COLUMNS}, clock_timestamp() AS db_now FROM jobledger.jobs \
         WHERE job_id = ANY($1) ORDER BY job_id FOR UPDATE"
    );
    Ok(sqlx::query_as(&sql).bind(ids).fetch_all(conn).await?)
}

/// Expired leases whose kind's policy is reconcile: a claim takes them over.
pub async fn lock_expired_for_takeover(
    conn: &mut PgConnection,
    queue: &str,
    limit: i64,
) -> StoreResult<Vec<Locked>> {
    let sql = format!(
        "SELECT {JOB_COLUMNS}, clock_timestamp() AS db_now FROM jobledger.jobs \
         WHERE queue = $1 AND state IN ('leased', 'cancel_requested') AND lease_until <= now() \
           AND policy ->> 'on_lease_expiry' = 'reconcile' \
         ORDER BY lease_until LIMIT $2 FOR UPDATE SKIP LOCKED"
    );
    Ok(sqlx::query_as(&sql)
        .bind(queue)
        .bind(limit)
        .fetch_all(conn)
        .await?)
}

/// Due queued jobs, highest priority (lowest number) first, then oldest.
pub async fn lock_due(conn: &mut PgConnection, queue: &str, limit: i64) -> StoreResult<Vec<Locked>> {
    let sql = format!(
        "SELECT {JOB_COLUMNS}, clock_timestamp() AS db_now FROM jobledger.jobs \
         WHERE queue = $1 AND state = 'queued' AND run_at <= now() \
         ORDER BY priority, run_at LIMIT $2 FOR UPDATE SKIP LOCKED"
    );
    Ok(sqlx::query_as(&sql)
        .bind(queue)
        .bind(limit)
        .fetch_all(conn)
        .await?)
}

/// What the sweeper acts on: expired leases under requeue/dead policies or on
/// their last attempt, and receipts past their deadline.
pub async fn lock_sweepable(conn: &mut PgConnection, limit: i64) -> StoreResult<Vec<Locked>> {
    let sql = format!(
        "SELECT {JOB_COLUMNS}, clock_timestamp() AS db_now FROM jobledger.jobs WHERE job_id IN ( \
           (SELECT job_id FROM jobledger.jobs WHERE state IN ('leased', 'cancel_requested') \
              AND lease_until <= now() \
              AND (policy ->> 'on_lease_expiry' <> 'reconcile' OR attempt >= (policy ->> 'max_attempts')::int) \
            LIMIT $1) \
           UNION ALL \
           (SELECT job_id FROM jobledger.jobs WHERE state = 'awaiting_receipt' AND receipt_deadline <= now() LIMIT $1)) \
         ORDER BY job_id FOR UPDATE SKIP LOCKED"
    );
    Ok(sqlx::query_as(&sql).bind(limit).fetch_all(conn).await?)
}

/// Writes the new projections of jobs whose rows this transaction holds
/// locked, each conditioned on the generation it was decided against
/// (job_id, epoch, token, state, version). Every row must match.
pub async fn update_jobs(conn: &mut PgConnection, prev: &[&Job], next: &[JobRow]) -> StoreResult<()> {
    let fences: Vec<_> = prev
        .iter()
        .map(|j| {
            serde_json::json!({"job_id": j.job_id, "epoch": j.epoch, "token": j.token,
                               "state": j.state.as_str(), "version": j.version})
        })
        .collect();
    let done = sqlx::query(
        "UPDATE jobledger.jobs j SET token = r.token, run = r.run, attempt = r.attempt, state = r.state, \
           run_at = r.run_at, lease_until = r.lease_until, holder = r.holder, next_action = r.next_action, \
           step = r.step, receipt_id = r.receipt_id, receipt_deadline = r.receipt_deadline, result = r.result, \
           release = r.release, last_error = r.last_error, reason = r.reason, updated_at = r.updated_at, \
           version = r.version, last_hash = r.last_hash \
         FROM jsonb_populate_recordset(NULL::jobledger.jobs, $1) r \
         JOIN jsonb_to_recordset($2) AS f(job_id uuid, epoch bigint, token bigint, state text, version bigint) \
           ON f.job_id = r.job_id \
         WHERE j.job_id = r.job_id AND j.epoch = f.epoch AND j.token = f.token AND j.state = f.state \
           AND j.version = f.version",
    )
    .bind(serde_json::to_value(next).expect("rows serialise"))
    .bind(serde_json::Value::Array(fences))
    .execute(conn)
    .await?;
    if done.rows_affected() != next.len() as u64 {
        return Err(StoreError::FenceRace(format!(
            "{} of {} locked rows matched their fence",
            done.rows_affected(),
            next.len()
        )));
    }
    Ok(())
}

pub async fn delete_jobs(conn: &mut PgConnection, ids: &[Uuid]) -> StoreResult<u64> {
    Ok(sqlx::query("DELETE FROM jobledger.jobs WHERE job_id = ANY($1)")
        .bind(ids)
        .execute(conn)
        .await?
        .rows_affected())
}

/// Dead jobs whose death reason is `reason` and that died within the range.
pub async fn dead_job_ids<'e>(
    exec: impl PgExecutor<'e>,
    reason: &str,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM jobledger.jobs WHERE state = 'dead' AND reason = $1 \
         AND updated_at >= $2 AND updated_at < $3 ORDER BY updated_at, job_id",
    )
    .bind(reason)
    .bind(since)
    .bind(until)
    .fetch_all(exec)
    .await?)
}

/// Terminal jobs that ended more than `older_than_ms` ago by the database clock.
pub async fn purgeable_job_ids<'e>(
    exec: impl PgExecutor<'e>,
    older_than_ms: i64,
    limit: i64,
) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM jobledger.jobs WHERE state IN ('succeeded', 'cancelled', 'dead') \
         AND updated_at < now() - make_interval(secs => $1::double precision / 1000) ORDER BY updated_at LIMIT $2",
    )
    .bind(older_than_ms)
    .bind(limit)
    .fetch_all(exec)
    .await?)
}

/// Job ids in id order after `after`, for paging through every job.
pub async fn job_ids_after<'e>(
    exec: impl PgExecutor<'e>,
    after: Option<Uuid>,
    limit: i64,
) -> StoreResult<Vec<JobRow>> {
    let sql = format!(
        "SELECT {JOB_COLUMNS} FROM jobledger.jobs WHERE $1::uuid IS NULL OR job_id > $1 ORDER BY job_id LIMIT $2"
    );
    Ok(sqlx::query_as(&sql)
        .bind(after)
        .bind(limit)
        .fetch_all(exec)
        .await?)
}

pub async fn count_by_state<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(String, i64)>> {
    Ok(
        sqlx::query_as("SELECT state, count(*) FROM jobledger.jobs GROUP BY state ORDER BY state")
            .fetch_all(exec)
            .await?,
    )
}

/// `n` fresh epochs from the never-cycling sequence, and the database clock.
pub async fn next_epochs(conn: &mut PgConnection, n: i64) -> StoreResult<(Vec<i64>, DateTime<Utc>)> {
    let rows: Vec<(i64, DateTime<Utc>)> = sqlx::query_as(
        "SELECT nextval('jobledger.epoch_seq'), clock_timestamp() FROM generate_series(1, $1::bigint)",
    )
    .bind(n)
    .fetch_all(conn)
    .await?;
    let now = rows.first().map(|r| r.1).unwrap_or_else(Utc::now);
    Ok((rows.into_iter().map(|r| r.0).collect(), now))
}

pub async fn jobs_by_ids<'e>(exec: impl PgExecutor<'e>, ids: &[Uuid]) -> StoreResult<Vec<JobRow>> {
    let sql = format!("SELECT {JOB_COLUMNS} FROM jobledger.jobs WHERE job_id = ANY($1)");
    Ok(sqlx::query_as(&sql).bind(ids).fetch_all(exec).await?)
}

/// Projection rows with no event at all: a row written around the log.
pub async fn orphan_job_ids<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM jobledger.jobs j WHERE NOT EXISTS \
         (SELECT 1 FROM jobledger.events e WHERE e.job_id = j.job_id)",
    )
    .fetch_all(exec)
    .await?)
}

pub async fn count_by_state_in_queue<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
) -> StoreResult<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT state, count(*) FROM jobledger.jobs WHERE queue = $1 GROUP BY state ORDER BY state",
    )
    .bind(queue)
    .fetch_all(exec)
    .await?)
}

/// Per queue, the age in seconds of the oldest job not yet in a terminal
/// state (the seeds' "oldest pending age").
pub async fn oldest_open_age<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(String, f64)>> {
    Ok(sqlx::query_as(
        "SELECT queue, extract(epoch FROM now() - min(created_at))::float8 FROM jobledger.jobs \
         WHERE state NOT IN ('succeeded', 'cancelled', 'dead') GROUP BY queue",
    )
    .fetch_all(exec)
    .await?)
}
