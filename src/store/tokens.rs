//! Bearer tokens of the HTTP API: stored as SHA-256 hashes, revocable.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::StoreResult;

#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
pub struct TokenRow {
    pub name: String,
    pub role: String,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// Inserts a token; `false` when the name is taken.
pub async fn insert_token<'e>(
    exec: impl PgExecutor<'e>,
    name: &str,
    role: &str,
    hash: &str,
) -> StoreResult<bool> {
    let n = sqlx::query(
        "INSERT INTO jobledger.api_tokens (name, role, token_hash) VALUES ($1, $2, $3) ON CONFLICT (name) DO NOTHING",
    )
    .bind(name)
    .bind(role)
    .bind(hash)
    .execute(exec)
    .await?
    .rows_affected();
    Ok(n == 1)
}

/// `(name, role)` of the live token with this hash.
pub async fn live_token<'e>(exec: impl PgExecutor<'e>, hash: &str) -> StoreResult<Option<(String, String)>> {
    Ok(sqlx::query_as(
        "SELECT name, role FROM jobledger.api_tokens WHERE token_hash = $1 AND revoked_at IS NULL",
    )
    .bind(hash)
    .fetch_optional(exec)
    .await?)
}

/// Revokes the named token; `false` when there is no live token by that name.
pub async fn revoke_token<'e>(exec: impl PgExecutor<'e>, name: &str) -> StoreResult<bool> {
    let n = sqlx::query(
        "UPDATE jobledger.api_tokens SET revoked_at = clock_timestamp() WHERE name = $1 AND revoked_at IS NULL",
    )
    .bind(name)
    .execute(exec)
    .await?
    .rows_affected();
    Ok(n == 1)
}

pub async fn list_tokens<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<TokenRow>> {
    Ok(
        sqlx::query_as("SELECT name, role, created_at, revoked_at FROM jobledger.api_tokens ORDER BY name")
            .fetch_all(exec)
            .await?,
    )
}
