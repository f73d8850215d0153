//! Queries that follow a workflow's ties: its steps, and the states of a
//! step's prerequisites.

use sqlx::PgExecutor;
use uuid::Uuid;

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
