//! Queue controls: the per-queue stream of pauses and resumes and the
//! state it leaves (migration 20261202000007).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgConnection, PgExecutor};

use super::StoreResult;

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct QueueEventRow {
    pub queue: String,
    pub version: i64,
    pub action: String,
    pub actor: String,
    pub reason: String,
    pub data: Option<Value>,
    pub recorded_at: DateTime<Utc>,
    pub prev_hash: Option<String>,
    pub hash: String,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct QueueRow {
    pub queue: String,
    pub paused: bool,
    pub paused_at: Option<DateTime<Utc>>,
    pub paused_by: Option<String>,
    pub reason: Option<String>,
    pub version: i64,
    pub last_hash: String,
    pub limits: Value,
    pub rate: Option<Value>,
}

/// The queue's state, locked (pauses and resumes of one queue serialise).
/// Takes a transaction-scoped advisory lock first, so two first pauses of
/// a queue without a row yet do not both insert.
pub async fn lock_queue(conn: &mut PgConnection, queue: &str) -> StoreResult<Option<QueueRow>> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('jobledger.queue:' || $1, 0))")
        .bind(queue)
        .execute(&mut *conn)
        .await?;
    Ok(
        sqlx::query_as("SELECT * FROM jobledger.queues WHERE queue = $1 FOR UPDATE")
            .bind(queue)
            .fetch_optional(conn)
            .await?,
    )
}

pub async fn the_clock(conn: &mut PgConnection) -> StoreResult<DateTime<Utc>> {
    Ok(sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(conn)
        .await?)
}

/// The state a queue's events leave, as `append_queue_event` writes it.
pub struct QueueStateRow<'a> {
    pub paused: bool,
    pub limits: &'a Value,
    pub rate: Option<&'a Value>,
}

/// Appends the event and writes the state it leaves.
pub async fn append_queue_event(
    conn: &mut PgConnection,
    e: &QueueEventRow,
    st: QueueStateRow<'_>,
) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO jobledger.queue_events (queue, version, action, actor, reason, data, recorded_at, prev_hash, hash) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(&e.queue)
    .bind(e.version)
    .bind(&e.action)
    .bind(&e.actor)
    .bind(&e.reason)
    .bind(&e.data)
    .bind(e.recorded_at)
    .bind(&e.prev_hash)
    .bind(&e.hash)
    .execute(&mut *conn)
    .await?;
    // A pause's who/when/why stays while the queue is paused, whatever
    // else changes meanwhile (a limit set during a pause).
    sqlx::query(
        "INSERT INTO jobledger.queues (queue, paused, paused_at, paused_by, reason, version, last_hash, limits, rate) \
         VALUES ($1, $2, CASE WHEN $2 THEN $3 END, CASE WHEN $2 THEN $4 END, CASE WHEN $2 THEN $5 END, $6, $7, $8, $9) \
         ON CONFLICT (queue) DO UPDATE SET paused = EXCLUDED.paused, \
           paused_at = CASE WHEN $10 THEN EXCLUDED.paused_at ELSE queues.paused_at END, \
           paused_by = CASE WHEN $10 THEN EXCLUDED.paused_by ELSE queues.paused_by END, \
           reason = CASE WHEN $10 THEN EXCLUDED.reason ELSE queues.reason END, version = EXCLUDED.version, \
           last_hash = EXCLUDED.last_hash, limits = EXCLUDED.limits, rate = EXCLUDED.rate",
    )
    .bind(&e.queue)
    .bind(st.paused)
    .bind(e.recorded_at)
    .bind(&e.actor)
    .bind(&e.reason)
    .bind(e.version)
    .bind(&e.hash)
    .bind(st.limits)
    .bind(st.rate)
    .bind(e.action == "paused" || e.action == "resumed")
    .execute(conn)
    .await?;
    Ok(())
}

pub async fn queue_state<'e>(exec: impl PgExecutor<'e>, queue: &str) -> StoreResult<Option<QueueRow>> {
    Ok(sqlx::query_as("SELECT * FROM jobledger.queues WHERE queue = $1")
        .bind(queue)
        .fetch_optional(exec)
        .await?)
}

/// Every queue that was ever paused, with its state.
pub async fn controlled_queues<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<QueueRow>> {
    Ok(sqlx::query_as("SELECT * FROM jobledger.queues ORDER BY queue")
        .fetch_all(exec)
        .await?)
}

/// Every control event, by queue and version (for `verify` and history).
pub async fn queue_events<'e>(
    exec: impl PgExecutor<'e>,
    queue: Option<&str>,
) -> StoreResult<Vec<QueueEventRow>> {
    Ok(sqlx::query_as(
        "SELECT * FROM jobledger.queue_events WHERE $1::text IS NULL OR queue = $1 ORDER BY queue, version",
    )
    .bind(queue)
    .fetch_all(exec)
    .await?)
}
