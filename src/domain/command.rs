//! What callers ask for, and the ways the ledger can say no.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::model::{wire_enum, ErrorClass, JobState, Policy, ReceiptStatus};
use super::reason::Reason;
use super::workflow::StepStatus;

/// The generation a writer claims to act for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fence {
    pub epoch: i64,
    pub token: i64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Claim a due queued job, or take over an expired lease (reconcile policy).
    Claim {
        holder: String,
        lease_ms: i64,
    },
    Heartbeat {
        fence: Fence,
        lease_ms: i64,
    },
    Progress {
        fence: Fence,
        step: String,
        lease_ms: Option<i64>,
    },
    Complete {
        fence: Fence,
        result: Option<Value>,
    },
    Submit {
        fence: Fence,
        receipt_id: String,
    },
    Fail {
        fence: Fence,
        class: ErrorClass,
        code: String,
        message: Option<String>,
    },
    ConfirmCancel {
        fence: Fence,
    },
    /// Give back a lease whose work never started (graceful shutdown): the
    /// attempt is not burned.
    Release {
        fence: Fence,
    },
    Snooze {
        fence: Fence,
        delay_ms: i64,
    },
    /// `existing` is the digest of an observation already recorded under `key`
    /// (looked up by the store under the job's row lock).
    Observe {
        fence: Option<Fence>,
        key: String,
        data: Value,
        existing: Option<String>,
    },
    Cancel {
        note: Option<String>,
    },
    Receipt {
        receipt_id: String,
        status: ReceiptStatus,
    },
    Replay {
        operator: String,
        note: String,
    },
    /// An operator's verdict (`resolve`): `verdict` is succeeded or
    /// cancelled; fenced on the version the operator looked at, so two
    /// operators cannot both resolve.
    ResolveByOperator {
        operator: String,
        verdict: JobState,
        note: String,
        evidence: Value,
        expected_version: i64,
    },
    /// An appended correction of the event at `corrects_position` (which the
    /// ledger found to be this job's version `corrects_version`).
    Annotate {
        operator: String,
        corrects_position: i64,
        corrects_version: i64,
        note: String,
    },
    /// The sweeper: lease-expiry policies other than reconcile, exhausted
    /// leases, and receipt deadlines.
    Expire,
    Purge,
    /// On a parent, from the ledger in the step's own transaction.
    StepFinished {
        step: String,
        job_id: uuid::Uuid,
        status: StepStatus,
        version: i64,
        reason: Reason,
    },
    StepReopened {
        step: String,
        job_id: uuid::Uuid,
        previous: StepStatus,
        version: i64,
    },
    /// On a waiting step: the current states of its prerequisites (read by
    /// the ledger under the parent's lock).
    Resolve {
        prerequisites: Vec<(String, super::model::JobState)>,
        /// `workflow cancel` was asked for: the step is cancelled, whatever
        /// its policy, instead of released.
        workflow_cancelled: bool,
    },
    /// `prerequisites` as for `Resolve`: a held step goes only once none is
    /// still open (as under the `run` policy).
    ReleaseHold {
        operator: String,
        note: String,
        prerequisites: Vec<(String, super::model::JobState)>,
    },
    /// On a parent: records that its open steps are being cancelled (the
    /// ledger then cancels each one, with the usual cancel semantics).
    CancelWorkflow {
        note: Option<String>,
    },
}

impl Command {
    /// Stable name, as recorded for refused writes.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Claim { .. } => "claim",
            Command::Heartbeat { .. } => "heartbeat",
            Command::Progress { .. } => "progress",
            Command::Complete { .. } => "complete",
            Command::Submit { .. } => "submit",
            Command::Fail { .. } => "fail",
            Command::ConfirmCancel { .. } => "confirm_cancel",
            Command::Release { .. } => "release",
            Command::Snooze { .. } => "snooze",
            Command::Observe { .. } => "observe",
            Command::Cancel { .. } => "cancel",
            Command::Receipt { .. } => "receipt",
            Command::Replay { .. } => "replay",
            Command::ResolveByOperator { .. } => "resolve_by_operator",
            Command::Annotate { .. } => "annotate",
            Command::Expire => "expire",
            Command::Purge => "purge",
            Command::StepFinished { .. } => "step_finished",
            Command::StepReopened { .. } => "step_reopened",
            Command::Resolve { .. } => "resolve",
            Command::ReleaseHold { .. } => "release_hold",
            Command::CancelWorkflow { .. } => "cancel_workflow",
        }
    }

    /// The generation the writer claims, for fenced commands.
    pub fn fence(&self) -> Option<Fence> {
        match self {
            Command::Heartbeat { fence, .. }
            | Command::Progress { fence, .. }
            | Command::Complete { fence, .. }
            | Command::Submit { fence, .. }
            | Command::Fail { fence, .. }
            | Command::ConfirmCancel { fence }
            | Command::Release { fence }
            | Command::Snooze { fence, .. } => Some(*fence),
            Command::Observe { fence, .. } => *fence,
            _ => None,
        }
    }
}

/// A new job as the caller describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct NewJob {
    pub queue: String,
    pub kind: String,
    pub job_key: Option<String>,
    pub payload: Value,
    pub priority: i16,
    /// `None` means now (by the database clock).
    pub run_at: Option<DateTime<Utc>>,
    pub delay_ms: Option<i64>,
    /// `None`: the policy registered for the job's (queue, kind), else the default.
    pub policy: Option<Policy>,
    /// Jobs of the queue with the same key share a concurrency limit's slots.
    pub concurrency_key: Option<String>,
    /// With a `job_key`: how long the key names this job (see
    /// docs/admission.md); `None`, as before, until the job is purged.
    pub unique_for_ms: Option<i64>,
}

/// Facts from outside the pure function: the database clock, who acts, and a
/// random sample for jitter (so `decide` itself stays deterministic).
#[derive(Clone, Debug)]
pub struct Ctx {
    pub now: DateTime<Utc>,
    pub actor: String,
    pub jitter: f64,
    /// The trace context of the span deciding (W3C `traceparent`), when
    /// tracing is on; only an enqueue keeps it (in its event).
    pub trace: Option<String>,
}

wire_enum!(
    /// The answer to every fenced write. Exactly one applies.
    Outcome {
        Committed => "committed",
        AlreadyCommitted => "already_committed",
        Conflict => "conflict",
        Stale => "stale",
        InvalidTransition => "invalid_transition",
    }
);

/// Why `decide` produced no event. Nothing is written for a rejection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub outcome: Outcome,
    pub detail: String,
}

impl Rejection {
    pub fn already_committed(detail: impl Into<String>) -> Self {
        Rejection {
            outcome: Outcome::AlreadyCommitted,
            detail: detail.into(),
        }
    }
    pub fn conflict(detail: impl Into<String>) -> Self {
        Rejection {
            outcome: Outcome::Conflict,
            detail: detail.into(),
        }
    }
    pub fn stale(detail: impl Into<String>) -> Self {
        Rejection {
            outcome: Outcome::Stale,
            detail: detail.into(),
        }
    }
    pub fn invalid(detail: impl Into<String>) -> Self {
        Rejection {
            outcome: Outcome::InvalidTransition,
            detail: detail.into(),
        }
    }
}
