//! Wake-ups for listeners: `pg_notify` on the ledger's channels.

use sqlx::{PgConnection, PgPool};

use super::StoreResult;

/// Notifies inside the caller's transaction: PostgreSQL delivers it when
/// that transaction commits, and holds its notify lock across the commit's
/// flush (what `ledger::wake` avoids for the ledger's own transactions).
pub async fn notify_in(conn: &mut PgConnection, channels: &[&str], payloads: &[String]) -> StoreResult<()> {
    sqlx::query("SELECT count(pg_notify(n.c, n.p)) FROM unnest($1::text[], $2::text[]) AS n(c, p)")
        .bind(channels)
        .bind(payloads)
        .execute(conn)
        .await?;
    Ok(())
}

/// Notifies in a transaction of its own that writes nothing else and
/// commits without waiting for its flush (`synchronous_commit` off for
/// it alone): the notify lock is held for microseconds, and a crash can
/// lose only a wake-up, which the listeners' polling covers.
pub async fn notify_detached(pool: &PgPool, channels: &[&str], payloads: &[String]) -> StoreResult<()> {
    sqlx::query(
        "SELECT count(pg_notify(n.c, n.p)) \
         FROM (SELECT set_config('synchronous_commit', 'off', true)) AS s, \
              unnest($1::text[], $2::text[]) AS n(c, p)",
    )
    .bind(channels)
    .bind(payloads)
    .execute(pool)
    .await?;
    Ok(())
}
