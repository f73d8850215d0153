//! The consumer's tables (idempotent install at start-up).

use sqlx::PgPool;

const SCHEMA_SQL: &str = include_str!("../sql/schema.sql");
/// Serialises concurrent installs (CREATE ... IF NOT EXISTS can race).
const INSTALL_LOCK: i64 = 0x6a6f_626c_6564_0101;

pub async fn install(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(INSTALL_LOCK)
        .execute(&mut *conn)
        .await?;
    // raw_sql runs the script as one implicit transaction (simple protocol).
    let result = sqlx::raw_sql(SCHEMA_SQL).execute(&mut *conn).await;
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(INSTALL_LOCK)
        .execute(&mut *conn)
        .await?;
    result.map(|_| ())
}
