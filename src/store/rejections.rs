//! Queries on `jobledger.rejections`, the record of refused writes.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgExecutor;
use uuid::Uuid;

use super::StoreResult;

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct RejectionRow {
    pub job_id: Uuid,
    pub command: String,
    pub outcome: String,
    pub epoch: Option<i64>,
    pub token: Option<i64>,
    pub actor: String,
    pub detail: String,
    pub recorded_at: DateTime<Utc>,
}

pub async fn insert_rejection<'e>(exec: impl PgExecutor<'e>, r: &RejectionRow) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO jobledger.rejections (job_id, command, outcome, epoch, token, actor, detail) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(r.job_id)
    .bind(&r.command)
    .bind(&r.outcome)
    .bind(r.epoch)
    .bind(r.token)
    .bind(&r.actor)
    .bind(&r.detail)
    .execute(exec)
    .await?;
    Ok(())
}

pub async fn job_rejections<'e>(exec: impl PgExecutor<'e>, job_id: Uuid) -> StoreResult<Vec<RejectionRow>> {
    Ok(sqlx::query_as(
        "SELECT job_id, command, outcome, epoch, token, actor, detail, recorded_at \
         FROM jobledger.rejections WHERE job_id = $1 ORDER BY id",
    )
    .bind(job_id)
    .fetch_all(exec)
    .await?)
}

/// The refused writes of several jobs (a workflow's steps), oldest first.
pub async fn rejections_of<'e>(exec: impl PgExecutor<'e>, ids: &[Uuid]) -> StoreResult<Vec<RejectionRow>> {
    Ok(sqlx::query_as(
        "SELECT job_id, command, outcome, epoch, token, actor, detail, recorded_at \
         FROM jobledger.rejections WHERE job_id = ANY($1) ORDER BY id",
    )
    .bind(ids)
    .fetch_all(exec)
    .await?)
}
