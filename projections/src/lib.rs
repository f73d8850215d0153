//! Catch-up read models over the jobledger event log.
//!
//! A `Projection` applies batches of events to its table inside a
//! transaction; the runner stores the projection's checkpoint in that same
//! transaction, so a crash never applies an event twice or skips one. Each
//! projection has a version: a newer version is built into `<name>_v<N>`
//! from the start of the log while the view `<name>` keeps serving the old
//! table, then the view is switched in one transaction and the old table
//! dropped. The log itself is read through `LogSource` (jobledger's one log
//! reader), so this crate does not depend on the ledger.
#![forbid(unsafe_code)]

pub mod queue_stats;
pub mod rebuild;
pub mod registry;
pub mod runner;
pub mod shipped;
pub mod workflows;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use std::future::Future;
use std::pin::Pin;
use uuid::Uuid;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

const UNIQUE_VIOLATION: &str = "23505";

/// Runs the plain insert `plain` under a savepoint, and only when it meets
/// a row the table already has undoes it and runs `fallback` (its
/// idempotent form: `ON CONFLICT …`) with the same arguments. `ON CONFLICT`
/// costs every row a speculative insertion (in psql, 10,000 timeline rows
/// took 26 ms with it and 13 ms without; 10,000 `jobs_rebuilt` documents
/// 86–94 ms and 59–66 ms), and a (job, version) comes twice only when the
/// reader handed it out early, ahead of its place in log order (a caller's
/// transaction took its id before an earlier version's), and then meets it
/// in log order. Needs a transaction (the runner's, which commits each
/// batch); the savepoint is released either way, so a caller applying many
/// batches in one transaction does not nest them.
pub async fn insert_plainly(
    tx: &mut PgConnection,
    plain: &str,
    fallback: &str,
    args: sqlx::postgres::PgArguments,
) -> Result<(), sqlx::Error> {
    sqlx::query("SAVEPOINT jobledger_plain_insert")
        .execute(&mut *tx)
        .await?;
    match sqlx::query_with(plain, args.clone()).execute(&mut *tx).await {
        Ok(_) => {}
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(UNIQUE_VIOLATION) => {
            sqlx::query("ROLLBACK TO SAVEPOINT jobledger_plain_insert")
                .execute(&mut *tx)
                .await?;
            sqlx::query_with(fallback, args).execute(&mut *tx).await?;
        }
        Err(e) => return Err(e),
    }
    sqlx::query("RELEASE SAVEPOINT jobledger_plain_insert")
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// `unnest($1::uuid[]), unnest($2::text[]), …` for a batch's parallel
/// arrays of these element types, to select from (`INSERT … SELECT {this}`)
/// in place of `FROM UNNEST($1, $2, …)`: a function in FROM is materialised
/// into a tuplestore before its first row, and a batch of `jobs_rebuilt`
/// documents (about 8.6 MB for 10,000 events) spilled it to a temporary
/// file on every statement; a select-list `unnest` streams. The arrays must
/// be of one length (a shorter one is padded with NULLs).
pub fn unnested(types: &[&str]) -> String {
    let cols: Vec<String> = types
        .iter()
        .enumerate()
        .map(|(i, t)| format!("unnest(${}::{t}[])", i + 1))
        .collect();
    cols.join(", ")
}

/// Everything at or before `(txid, position)` in the reader's order is applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Checkpoint {
    pub txid: i64,
    pub position: i64,
}

/// One event of the log, as projections see it.
#[derive(Clone, Debug)]
pub struct Event {
    pub position: i64,
    pub job_id: Uuid,
    pub version: i64,
    pub kind: String,
    pub from_state: Option<String>,
    pub to_state: String,
    pub reason: String,
    pub error_class: Option<String>,
    pub actor: String,
    pub epoch: i64,
    pub token: i64,
    pub attempt: i32,
    pub run: i32,
    pub data: Value,
    pub recorded_at: DateTime<Utc>,
    /// `None` and `""` for a projection whose
    /// [`Projection::reads_hashes`] is `false`.
    pub prev_hash: Option<String>,
    pub hash: String,
    /// The schema version `data` was written in (jobledger's
    /// `domain::schema`: read it through the upcasters, never raw).
    pub schema: i16,
}

