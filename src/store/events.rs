//! Queries on `jobledger.events`, the append-only log.

use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::columns::{unnest, EventArrays, EVENT_TYPES};
use super::rows::{EventRow, EVENT_COLUMNS};
use super::StoreResult;

/// Appends events; returns `(job_id, version, position)` for each.
pub async fn insert_events(
    conn: &mut PgConnection,
    rows: Vec<EventRow>,
) -> StoreResult<Vec<(Uuid, i64, i64)>> {
    let sql = format!(
        "INSERT INTO jobledger.events ({EVENT_COLUMNS}) SELECT * FROM {} AS u({EVENT_COLUMNS}) \
         ORDER BY u.job_id, u.version RETURNING job_id, version, position",
        unnest(EVENT_TYPES, 1)
    );
    Ok(EventArrays::of(rows)
        .bind_all(sqlx::query_as(&sql))
        .fetch_all(conn)
        .await?)
}

/// Digest of the observation recorded under `key` for this job, if any.
pub async fn observation_digest<'e>(
    exec: impl PgExecutor<'e>,
    job_id: Uuid,
    key: &str,
) -> StoreResult<Option<String>> {
    Ok(sqlx::query_scalar(
        "SELECT data ->> 'digest' FROM jobledger.events WHERE job_id = $1 AND type = 'observed' AND data ->> 'key' = $2",
    )
    .bind(job_id)
    .bind(key)
    .fetch_optional(exec)
    .await?
    .flatten())
}

pub async fn job_events<'e>(exec: impl PgExecutor<'e>, job_id: Uuid) -> StoreResult<Vec<EventRow>> {
    let sql =
        format!("SELECT position, {EVENT_COLUMNS} FROM jobledger.events WHERE job_id = $1 ORDER BY version");
    Ok(sqlx::query_as(&sql).bind(job_id).fetch_all(exec).await?)
}

/// The events of several jobs (a workflow's steps), in log order.
pub async fn events_of<'e>(exec: impl PgExecutor<'e>, ids: &[Uuid]) -> StoreResult<Vec<EventRow>> {
    let sql = format!(
        "SELECT position, {EVENT_COLUMNS} FROM jobledger.events WHERE job_id = ANY($1) ORDER BY position"
    );
    Ok(sqlx::query_as(&sql).bind(ids).fetch_all(exec).await?)
}

/// All events of the next `limit_jobs` jobs (by id) after `after`, in
/// (job_id, version) order: verify's page.
pub async fn events_of_jobs_after<'e>(
    exec: impl PgExecutor<'e>,
    after: Option<Uuid>,
    limit_jobs: i64,
) -> StoreResult<Vec<EventRow>> {
    let sql = format!(
        "WITH ids AS (SELECT DISTINCT job_id FROM jobledger.events \
                      WHERE $1::uuid IS NULL OR job_id > $1 ORDER BY job_id LIMIT $2) \
         SELECT position, {EVENT_COLUMNS} FROM jobledger.events JOIN ids USING (job_id) ORDER BY job_id, version"
    );
    Ok(sqlx::query_as(&sql)
        .bind(after)
        .bind(limit_jobs)
        .fetch_all(exec)
        .await?)
}

/// The transactions that wrote `queue`'s events of type `kind`.
pub async fn count_transactions_in_queue<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
    kind: &str,
) -> StoreResult<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(DISTINCT e.txid) FROM jobledger.events e JOIN jobledger.jobs j USING (job_id) \
         WHERE j.queue = $1 AND e.type = $2",
    )
    .bind(queue)
    .bind(kind)
    .fetch_one(exec)
    .await?)
}

/// How many events of `kind` the jobs of `queue` have (purged jobs excluded).
pub async fn count_events_in_queue<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
    kind: &str,
) -> StoreResult<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM jobledger.events e JOIN jobledger.jobs j USING (job_id) \
         WHERE j.queue = $1 AND e.type = $2",
    )
    .bind(queue)
    .bind(kind)
    .fetch_one(exec)
    .await?)
}

