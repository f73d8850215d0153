//! Database creation and migrations (embedded in the binary).

use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{ConnectOptions, Connection, PgPool};

use super::StoreResult;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

pub async fn migrate(pool: &PgPool) -> StoreResult<()> {
    if let Err(e) = ensure_roles(pool).await {
        // A migrator without CREATEROLE on a cluster missing the roles: the
        // migrations themselves say what is wrong (or find nothing to do),
        // as they did before this step existed.
        if e.sqlstate().as_deref() != Some("42501") {
            return Err(e);
        }
    }
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// Creates the three cluster-wide roles before the migrations run. Roles are
/// shared by every database of the cluster, so two databases migrated at
/// once on a fresh cluster both pass the migration's `IF NOT EXISTS` and the
/// second `CREATE ROLE` fails on the catalogue's unique index, failing that
/// whole migration. Here each creation runs in its own subtransaction that
/// takes losing that race as success. (The migration keeps its own guard:
/// its text is checksummed by every database that applied it.) Nothing is
/// attempted, and so no CREATEROLE privilege needed, when the roles exist.
async fn ensure_roles(pool: &PgPool) -> StoreResult<()> {
    sqlx::query(
        r#"DO $$
DECLARE r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['jobledger_worker', 'jobledger_reader', 'jobledger_admin'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I LOGIN', r);
            EXCEPTION WHEN unique_violation OR duplicate_object THEN
                NULL; -- created by a concurrent migration of another database
            END;
        END IF;
    END LOOP;
END
$$"#,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Creates the target database when it is missing, connecting to the
/// `postgres` maintenance database of the same server.
pub async fn create_database_if_missing(opts: &PgConnectOptions) -> StoreResult<bool> {
    let Some(name) = opts.get_database().map(str::to_string) else {
        return Ok(false);
    };
    let mut admin: PgConnection = opts.clone().database("postgres").connect().await?;
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(&name)
        .fetch_one(&mut admin)
        .await?;
    if !exists {
        let quoted = format!("\"{}\"", name.replace('"', "\"\""));
        if let Err(e) = sqlx::query(&format!("CREATE DATABASE {quoted}"))
            .execute(&mut admin)
            .await
        {
            // Another process may have created it between our check and now.
            let e = super::StoreError::from(e);
            if e.sqlstate().as_deref() != Some("42P04") {
                return Err(e);
            }
        }
    }
    admin.close().await?;
    Ok(!exists)
}

/// Makes the current transaction read one consistent snapshot (verify reads
/// the log and the projection as of the same instant).
pub async fn snapshot_read_only(conn: &mut PgConnection) -> StoreResult<()> {
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(conn)
        .await?;
    Ok(())
}

/// Drops a database (the bench's throwaway one), disconnecting its sessions.
pub async fn drop_database(pool: &sqlx::PgPool, name: &str) -> StoreResult<()> {
    let quoted = format!("\"{}\"", name.replace('"', "\"\""));
    sqlx::query(&format!("DROP DATABASE IF EXISTS {quoted} WITH (FORCE)"))
        .execute(pool)
        .await?;
    Ok(())
}

/// Vacuums the log and the jobs table and refreshes their statistics: what
/// autovacuum does on a live database. A server with autovacuum off (this
/// machine's) never does it on its own. Without statistics a 1M-event log
/// was probed with bitmap scans instead of index scans (the reader's
/// per-job probes took 40 % longer); without the vacuum the first reader
/// of a fresh history set every row's hint bits, writing the whole log
/// once, and the jobs' indexes kept an entry for every claim.
pub async fn vacuum_log<'e>(exec: impl sqlx::PgExecutor<'e>) -> StoreResult<()> {
    // VACUUM cannot run in a transaction block: sent as one simple query.
    sqlx::raw_sql("VACUUM (ANALYZE) jobledger.events, jobledger.jobs")
        .execute(exec)
        .await?;
    Ok(())
}
