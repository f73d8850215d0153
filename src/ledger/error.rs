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
        matches!(self, LedgerError::Store(e) if e.is_retryable())
    }
}

pub type LedgerResult<T> = Result<T, LedgerError>;
