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
    Ok(sqlx::query_as(&sql).bind(parent.to_string()).fetch_all(exec).await?)
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
