//! Queries that follow a workflow's ties: its steps, and the states of a
//! step's prerequisites.

use sqlx::PgExecutor;
use uuid::Uuid;

use sqlx::PgConnection;

use super::jobs::Locked;
use super::rows::{JobRow, JOB_COLUMNS};
use super::StoreResult;

/// Every step of `parent` still in the projection, by step name.
pub async fn steps_of<'e>(exec: impl PgExecutor<'e>, parent: Uuid) -> StoreResult<Vec<JobRow>> {
    let sql = format!(
        "SELECT {JOB_COLUMNS} FROM jobledger.jobs \
         WHERE workflow ->> 'role' = 'step' AND workflow ->> 'parent' = $1 \
         ORDER BY workflow ->> 'step'"
    );
    Ok(sqlx::query_as(&sql)
        .bind(parent.to_string())
        .fetch_all(exec)
        .await?)
}

/// The state of each job in `ids`, from the projection or, for a purged
/// one, from its tombstone (a prerequisite may be purged while a step
/// still waits for it).
pub async fn states_of<'e>(exec: impl PgExecutor<'e>, ids: &[Uuid]) -> StoreResult<Vec<(Uuid, String)>> {
    Ok(sqlx::query_as(
        "SELECT job_id, state FROM jobledger.jobs WHERE job_id = ANY($1) \
         UNION ALL SELECT job_id, state FROM jobledger.tombstones WHERE job_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(exec)
    .await?)
}

/// The parent of a job that is a waiting workflow step (read without a
/// lock: a waiting step only leaves `waiting` under its parent's lock).
pub async fn parent_of_waiting<'e>(exec: impl PgExecutor<'e>, job_id: Uuid) -> StoreResult<Option<Uuid>> {
    let parent: Option<Option<String>> = sqlx::query_scalar(
        "SELECT workflow ->> 'parent' FROM jobledger.jobs \
         WHERE job_id = $1 AND state = 'waiting' AND workflow ->> 'role' = 'step'",
    )
    .bind(job_id)
    .fetch_optional(exec)
    .await?;
    Ok(parent.flatten().and_then(|p| Uuid::parse_str(&p).ok()))
}

/// `verify`: a parent's `step_finished` / `step_reopened` event whose step
/// has no event at the named version with that end (or that reopening).
/// `(parent, version, position, detail)`; one job's only when `job` is set.
pub async fn counts_without_step_edge<'e>(
    exec: impl PgExecutor<'e>,
    job: Option<Uuid>,
) -> StoreResult<Vec<(Uuid, i64, i64, String)>> {
    Ok(sqlx::query_as(
        "SELECT p.job_id, p.version, p.position, \
                format('counts step %s (%s) v%s as %s, its log says %s', p.data ->> 'step', p.data ->> 'job_id', \
                       p.data ->> 'version', coalesce(p.data ->> 'status', 'reopened'), \
                       coalesce(s.type || ' to ' || s.to_state, 'nothing')) \
         FROM jobledger.events p \
         LEFT JOIN jobledger.events s ON s.job_id = (p.data ->> 'job_id')::uuid \
                                     AND s.version = (p.data ->> 'version')::bigint \
         WHERE p.type IN ('step_finished', 'step_reopened') AND ($1::uuid IS NULL OR p.job_id = $1) \
           AND (s.job_id IS NULL \
                OR (p.type = 'step_finished' AND s.to_state IS DISTINCT FROM p.data ->> 'status') \
                OR (p.type = 'step_reopened' AND s.from_state IS DISTINCT FROM p.data ->> 'previous'))",
    )
    .bind(job)
    .fetch_all(exec)
    .await?)
}

/// `verify`: a step's end (or reopening) its parent never counted.
/// `(step, version, position, detail)`.
pub async fn step_edges_not_counted<'e>(
    exec: impl PgExecutor<'e>,
    job: Option<Uuid>,
) -> StoreResult<Vec<(Uuid, i64, i64, String)>> {
    Ok(sqlx::query_as(
        "SELECT s.job_id, s.version, s.position, \
                format('%s to %s is not counted by workflow %s', s.type, s.to_state, \
                       first.data -> 'workflow' ->> 'parent') \
         FROM jobledger.events s \
         JOIN jobledger.events first ON first.job_id = s.job_id AND first.version = 1 \
                                    AND first.data -> 'workflow' ->> 'role' = 'step' \
         WHERE ($1::uuid IS NULL OR s.job_id = $1 OR (first.data -> 'workflow' ->> 'parent')::uuid = $1) \
           AND ((s.to_state IN ('succeeded', 'cancelled', 'dead') \
                 AND s.from_state NOT IN ('succeeded', 'cancelled', 'dead')) \
                OR (s.from_state IN ('succeeded', 'cancelled', 'dead') \
                    AND s.to_state NOT IN ('succeeded', 'cancelled', 'dead'))) \
           AND NOT EXISTS (SELECT 1 FROM jobledger.events p \
                           WHERE p.job_id = (first.data -> 'workflow' ->> 'parent')::uuid \
                             AND p.type IN ('step_finished', 'step_reopened') \
                             AND p.data ->> 'job_id' = s.job_id::text \
                             AND (p.data ->> 'version')::bigint = s.version)",
    )
    .bind(job)
    .fetch_all(exec)
    .await?)
}

/// Locks the rows of `ids` that are `waiting` (in id order). A dependent
/// already released may be held by its worker, which locks it and then the
/// parent: this transaction holds the parent, so it must not wait for it.
pub async fn lock_waiting(conn: &mut PgConnection, ids: &[Uuid]) -> StoreResult<Vec<Locked>> {
    Ok(sqlx::query_as(&lock_waiting_sql())
        .bind(ids)
        .fetch_all(conn)
        .await?)
}

