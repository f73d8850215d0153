//! The database layer: one named function per query, nothing else issues SQL.
//!
//! Functions that run a single statement take any executor (a pool, a
//! connection, or the caller's transaction); functions that need a row lock
//! take `&mut PgConnection`, which a caller's `Transaction` derefs to.

pub mod admission;
pub mod audit;
pub mod columns;
pub mod events;
pub mod jobs;
pub mod locks;
pub mod merkle;
pub mod overview;
pub mod policies;
pub mod queues;
pub mod readers;
pub mod rejections;
pub mod rows;
pub mod schedules;
pub mod schema;
pub mod search;
pub mod tokens;
pub mod tombstones;
pub mod workflows;
pub mod writes;

use thiserror::Error;

pub use rows::{EventRow, JobRow, TombstoneRow};

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// A conditional write under a held row lock changed fewer rows than it
    /// should. Cannot happen unless something wrote around the store; the
    /// whole transaction is rolled back.
    #[error("fenced write raced: {0}")]
    FenceRace(String),
}

impl StoreError {
    /// Worth retrying the whole operation (connection trouble, serialization
    /// failure, deadlock, server shutting down).
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Db(e) => match e {
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed
                | sqlx::Error::Tls(_) => true,
                sqlx::Error::Database(db) => db
                    .code()
                    .map(|c| {
                        matches!(
                            c.as_ref(),
                            "40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03" | EPOCH_BELOW_PURGED
                        ) || c.starts_with("08")
                    })
                    .unwrap_or(false),
                _ => false,
            },
            StoreError::FenceRace(_) => true,
            StoreError::Migrate(_) | StoreError::Corrupt(_) => false,
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// SQLSTATE of `jobledger.check_key_epoch()`: a keyed job was inserted with
/// an epoch below a purged lifecycle of the same key (its epoch was drawn
/// before that lifecycle's purge committed). Retry with a new epoch.
pub const EPOCH_BELOW_PURGED: &str = "JL002";

/// SQLSTATE of `jobledger.check_inserted_jobs()` and
/// `check_updated_jobs()`: a `jobs` row was inserted or updated without its
/// event (in the same statement or earlier in the same transaction), or
/// changed what its job is.
pub const ROW_WITHOUT_EVENT: &str = "JL001";

impl StoreError {
    /// The SQLSTATE of a database error, if this is one.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            StoreError::Db(sqlx::Error::Database(d)) => d.code().map(|c| c.to_string()),
            _ => None,
        }
    }
}