/// Jobs of `queue` that have at least one event of `kind`.
pub async fn jobs_with_event_in_queue<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
    kind: &str,
) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT DISTINCT e.job_id FROM jobledger.events e JOIN jobledger.jobs j USING (job_id) \
         WHERE j.queue = $1 AND e.type = $2",
    )
    .bind(queue)
    .bind(kind)
    .fetch_all(exec)
    .await?)
}

/// Events in the log (an estimate is not enough for the bench's labels).
pub async fn count_events<'e>(exec: impl PgExecutor<'e>) -> StoreResult<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM jobledger.events")
        .fetch_one(exec)
        .await?)
}

/// `(job_id, version, hash)` of every event (the audit-log check).
pub async fn all_hashes<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(Uuid, i64, String)>> {
    Ok(
        sqlx::query_as("SELECT job_id, version, hash FROM jobledger.events")
            .fetch_all(exec)
            .await?,
    )
}

/// Events with `from <= position <= to` (of one job, if given), in position
/// order, after position `after`: a page of `replay-log`.
pub async fn events_between<'e>(
    exec: impl PgExecutor<'e>,
    from: i64,
    to: i64,
    job: Option<Uuid>,
    after: i64,
    limit: i64,
) -> StoreResult<Vec<EventRow>> {
    let sql = format!(
        "SELECT position, {EVENT_COLUMNS} FROM jobledger.events \
         WHERE position BETWEEN $1 AND $2 AND position > $4 AND ($3::uuid IS NULL OR job_id = $3) \
         ORDER BY position LIMIT $5"
    );
    Ok(sqlx::query_as(&sql)
        .bind(from)
        .bind(to)
        .bind(job)
        .bind(after)
        .bind(limit)
        .fetch_all(exec)
        .await?)
}

/// `(job_id, version)` of the event at `position`, if there is one.
pub async fn event_at<'e>(exec: impl PgExecutor<'e>, position: i64) -> StoreResult<Option<(Uuid, i64)>> {
    Ok(
        sqlx::query_as("SELECT job_id, version FROM jobledger.events WHERE position = $1")
            .bind(position)
            .fetch_optional(exec)
            .await?,
    )
}

/// The writing transaction of the event at `position` (for minimum-position reads).
pub async fn txid_of_position<'e>(exec: impl PgExecutor<'e>, position: i64) -> StoreResult<Option<i64>> {
    Ok(
        sqlx::query_scalar("SELECT txid::text::bigint FROM jobledger.events WHERE position = $1")
            .bind(position)
            .fetch_optional(exec)
            .await?,
    )
}

/// `(position, txid)` of the events at `positions` (a job page's delivery
/// state compares them with the relays' checkpoints).
pub async fn txids_at<'e>(exec: impl PgExecutor<'e>, positions: &[i64]) -> StoreResult<Vec<(i64, i64)>> {
    Ok(
        sqlx::query_as("SELECT position, txid::text::bigint FROM jobledger.events WHERE position = ANY($1)")
            .bind(positions)
            .fetch_all(exec)
            .await?,
    )
}

/// Rows of a projection's view as JSON (optionally one job's), for `projections query`.
pub async fn projection_rows<'e>(
    exec: impl PgExecutor<'e>,
    view: &str,
    job: Option<Uuid>,
) -> StoreResult<Vec<serde_json::Value>> {
    let quoted = format!("jobledger_proj.\"{}\"", view.replace('"', "\"\""));
    // `workflows` answers a whole tree for the parent's id.
    let column = if view == "workflows" {
        "workflow_id"
    } else {
        "job_id"
    };
    let sql = match job {
        Some(_) => format!("SELECT to_jsonb(v) FROM {quoted} v WHERE v.{column} = $1 ORDER BY 1 LIMIT 10000"),
        None => format!("SELECT to_jsonb(v) FROM {quoted} v ORDER BY 1 LIMIT 10000"),
    };
    let q = sqlx::query_scalar(&sql);
    let q = match job {
        Some(j) => q.bind(j),
        None => q,
    };
    Ok(q.fetch_all(exec).await?)
}
