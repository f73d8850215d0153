use thiserror::Error;
use uuid::Uuid;

use crate::store::StoreError;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// The request itself is wrong; retrying it unchanged cannot help.
    #[error("bad input: {0}")]
    BadInput(String),
    #[error("payload is {size} bytes, over the limit of {limit} bytes")]
    TooLarge { size: usize, limit: usize },
    #[error("job key {key:?} in queue {queue:?} already names job {job_id} with a different payload")]
    KeyConflict {
        queue: String,
        key: String,
        job_id: Uuid,
    },
    #[error("job {0} not found")]
    NotFound(Uuid),
    /// The events table was replaced (restored, truncated and loaded
    /// again) during or just before this many reads in a row (each found a
    /// history of the log other than the one it started from): read again
    /// once the repair is over.
    #[error(
        "the event log was replaced during or just before {0} reads in a row; read again once it is settled"
    )]
    LogReplaced(usize),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for LedgerError {
    fn from(e: sqlx::Error) -> Self {
        LedgerError::Store(StoreError::Db(e))
    }
}

impl LedgerError {
    /// The role lacks a privilege (SQLSTATE 42501), anywhere in the cause chain.
    pub fn is_permission_denied(&self) -> bool {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = cause {
            if let Some(db) = e
                .downcast_ref::<sqlx::Error>()
                .and_then(|e| e.as_database_error())
            {
                if db.code().is_some_and(|c| c == "42501") {
                    return true;
                }
            }
            cause = e.source();
        }
        false
    }

    pub fn is_retryable(&self) -> bool {
        match self {
            LedgerError::Store(e) => e.is_retryable(),
            LedgerError::LogReplaced(_) => true,
            _ => false,
        }
    }
}

pub type LedgerResult<T> = Result<T, LedgerError>;