/// The state test is written so that no index can serve it: with `state =
/// 'waiting'` the planner, whose statistics lag behind a burst of new
/// workflows, combined the primary key with the search index on `state`
/// and walked every waiting step of the database for each call (1.9 ms
/// for 26 rows during the workflow bench, 0.7 ms by the key alone).
fn lock_waiting_sql() -> String {
    super::jobs::clock_after_locks(&format!(
        "SELECT {JOB_COLUMNS} FROM jobledger.jobs \
         WHERE job_id = ANY($1) AND (state = 'waiting') IS TRUE ORDER BY job_id FOR UPDATE"
    ))
}

/// The plan of `lock_waiting` for `ids` (the test that keeps it on the key).
pub async fn explain_lock_waiting<'e>(exec: impl PgExecutor<'e>, ids: &[Uuid]) -> StoreResult<String> {
    let rows: Vec<(String,)> = sqlx::query_as(&format!("EXPLAIN {}", lock_waiting_sql()))
        .bind(ids)
        .fetch_all(exec)
        .await?;
    Ok(rows.into_iter().map(|r| r.0).collect::<Vec<_>>().join("\n"))
}

/// Every step a parent's first event lists (the fan-in too): `(job_id,
/// step)`, whether or not the step's row still exists.
pub async fn members_of<'e>(exec: impl PgExecutor<'e>, parent: Uuid) -> StoreResult<Vec<(Uuid, String)>> {
    Ok(sqlx::query_as(
        "SELECT (s ->> 'job_id')::uuid, s ->> 'step' FROM jobledger.events e \
         CROSS JOIN LATERAL jsonb_array_elements(e.data -> 'workflow' -> 'steps' \
             || CASE WHEN e.data -> 'workflow' ? 'fan_in' THEN jsonb_build_array(e.data -> 'workflow' -> 'fan_in') \
                     ELSE '[]'::jsonb END) s \
         WHERE e.job_id = $1 AND e.version = 1 AND e.data -> 'workflow' ->> 'role' = 'parent'",
    )
    .bind(parent)
    .fetch_all(exec)
    .await?)
}

/// `(job_id, state, reason)` of each job in `ids`: live, or for a purged
/// one its state and the reason of its last event before the purge.
pub async fn ends_of<'e>(
    exec: impl PgExecutor<'e>,
    ids: &[Uuid],
) -> StoreResult<Vec<(Uuid, String, String)>> {
    Ok(sqlx::query_as(
        "SELECT job_id, state, reason FROM jobledger.jobs WHERE job_id = ANY($1) \
         UNION ALL SELECT t.job_id, t.state, e.reason FROM jobledger.tombstones t \
         JOIN jobledger.events e ON e.job_id = t.job_id AND e.version = t.version - 1 \
         WHERE t.job_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(exec)
    .await?)
}

/// Whether the job's workflow parent was purged (its steps then belong to
/// nobody who could count them).
pub async fn parent_purged<'e>(exec: impl PgExecutor<'e>, job_id: Uuid) -> StoreResult<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM jobledger.jobs j JOIN jobledger.tombstones t \
                        ON t.job_id = (j.workflow ->> 'parent')::uuid \
                        WHERE j.job_id = $1 AND j.workflow ->> 'role' = 'step')",
    )
    .bind(job_id)
    .fetch_one(exec)
    .await?)
}

/// `verify`: a step edge its parent counts twice, or a count that names a
/// job which is no step of that parent. `(parent, version, position, detail)`.
pub async fn counts_twice_or_foreign<'e>(
    exec: impl PgExecutor<'e>,
    job: Option<Uuid>,
) -> StoreResult<Vec<(Uuid, i64, i64, String)>> {
    Ok(sqlx::query_as(
        "SELECT p.job_id, p.version, p.position, \
                CASE WHEN (first.data -> 'workflow' ->> 'parent') IS DISTINCT FROM p.job_id::text \
                     THEN format('counts job %s, which is no step of this workflow', p.data ->> 'job_id') \
                     ELSE format('counts step %s v%s a second time', p.data ->> 'step', p.data ->> 'version') END \
         FROM jobledger.events p \
         LEFT JOIN jobledger.events first ON first.job_id = (p.data ->> 'job_id')::uuid AND first.version = 1 \
         WHERE p.type IN ('step_finished', 'step_reopened') AND ($1::uuid IS NULL OR p.job_id = $1) \
           AND ((first.data -> 'workflow' ->> 'parent') IS DISTINCT FROM p.job_id::text \
                OR EXISTS (SELECT 1 FROM jobledger.events q WHERE q.job_id = p.job_id AND q.version < p.version \
                             AND q.type = p.type AND q.data ->> 'job_id' = p.data ->> 'job_id' \
                             AND q.data ->> 'version' = p.data ->> 'version'))",
    )
    .bind(job)
    .fetch_all(exec)
    .await?)
}

/// Jobs already holding any of the `(queue, key)` pairs: `(queue, key, job_id)`.
pub async fn jobs_holding_keys<'e>(
    exec: impl PgExecutor<'e>,
    queues: &[String],
    keys: &[String],
) -> StoreResult<Vec<(String, String, Uuid)>> {
    Ok(sqlx::query_as(
        "SELECT j.queue, j.job_key, j.job_id FROM jobledger.jobs j \
         JOIN UNNEST($1::text[], $2::text[]) AS k(queue, job_key) ON j.queue = k.queue AND j.job_key = k.job_key \
         ORDER BY 1, 2",
    )
    .bind(queues)
    .bind(keys)
    .fetch_all(exec)
    .await?)
}