impl Event {
    /// An event of the log itself (a signed checkpoint, on the nil stream
    /// id that no job has), not of a job.
    pub fn is_log_event(&self) -> bool {
        self.job_id.is_nil()
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProjectionError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("log: {0}")]
    Log(String),
    #[error("unknown projection {0}")]
    Unknown(String),
    /// Committed events wait behind an open transaction and nothing moved
    /// for the runner's whole patience.
    #[error("projection {name} made no progress for {waited:?}: committed events wait behind an open transaction, or a session that read the projection's view keeps a newer version from switching in (see pg_stat_activity for one idle in transaction)")]
    Stalled {
        name: String,
        waited: std::time::Duration,
    },
    /// A rebuild of a newer version than this code's is under way: only
    /// the newer code builds it.
    #[error("projection {name}: a rebuild of version {building} is under way, newer than this code's version {ours}; run it with the newer jobledger")]
    NewerRebuild { name: String, building: i32, ours: i32 },
    /// Code older than the serving version asked to rebuild it (it would
    /// switch the view back to an older table) or to read it.
    #[error("projection {name}: version {serving} serves, newer than this code's version {ours}; use the newer jobledger")]
    OlderThanServing { name: String, serving: i32, ours: i32 },
    /// An older version than this code's still serves: this code's
    /// rebuild has not switched in yet, or a newer version's rebuild is
    /// under way, which this code leaves alone.
    #[error("projection {name}: version {serving} serves, not this code's version {ours} (its rebuild has not switched in, or a newer version's is under way; see projections status)")]
    NotServing { name: String, serving: i32, ours: i32 },
    /// A name whose tables could be another projection's, or a version
    /// below 1 (see `rebuild::check_projection`).
    #[error("projection {name:?} is not usable: {reason}")]
    BadName { name: String, reason: &'static str },
    /// The rebuild being driven neither goes on nor serves: a newer
    /// version's build replaced it, or it served and a later rebuild
    /// followed it.
    #[error("projection {name}: the rebuild into {table} is neither under way nor serving: a newer version's build replaced it, or it served and a later rebuild followed (see projections status)")]
    RebuildReplaced { name: String, table: String },
}

/// Which events' `data` a read hands out, how much of it, and whether the
/// hash chain's columns come: see [`Projection::data_of`],
/// [`Projection::data_keys`] and [`Projection::reads_hashes`]. The default:
/// all of every event's, with its hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataWanted {
    pub kinds: Option<&'static [&'static str]>,
    pub keys: Option<&'static [&'static str]>,
    pub hashes: bool,
}

impl Default for DataWanted {
    fn default() -> Self {
        DataWanted {
            kinds: None,
            keys: None,
            hashes: true,
        }
    }
}

/// The log, read in batches after a checkpoint: every event, each job's
/// versions in order (duplicates possible: projections must be idempotent
/// per (job, version)).
pub trait LogSource: Send + Sync {
    /// `data`: the events whose data is read and the keys kept of it
    /// ([`Projection::data_wanted`]).
    fn read(
        &self,
        after: Checkpoint,
        limit: i64,
        data: DataWanted,
    ) -> BoxFuture<'_, Result<(Vec<Event>, Checkpoint), ProjectionError>>;
    /// Whether committed events lie past `after` that `read` may not hand
    /// out yet (an open transaction holds the horizon back).
    fn behind(&self, after: Checkpoint) -> BoxFuture<'_, Result<bool, ProjectionError>>;
}

/// A read model. Table names are chosen by the runner (`<name>_v<version>`).
pub trait Projection: Send + Sync {
    fn name(&self) -> &str;
    /// Bump it when the table's shape or meaning changes: a rebuild follows.
    fn version(&self) -> i32;
    /// Creates the (empty) table `table`, plus anything it needs.
    fn create<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
    /// The kinds of event whose `data` `apply` reads, exactly as in the
    /// log's `type` (`"enqueued"`); the others come with `data` =
    /// `Value::Null`, every time they come. `None` (the default): every
    /// event's data.
    /// Reading and parsing each event's data was about half of what reading
    /// the log cost (an `enqueued` event carries the payload and policy), so
    /// a projection that needs none, or only its jobs' `enqueued` events',
    /// says so and its rebuild reads that much less.
    fn data_of(&self) -> Option<&'static [&'static str]> {
        None
    }
    /// Of the data `data_of` names, the top-level keys `apply` reads: the
    /// data then comes as an object of exactly these keys (one the event's
    /// data lacks is JSON `null`), every time it comes. `None` (the
    /// default): the data as stored. An `enqueued` event carries the
    /// payload and policy; parsing them for the one key `queue_stats`
    /// reads was most of its rebuild's log read.
    fn data_keys(&self) -> Option<&'static [&'static str]> {
        None
    }
    /// Whether `apply` reads the events' `prev_hash` and `hash`. `false`:
    /// they come empty (`None` and `""`), every time they come, and the log
    /// read neither prints nor sends them: two 64-character columns of
    /// every event, about a twentieth of `job_timeline`'s rebuild
    /// (docs/benchmarks.md). `true` (the default): as stored.
    fn reads_hashes(&self) -> bool {
        true
    }
    /// What the runner asks the log for: `data_of`, `data_keys` and
    /// `reads_hashes`.
    fn data_wanted(&self) -> DataWanted {
        DataWanted {
            kinds: self.data_of(),
            keys: self.data_keys(),
            hashes: self.reads_hashes(),
        }
    }
    /// Applies a batch (set-based, idempotent per (job, version)). A
    /// (job, version) comes again when the reader handed it out early, ahead
    /// of its place in log order, and then meets it there;
    /// [`insert_plainly`] is a cheap way: a plain insert, redone
    /// idempotently under a savepoint only when it meets a row it has.
    /// `tx` is a transaction (the runner's, which commits the batch with
    /// its checkpoint); the shipped projections' savepoints need one.
    fn apply<'a>(
        &'a self,
        tx: &'a mut PgConnection,
        table: &'a str,
        events: &'a [Event],
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
}

#[cfg(test)]
mod tests {
    #[test]
    fn unnested_numbers_each_array_with_its_type() {
        assert_eq!(
            super::unnested(&["uuid", "text", "int8"]),
            "unnest($1::uuid[]), unnest($2::text[]), unnest($3::int8[])"
        );
    }
}
