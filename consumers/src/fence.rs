//! The consumer's fence and dead letters: one named function per query.

use sqlx::PgConnection;

/// Raises the fence of (group, key) to the event's generation if it is
/// higher; returns whether it did.
pub async fn raise(
    conn: &mut PgConnection,
    group: &str,
    key: &str,
    gen: (i64, i64, i64),
    job_id: Option<uuid::Uuid>,
) -> Result<bool, sqlx::Error> {
    let applied: Option<i32> = sqlx::query_scalar(
        "INSERT INTO jobledger_consumer.fences (grp, key, epoch, token, version, job_id) VALUES ($1, $2, $3, $4, $5, $6) \
         ON CONFLICT (grp, key) DO UPDATE SET epoch = EXCLUDED.epoch, token = EXCLUDED.token, \
           version = EXCLUDED.version, job_id = EXCLUDED.job_id, updated_at = now() \
         WHERE (fences.epoch, fences.token, fences.version) < (EXCLUDED.epoch, EXCLUDED.token, EXCLUDED.version) \
         RETURNING 1",
    )
    .bind(group)
    .bind(key)
    .bind(gen.0)
    .bind(gen.1)
    .bind(gen.2)
    .bind(job_id)
    .fetch_optional(conn)
    .await?;
    Ok(applied.is_some())
}

/// The generation the fence holds for (group, key).
pub async fn current(
    conn: &mut PgConnection,
    group: &str,
    key: &str,
) -> Result<Option<(i64, i64, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT epoch, token, version FROM jobledger_consumer.fences WHERE grp = $1 AND key = $2")
        .bind(group)
        .bind(key)
        .fetch_optional(conn)
        .await
}

/// Moves (group, topic, partition) past `offset` unless something already
/// did; returns whether this call moved it. A message whose offset is
/// already passed was applied before (a redelivery after a crash or a
/// second instance): the caller rolls back.
pub async fn pass_offset(
    conn: &mut PgConnection,
    group: &str,
    topic: &str,
    partition: i32,
    offset: i64,
) -> Result<bool, sqlx::Error> {
    let moved: Option<i32> = sqlx::query_scalar(
        "INSERT INTO jobledger_consumer.offsets (grp, topic, partition, next_offset) VALUES ($1, $2, $3, $4 + 1) \
         ON CONFLICT (grp, topic, partition) DO UPDATE SET next_offset = EXCLUDED.next_offset, updated_at = now() \
         WHERE offsets.next_offset <= $4 RETURNING 1",
    )
    .bind(group)
    .bind(topic)
    .bind(partition)
    .bind(offset)
    .fetch_optional(conn)
    .await?;
    Ok(moved.is_some())
}

/// The next offset to apply, per partition, for (group, topic).
pub async fn offsets(pool: &sqlx::PgPool, group: &str, topic: &str) -> Result<Vec<(i32, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT partition, next_offset FROM jobledger_consumer.offsets WHERE grp = $1 AND topic = $2",
    )
    .bind(group)
    .bind(topic)
    .fetch_all(pool)
    .await
}

#[allow(clippy::too_many_arguments)]
pub async fn dead_letter(
    conn: &mut PgConnection,
    group: &str,
    topic: &str,
    partition: i32,
    offset: i64,
    key: Option<&[u8]>,
    payload: Option<&[u8]>,
    headers: &serde_json::Value,
    error: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO jobledger_consumer.dead_letters (grp, topic, partition, \"offset\", key, payload, headers, error) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (grp, topic, partition, \"offset\") DO NOTHING",
    )
    .bind(group)
    .bind(topic)
    .bind(partition)
    .bind(offset)
    .bind(key)
    .bind(payload)
    .bind(headers)
    .bind(error)
    .execute(conn)
    .await?;
    Ok(())
}
