//! Session-level advisory locks (one active sweeper, one active relay).

use sqlx::PgConnection;

use super::StoreResult;

pub async fn try_advisory_lock(conn: &mut PgConnection, key: i64) -> StoreResult<bool> {
    Ok(sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(key)
        .fetch_one(conn)
        .await?)
}

pub async fn advisory_unlock(conn: &mut PgConnection, key: i64) -> StoreResult<bool> {
    Ok(sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
        .bind(key)
        .fetch_one(conn)
        .await?)
}
