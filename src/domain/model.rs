//! States, policies and the job projection. Pure data, no I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::reason::Reason;
use super::workflow::Membership;

/// Declares a string-backed enum with a stable wire name per variant.
/// Wire names are a contract (stored in the log, sent to Kafka): never reuse one.
macro_rules! wire_enum {
    ($(#[$m:meta])* $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ::serde::Serialize, ::serde::Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            pub fn parse(text: &str) -> Option<Self> {
                match text { $($text => Some($name::$variant),)+ _ => None }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
pub(crate) use wire_enum;

wire_enum!(
    /// The one state a job is in. Each has exactly one meaning; there are no flags.
    JobState {
        Queued => "queued",
        Leased => "leased",
        CancelRequested => "cancel_requested",
        AwaitingReceipt => "awaiting_receipt",
        Succeeded => "succeeded",
        Cancelled => "cancelled",
        Dead => "dead",
        // A workflow step whose prerequisites have not all succeeded.
        Waiting => "waiting",
        // A workflow parent: its steps are open and none ended badly.
        Running => "running",
        // A workflow parent: a step ended dead or cancelled, others are open.
        Failing => "failing",
    }
);

impl JobState {
    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Cancelled | JobState::Dead)
    }

    /// States in which a worker holds a lease and may write through its token.
    pub fn is_held(self) -> bool {
        matches!(self, JobState::Leased | JobState::CancelRequested)
    }

    /// The states only a workflow parent takes (and the terminal ones).
    pub fn is_parent_state(self) -> bool {
        matches!(self, JobState::Running | JobState::Failing) || self.is_terminal()
    }
}

wire_enum!(
    /// What the holder of a lease must do first.
    NextAction {
        Execute => "execute",
        Reconcile => "reconcile",
    }
);

wire_enum!(
    /// What happens to a lease that expired (per job kind).
    ExpiryPolicy {
        Reconcile => "reconcile",
        Requeue => "requeue",
        Dead => "dead",
    }
);

wire_enum!(
    /// What happens when no receipt arrived by its deadline.
    ReceiptPolicy {
        Dead => "dead",
        Reconcile => "reconcile",
    }
);

wire_enum!(
    /// Retry decisions are made on this class, never on error text.
    ErrorClass {
        Transient => "transient",
        Permanent => "permanent",
    }
);

wire_enum!(
    /// The write that ended a token's tenure; with its digest it answers
    /// `already_committed` versus `conflict` for a retried request.
    ReleaseOp {
        Complete => "complete",
        Submit => "submit",
        Fail => "fail",
        ConfirmCancel => "confirm_cancel",
        Release => "release",
        Snooze => "snooze",
    }
);

wire_enum!(
    ReceiptStatus {
        Succeeded => "succeeded",
        Failed => "failed",
        Pending => "pending",
    }
);

/// Per-job retry and expiry policy, fixed at enqueue (copied into the
/// `enqueued` event so replay never depends on configuration that changed later).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub max_attempts: i32,
    pub backoff_base_ms: i64,
    pub backoff_cap_ms: i64,
    pub on_lease_expiry: ExpiryPolicy,
    pub receipt_timeout_ms: i64,
    pub on_receipt_timeout: ReceiptPolicy,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            max_attempts: 5,
            backoff_base_ms: 1_000,
            backoff_cap_ms: 300_000,
            on_lease_expiry: ExpiryPolicy::Reconcile,
            receipt_timeout_ms: 3_600_000,
            on_receipt_timeout: ReceiptPolicy::Dead,
        }
    }
}

impl Policy {
    /// Delay before retry number `attempt` (1-based): exponential, capped, with
    /// "equal jitter" so a batch failing together does not wake together, yet
    /// never retries sooner than half the nominal delay.
    pub fn backoff_ms(&self, attempt: i32, jitter_unit: f64) -> i64 {
        let exp = (attempt.max(1) - 1).min(40) as u32;
        let nominal = self
            .backoff_base_ms
            .saturating_mul(1i64.checked_shl(exp).unwrap_or(i64::MAX))
            .min(self.backoff_cap_ms)
            .max(0);
        let half = nominal / 2;
        half + ((nominal - half) as f64 * jitter_unit.clamp(0.0, 1.0)) as i64
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    pub token: i64,
    pub op: ReleaseOp,
    pub digest: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastError {
    pub class: ErrorClass,
    pub code: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The current-state projection of one job: exactly what folding its events
/// with `apply` yields, and exactly what `jobledger.jobs` stores.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub job_id: Uuid,
    pub queue: String,
    pub kind: String,
    pub job_key: Option<String>,
    pub epoch: i64,
    pub token: i64,
    pub run: i32,
    pub attempt: i32,
    pub state: JobState,
    pub priority: i16,
    pub payload: Value,
    pub payload_digest: String,
    pub policy: Policy,
    pub run_at: DateTime<Utc>,
    pub lease_until: Option<DateTime<Utc>>,
    pub holder: Option<String>,
    pub next_action: NextAction,
    pub step: Option<String>,
    pub receipt_id: Option<String>,
    pub receipt_deadline: Option<DateTime<Utc>>,
    pub result: Option<Value>,
    pub release: Option<Release>,
    pub last_error: Option<LastError>,
    pub reason: Reason,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub version: i64,
    /// Hex of the hash of the job's latest event: the head of its chain.
    pub last_hash: String,
    /// A workflow's parent or one of its steps (from the `enqueued` event).
    pub workflow: Option<Membership>,
    /// Its concurrency key and uniqueness window (from the `enqueued` event).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<super::admission::Admission>,
    /// The trace the job belongs to (from its `enqueued` event): its claim
    /// and handler continue it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}
