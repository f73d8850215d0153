//! Queries on `jobledger.kind_policies`.

use serde_json::Value;
use sqlx::PgExecutor;

use super::StoreResult;

/// Registers (or replaces) the policy of a (queue, kind).
pub async fn upsert_kind_policy<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
    kind: &str,
    policy: &Value,
) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO jobledger.kind_policies (queue, kind, policy) VALUES ($1, $2, $3) \
         ON CONFLICT (queue, kind) DO UPDATE SET policy = EXCLUDED.policy, updated_at = now()",
    )
    .bind(queue)
    .bind(kind)
    .bind(policy)
    .execute(exec)
    .await?;
    Ok(())
}
