//! `jobledger_proj.registry`: each projection's serving version and table,
//! its checkpoint, and the version being rebuilt with its own checkpoint.
//! One named function per query.

use sqlx::{PgConnection, PgPool};

use crate::Checkpoint;

const SCHEMA: &str = "
CREATE SCHEMA IF NOT EXISTS jobledger_proj;
CREATE TABLE IF NOT EXISTS jobledger_proj.registry (
    name              text PRIMARY KEY,
    version           integer NOT NULL,
    active_table      text NOT NULL,
    txid              bigint NOT NULL DEFAULT 0,
    position          bigint NOT NULL DEFAULT 0,
    building_version  integer,
    building_table    text,
    b_txid            bigint NOT NULL DEFAULT 0,
    b_position        bigint NOT NULL DEFAULT 0,
    updated_at        timestamptz NOT NULL DEFAULT now()
);";

const INSTALL_LOCK: i64 = 0x6a6f_626c_6564_0201;

pub async fn install(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(INSTALL_LOCK)
        .execute(&mut *conn)
        .await?;
    let r = sqlx::raw_sql(SCHEMA).execute(&mut *conn).await;
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(INSTALL_LOCK)
        .execute(&mut *conn)
        .await?;
    r.map(|_| ())
}

#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct Entry {
    pub name: String,
    pub version: i32,
    pub active_table: String,
    pub txid: i64,
    pub position: i64,
    pub building_version: Option<i32>,
    pub building_table: Option<String>,
    pub b_txid: i64,
    pub b_position: i64,
}

impl Entry {
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            txid: self.txid,
            position: self.position,
        }
    }
    pub fn building_checkpoint(&self) -> Checkpoint {
        Checkpoint {
            txid: self.b_txid,
            position: self.b_position,
        }
    }
    /// The version being rebuilt, unless it is older than the one serving:
    /// such a rebuild (an older binary's) is never carried on nor switched
    /// in, which would serve an older version again; the serving version's
    /// `start_rebuild` replaces it.
    pub fn live_building_version(&self) -> Option<i32> {
        self.building_version.filter(|v| *v >= self.version)
    }
    /// The serving table (or, `building`, the one being rebuilt): its
    /// checkpoint, name and version. None: no rebuild.
    pub fn target(&self, building: bool) -> Option<(Checkpoint, &str, i32)> {
        if building {
            Some((
                self.building_checkpoint(),
                self.building_table.as_deref()?,
                self.building_version?,
            ))
        } else {
            Some((self.checkpoint(), &self.active_table, self.version))
        }
    }
}

const COLUMNS: &str =
    "name, version, active_table, txid, position, building_version, building_table, b_txid, b_position";

pub async fn entries(pool: &PgPool) -> Result<Vec<Entry>, sqlx::Error> {
    // Before any runner installed the registry there are no projections
    // (not an error: `projections status` and the API ask on fresh ledgers).
    let installed: bool = sqlx::query_scalar("SELECT to_regclass('jobledger_proj.registry') IS NOT NULL")
        .fetch_one(pool)
        .await?;
    if !installed {
        return Ok(vec![]);
    }
    sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM jobledger_proj.registry ORDER BY name"
    ))
    .fetch_all(pool)
    .await
}

/// A transaction-scoped lock on a projection's name, held where no
/// registry row exists yet to lock (its first registration).
pub async fn lock_name(conn: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('jobledger_proj:' || $1, 0))")
        .bind(name)
        .execute(conn)
        .await?;
    Ok(())
}

/// Whether a relation other than a view (a table, an index, a sequence),
/// or a type that is no relation's (an enum, a domain), already has `name`
/// in `jobledger_proj`: a new projection's view, and the row type it comes
/// with, would fail on it. Indexes and sequences share the namespace, and
/// PostgreSQL names them (`<table>_pkey`, `…_idx`, `…_seq`) after any
/// projection's tables.
pub async fn name_taken(conn: &mut PgConnection, name: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                        WHERE n.nspname = 'jobledger_proj' AND c.relname = $1 AND c.relkind <> 'v') \
             OR EXISTS (SELECT 1 FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace \
                        WHERE n.nspname = 'jobledger_proj' AND t.typname = $1 AND t.typrelid = 0)",
    )
    .bind(name)
    .fetch_one(conn)
    .await
}

/// The entry as last committed, unlocked: what a runner reads before it
/// decides, and checks again under `lock` before it writes. Locking it
/// here cost each read an xid, a WAL record and, outside a transaction, a
/// commit that waited for its flush (0.3-1.4 ms against 0.08; twice a step).
pub async fn get(conn: &mut PgConnection, name: &str) -> Result<Option<Entry>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM jobledger_proj.registry WHERE name = $1"
    ))
    .bind(name)
    .fetch_optional(conn)
    .await
}

