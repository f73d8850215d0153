//! What a handler sees (`JobContext`) and what it answers (`HandlerOutcome`).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::domain::{Job, JobState, NextAction, Outcome};
use crate::ledger::{Lease, LedgerError, LedgerResult, WriteResult};

/// Why a handler is asked to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The job became `cancel_requested`: stop at the next step boundary and
    /// return `HandlerOutcome::Cancelled`.
    CancelRequested,
    /// A newer token owns the job (or the lease was revoked): nothing this
    /// handler writes will count; stop side effects.
    LeaseLost,
    /// The worker is shutting down and the drain timeout passed.
    Shutdown,
}

/// A step boundary refused to let the handler go on.
#[derive(Debug, thiserror::Error)]
pub enum Stop {
    #[error("cancel requested")]
    CancelRequested,
    #[error("lease lost")]
    LeaseLost,
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// A handler's answer. The runtime writes it through the job's lease.
#[derive(Debug)]
pub enum HandlerOutcome {
    Success(Option<Value>),
    /// Submitted outside; wait for this receipt (`awaiting_receipt`).
    Submitted(String),
    Transient {
        code: String,
        message: Option<String>,
    },
    Permanent {
        code: String,
        message: Option<String>,
    },
    /// Run again later without burning an attempt.
    Snooze(Duration),
    /// Stopped at a step boundary after a cancel request: confirm it.
    Cancelled,
    /// The handler already wrote its completion itself (`complete_in`, with
    /// its own business writes); nothing more to write.
    Written(Box<WriteResult>),
    /// The handler noticed its lease is gone: write nothing.
    LeaseLost,
}

impl HandlerOutcome {
    pub fn success(result: Value) -> Self {
        HandlerOutcome::Success(Some(result))
    }
    pub fn transient(code: &str) -> Self {
        HandlerOutcome::Transient {
            code: code.into(),
            message: None,
        }
    }
    pub fn permanent(code: &str) -> Self {
        HandlerOutcome::Permanent {
            code: code.into(),
            message: None,
        }
    }
}

impl From<Stop> for HandlerOutcome {
    fn from(s: Stop) -> Self {
        match s {
            Stop::CancelRequested => HandlerOutcome::Cancelled,
            Stop::LeaseLost => HandlerOutcome::LeaseLost,
            Stop::Ledger(e) => HandlerOutcome::Transient {
                code: "ledger_unavailable".into(),
                message: Some(e.to_string()),
            },
        }
    }
}

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
pub type HandlerFn = Arc<dyn Fn(JobContext) -> BoxFuture<HandlerOutcome> + Send + Sync>;

/// Shared between the runtime (which learns of cancels and lost leases) and
/// the handler (which watches for them).
#[derive(Clone, Default)]
pub(crate) struct Signal {
    pub(crate) token: CancellationToken,
    reason: Arc<OnceLock<StopReason>>,
}

impl Signal {
    pub(crate) fn fire(&self, reason: StopReason) {
        let _ = self.reason.set(reason);
        self.token.cancel();
    }
    pub(crate) fn reason(&self) -> Option<StopReason> {
        self.reason.get().copied()
    }
}

/// Everything a handler needs about its job, and the only ways it writes.
pub struct JobContext {
    pub(crate) lease: Lease,
    pub(crate) job: Job,
    pub(crate) signal: Signal,
    pub(crate) lease_len: Duration,
    pub(crate) pool: PgPool,
}

impl JobContext {
    pub fn job(&self) -> &Job {
        &self.job
    }
    pub fn payload(&self) -> &Value {
        &self.job.payload
    }
    /// The business idempotency key: what the outside world must see.
    pub fn job_key(&self) -> Option<&str> {
        self.job.job_key.as_deref()
    }
    pub fn epoch(&self) -> i64 {
        self.job.epoch
    }
    /// The fencing token: internal only, never an external idempotency key.
    pub fn token(&self) -> i64 {
        self.job.token
    }
    pub fn attempt(&self) -> i32 {
        self.job.attempt
    }
    /// `Reconcile` after a takeover: check the outside world before acting.
    pub fn next_action(&self) -> NextAction {
        self.job.next_action
    }
    pub fn lease(&self) -> &Lease {
        &self.lease
    }
    /// The W3C `traceparent` of this handler's span, so outside calls it
    /// makes join the job's trace; `None` when tracing is off.
    pub fn traceparent(&self) -> Option<&str> {
        self.lease.trace()
    }
    /// Fires when the job becomes `cancel_requested`, the lease is lost, or
    /// the worker's drain timeout passes.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.signal.token.cancelled()
    }
    pub fn is_cancelled(&self) -> bool {
        self.signal.token.is_cancelled()
    }
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.signal.reason()
    }

    /// A step boundary: records progress (and extends the lease), or says
    /// why the handler must stop before its next side effect.
    ///
    /// On success it answers the lease end this write set (database clock).
    /// No takeover can happen before it, so it is the deadline to hand an
    /// outside call: a provider that refuses work past its deadline can never
    /// execute a frozen worker's call after a successor reconciled.
    pub async fn step(&self, name: &str) -> Result<Option<DateTime<Utc>>, Stop> {
        if self.signal.reason() == Some(StopReason::LeaseLost) {
            return Err(Stop::LeaseLost);
        }
        let r = self.lease.progress(name, Some(self.lease_len)).await?;
        match r.outcome {
            Outcome::Committed | Outcome::AlreadyCommitted => Ok(r.job.as_ref().and_then(|j| j.lease_until)),
            _ if r
                .job
                .as_ref()
                .is_some_and(|j| j.state == JobState::CancelRequested) =>
            {
                self.signal.fire(StopReason::CancelRequested);
                Err(Stop::CancelRequested)
            }
            _ => {
                self.signal.fire(StopReason::LeaseLost);
                Err(Stop::LeaseLost)
            }
        }
    }

    /// Records outside evidence; allowed even after the lease was lost.
    pub async fn observe(&self, key: &str, data: Value) -> LedgerResult<WriteResult> {
        self.lease.observe(key, data).await
    }

    /// For business writes committed together with the completion: begin a
    /// transaction here, write, call `complete_in`, commit only on `committed`,
    /// and return `HandlerOutcome::Written`.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub async fn complete_in(
        &self,
        conn: &mut PgConnection,
        result: Option<Value>,
    ) -> LedgerResult<WriteResult> {
        self.lease.complete_in(conn, result).await
    }
}
