//! Queries on `jobledger.tombstones`.

use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::rows::TombstoneRow;
use super::StoreResult;

const COLUMNS: &str = "job_id, queue, job_key, epoch, token, state, version, last_hash, release, purged_at";

pub async fn insert_tombstones(conn: &mut PgConnection, rows: &[TombstoneRow]) -> StoreResult<u64> {
    let sql = format!(
        "INSERT INTO jobledger.tombstones ({COLUMNS}) \
         SELECT {COLUMNS} FROM jsonb_populate_recordset(NULL::jobledger.tombstones, $1)"
    );
    Ok(sqlx::query(&sql)
        .bind(serde_json::to_value(rows).expect("rows serialise"))
        .execute(conn)
        .await?
        .rows_affected())
}

pub async fn find_tombstone<'e>(
    exec: impl PgExecutor<'e>,
    job_id: Uuid,
) -> StoreResult<Option<TombstoneRow>> {
    let sql = format!("SELECT {COLUMNS} FROM jobledger.tombstones WHERE job_id = $1");
    Ok(sqlx::query_as(&sql).bind(job_id).fetch_optional(exec).await?)
}

pub async fn tombstones_by_ids<'e>(
    exec: impl PgExecutor<'e>,
    ids: &[Uuid],
) -> StoreResult<Vec<TombstoneRow>> {
    let sql = format!("SELECT {COLUMNS} FROM jobledger.tombstones WHERE job_id = ANY($1)");
    Ok(sqlx::query_as(&sql).bind(ids).fetch_all(exec).await?)
}

/// Tombstones of jobs with no event at all: written around the log.
pub async fn orphan_tombstone_ids<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM jobledger.tombstones t WHERE NOT EXISTS \
         (SELECT 1 FROM jobledger.events e WHERE e.job_id = t.job_id)",
    )
    .fetch_all(exec)
    .await?)
}
