//! Periodic schedules: each schedule's stream, the state it leaves, and the
//! scheduler's fenced lease (migration 20261202000008).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgConnection, PgExecutor};

use super::StoreResult;

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ScheduleEventRow {
    pub name: String,
    pub version: i64,
    pub action: String,
    pub actor: String,
    pub reason: String,
    pub data: Value,
    pub recorded_at: DateTime<Utc>,
    pub prev_hash: Option<String>,
    pub hash: String,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ScheduleRow {
    pub name: String,
    pub spec: Value,
    pub paused: bool,
    pub deleted: bool,
    pub cursor_at: DateTime<Utc>,
    pub version: i64,
    pub last_hash: String,
}

/// The schedule's state, locked; a transaction-scoped advisory lock first,
/// so two first creations of one name do not both insert.
pub async fn lock_schedule(conn: &mut PgConnection, name: &str) -> StoreResult<Option<ScheduleRow>> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('jobledger.schedule:' || $1, 0))")
        .bind(name)
        .execute(&mut *conn)
        .await?;
    Ok(
        sqlx::query_as("SELECT * FROM jobledger.schedules WHERE name = $1 FOR UPDATE")
            .bind(name)
            .fetch_optional(conn)
            .await?,
    )
}

/// Appends the event and writes the state it leaves.
pub async fn append_schedule_event(
    conn: &mut PgConnection,
    e: &ScheduleEventRow,
    st: &ScheduleRow,
) -> StoreResult<()> {
    sqlx::query(
        "INSERT INTO jobledger.schedule_events (name, version, action, actor, reason, data, recorded_at, prev_hash, hash) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(&e.name)
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
    sqlx::query(
        "INSERT INTO jobledger.schedules (name, spec, paused, deleted, cursor_at, version, last_hash) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) \
         ON CONFLICT (name) DO UPDATE SET spec = EXCLUDED.spec, paused = EXCLUDED.paused, \
           deleted = EXCLUDED.deleted, cursor_at = EXCLUDED.cursor_at, version = EXCLUDED.version, \
           last_hash = EXCLUDED.last_hash",
    )
    .bind(&st.name)
    .bind(&st.spec)
    .bind(st.paused)
    .bind(st.deleted)
    .bind(st.cursor_at)
    .bind(st.version)
    .bind(&st.last_hash)
    .execute(conn)
    .await?;
    Ok(())
}

pub async fn schedules<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<ScheduleRow>> {
    Ok(sqlx::query_as("SELECT * FROM jobledger.schedules ORDER BY name")
        .fetch_all(exec)
        .await?)
}

/// Names of schedules that may have slots due (live and not paused).
pub async fn active_schedule_names<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT name FROM jobledger.schedules WHERE NOT paused AND NOT deleted ORDER BY name",
    )
    .fetch_all(exec)
    .await?)
}

pub async fn schedule_events<'e>(
    exec: impl PgExecutor<'e>,
    name: Option<&str>,
) -> StoreResult<Vec<ScheduleEventRow>> {
    Ok(sqlx::query_as(
        "SELECT * FROM jobledger.schedule_events WHERE $1::text IS NULL OR name = $1 ORDER BY name, version",
    )
    .bind(name)
    .fetch_all(exec)
    .await?)
}

/// Takes the scheduler lease if it is free, expired, or already ours; the
/// token goes up on every acquisition, so an older holder is fenced out.
pub async fn acquire_scheduler_lease<'e>(
    exec: impl PgExecutor<'e>,
    holder: &str,
    lease_ms: i64,
) -> StoreResult<Option<i64>> {
    Ok(sqlx::query_scalar(
        "UPDATE jobledger.scheduler_leases SET lease_token = lease_token + 1, lease_holder = $1, \
           lease_until = now() + make_interval(secs => $2::double precision / 1000), updated_at = now() \
         WHERE name = 'scheduler' AND (lease_until IS NULL OR lease_until <= now() OR lease_holder = $1) \
         RETURNING lease_token",
    )
    .bind(holder)
    .bind(lease_ms)
    .fetch_optional(exec)
    .await?)
}

/// Extends the lease; false when another holder took it.
pub async fn renew_scheduler_lease<'e>(
    exec: impl PgExecutor<'e>,
    token: i64,
    lease_ms: i64,
) -> StoreResult<bool> {
    let done = sqlx::query(
        "UPDATE jobledger.scheduler_leases SET lease_until = now() + make_interval(secs => $2::double precision / 1000) \
         WHERE name = 'scheduler' AND lease_token = $1 AND lease_until > now()",
    )
    .bind(token)
    .bind(lease_ms)
    .execute(exec)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// The fence of a firing, inside its transaction: the lease row locked in
/// share mode (an acquisition waits for the firing to commit) and still
/// ours. False: another scheduler holds the lease; fire nothing.
pub async fn hold_scheduler_fence(conn: &mut PgConnection, token: i64) -> StoreResult<bool> {
    Ok(sqlx::query_scalar(
        "SELECT lease_token = $1 AND lease_until > now() FROM jobledger.scheduler_leases \
         WHERE name = 'scheduler' FOR SHARE",
    )
    .bind(token)
    .fetch_optional(conn)
    .await?
    .unwrap_or(false))
}