/// The entry, locked: one runner at a time moves a projection.
pub async fn lock(conn: &mut PgConnection, name: &str) -> Result<Option<Entry>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM jobledger_proj.registry WHERE name = $1 FOR UPDATE"
    ))
    .bind(name)
    .fetch_optional(conn)
    .await
}

pub async fn register(
    conn: &mut PgConnection,
    name: &str,
    version: i32,
    table: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO jobledger_proj.registry (name, version, active_table) VALUES ($1, $2, $3) \
         ON CONFLICT (name) DO NOTHING",
    )
    .bind(name)
    .bind(version)
    .bind(table)
    .execute(conn)
    .await?;
    Ok(())
}

pub async fn set_checkpoint(
    conn: &mut PgConnection,
    name: &str,
    building: bool,
    cp: Checkpoint,
) -> Result<(), sqlx::Error> {
    let sql = if building {
        "UPDATE jobledger_proj.registry SET b_txid = $2, b_position = $3, updated_at = now() WHERE name = $1"
    } else {
        "UPDATE jobledger_proj.registry SET txid = $2, position = $3, updated_at = now() WHERE name = $1"
    };
    sqlx::query(sql)
        .bind(name)
        .bind(cp.txid)
        .bind(cp.position)
        .execute(conn)
        .await?;
    Ok(())
}

pub async fn start_build(
    conn: &mut PgConnection,
    name: &str,
    version: i32,
    table: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE jobledger_proj.registry SET building_version = $2, building_table = $3, b_txid = 0, b_position = 0, \
         updated_at = now() WHERE name = $1",
    )
    .bind(name)
    .bind(version)
    .bind(table)
    .execute(conn)
    .await?;
    Ok(())
}

/// The rebuilt version becomes the serving one.
pub async fn promote(conn: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE jobledger_proj.registry SET version = building_version, active_table = building_table, \
         txid = b_txid, position = b_position, building_version = NULL, building_table = NULL, \
         b_txid = 0, b_position = 0, updated_at = now() WHERE name = $1 AND building_table IS NOT NULL",
    )
    .bind(name)
    .execute(conn)
    .await?;
    Ok(())
}

/// Bounds how long this transaction's statements wait for a lock (the
/// switch's DDL waits for every reader of the view or the old table).
pub async fn limit_lock_wait(conn: &mut PgConnection, wait: std::time::Duration) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(&format!(
        "SET LOCAL lock_timeout = '{}ms'",
        wait.as_millis().max(1)
    ))
    .execute(conn)
    .await?;
    Ok(())
}

/// This transaction's commit returns without waiting for its WAL to reach
/// the disk (`synchronous_commit = off` for it alone). For a rebuild's
/// batches only: no one reads the table being built, a crash can lose only
/// whole transactions (its rows and its checkpoint together, so the rebuild
/// resumes from an earlier checkpoint), and the switch that serves the
/// table commits with a flush, which covers every transaction before it.
pub async fn commit_without_flush(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql("SET LOCAL synchronous_commit = off")
        .execute(conn)
        .await?;
    Ok(())
}

/// SQLSTATE 55P03: a lock was not granted within `lock_timeout`.
pub fn is_lock_timeout(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03")
}

/// Points the view `jobledger_proj.<name>` at `table` (in the caller's
/// transaction: readers see the old table or the new one, never neither).
pub async fn point_view(conn: &mut PgConnection, name: &str, table: &str) -> Result<(), sqlx::Error> {
    let q = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
    sqlx::raw_sql(&format!(
        "DROP VIEW IF EXISTS jobledger_proj.{v}; CREATE VIEW jobledger_proj.{v} AS SELECT * FROM jobledger_proj.{t};",
        v = q(name),
        t = q(table)
    ))
    .execute(conn)
    .await?;
    Ok(())
}

/// Drops a projection table and its side tables (`<table>__*`).
pub async fn drop_table(conn: &mut PgConnection, table: &str) -> Result<(), sqlx::Error> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'jobledger_proj' \
         AND (tablename = $1 OR starts_with(tablename, $1 || '__'))",
    )
    .bind(table)
    .fetch_all(&mut *conn)
    .await?;
    for t in tables {
        sqlx::raw_sql(&format!(
            "DROP TABLE IF EXISTS jobledger_proj.\"{}\" CASCADE",
            t.replace('"', "\"\"")
        ))
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}
