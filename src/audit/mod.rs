//! The auditor's kit (docs/audit.md): the log as an RFC 6962 Merkle tree
//! kept by a fenced checkpointer that signs its heads with a key held
//! outside the database, proofs of inclusion and consistency, portable
//! exports, and the offline audit of exports and proofs (no database).

pub mod check;
pub mod checkpointer;
pub mod export;
pub mod keys;
mod lines;
pub mod offline;
pub mod proofcheck;
pub mod prove;
pub mod tree;

use std::sync::atomic::AtomicU64;

use crate::ledger::LedgerError;
use crate::store::StoreError;

/// How far a long operation (an export, an audit) is, for a progress bar
/// another thread draws: `total` once known (0 until then), `done` as it
/// goes, in the operation's unit (events for an export, compressed bytes
/// read for an audit).
#[derive(Debug, Default)]
pub struct Progress {
    pub total: AtomicU64,
    pub done: AtomicU64,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuditError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("key: {0}")]
    Key(String),
    #[error("{path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("the checkpointer's lease was taken by another one; this one stops")]
    LeaseLost,
    /// What was asked cannot be answered from this log (no signed head yet,
    /// an unknown checkpoint, a job with no events).
    #[error("{0}")]
    Unanswerable(String),
    /// The log no longer matches what was checkpointed.
    #[error("the log does not match its tree: {0}")]
    Mismatch(String),
    #[error("bad input: {0}")]
    BadInput(String),
}

impl From<StoreError> for AuditError {
    fn from(e: StoreError) -> Self {
        AuditError::Ledger(e.into())
    }
}

impl From<sqlx::Error> for AuditError {
    fn from(e: sqlx::Error) -> Self {
        AuditError::Ledger(e.into())
    }
}

pub type AuditResult<T> = Result<T, AuditError>;

pub(crate) fn io(path: &std::path::Path, err: std::io::Error) -> AuditError {
    AuditError::Io {
        path: path.display().to_string(),
        err,
    }
}
