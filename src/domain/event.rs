//! Transition events: the source of truth. A job's state is the fold of these.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::admission::Admission;
use super::model::{ErrorClass, JobState, NextAction, Policy, ReceiptStatus};
use super::reason::Reason;
use super::workflow::{StepStatus, WorkflowTie};

/// What happened, with exactly the data `apply` needs to reproduce the
/// projection. The variant name is the event `type`; the fields are `data`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data", rename_all = "snake_case")]
pub enum EventBody {
    Enqueued {
        queue: String,
        kind: String,
        job_key: Option<String>,
        payload: Value,
        payload_digest: String,
        priority: i16,
        run_at: DateTime<Utc>,
        policy: Policy,
        /// Absent for a job outside any workflow, so those events (and
        /// their hashes) are exactly what they were before workflows.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        workflow: Option<Box<WorkflowTie>>,
        /// Absent for a job with no concurrency key and no uniqueness
        /// window (issue 13), for the same reason.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        admission: Option<Admission>,
        /// The W3C trace context of the span that enqueued the job (issue
        /// 16), so its claim, handler and writes continue that trace.
        /// Absent when tracing was off, for the same reason as above.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        traceparent: Option<String>,
    },
    Claimed {
        holder: String,
        lease_until: DateTime<Utc>,
        next_action: NextAction,
    },
    TakenOver {
        holder: String,
        previous_holder: Option<String>,
        lease_until: DateTime<Utc>,
    },
    LeaseExtended {
        lease_until: DateTime<Utc>,
    },
    Progressed {
        step: String,
        lease_until: Option<DateTime<Utc>>,
    },
    Succeeded {
        result: Option<Value>,
        digest: String,
    },
    Submitted {
        receipt_id: String,
        receipt_deadline: DateTime<Utc>,
        digest: String,
    },
    Failed {
        code: String,
        message: Option<String>,
        digest: String,
        /// Set when the job goes back to `queued`.
        run_at: Option<DateTime<Utc>>,
        next_action: NextAction,
    },
    CancelRequested {
        note: Option<String>,
    },
    Cancelled {
        note: Option<String>,
    },
    CancelConfirmed {
        digest: String,
    },
    CancelRefused {
        note: Option<String>,
    },
    ReceiptResolved {
        receipt_id: String,
        status: ReceiptStatus,
        run_at: Option<DateTime<Utc>>,
    },
    ReceiptTimedOut {
        receipt_id: Option<String>,
    },
    LeaseExpired {
        previous_holder: Option<String>,
    },
    Released {
        digest: String,
    },
    Snoozed {
        run_at: DateTime<Utc>,
        digest: String,
    },
    Replayed {
        operator: String,
        note: String,
    },
    Observed {
        key: String,
        data: Value,
        digest: String,
        /// The fence of the holder that observed, if any (schema 2; schema
        /// 1 stored it as `by_epoch` and `by_token`: see `domain::schema`).
        by: Option<super::command::Fence>,
    },
    Purged {},
    /// On a parent: one step ended (its final state and version).
    StepFinished {
        step: String,
        job_id: Uuid,
        status: StepStatus,
        version: i64,
        reason: Reason,
    },
    /// On a parent: a step that had ended is open again (an operator's
    /// replay of a dead step).
    StepReopened {
        step: String,
        job_id: Uuid,
        previous: StepStatus,
        version: i64,
    },
    /// On a waiting step: its prerequisites decided (queued, cancelled, or
    /// held for a person); `failed` names the prerequisite that ended badly.
    DependenciesResolved {
        failed: Option<String>,
    },
    /// On a held step: an operator lets it run after all.
    HoldReleased {
        operator: String,
        note: String,
    },
    /// An operator's verdict on a job nothing else will finish (dead, or
    /// awaiting a receipt that will not come): they checked the outside world
    /// by hand and record how it ended (`to_state`), why, and their evidence.
    ResolvedByOperator {
        operator: String,
        note: String,
        evidence: Value,
        evidence_digest: String,
    },
    /// A correction beside an earlier event of the same job: it changes no
    /// state, and the corrected event stays as the judgement of its time.
    Annotated {
        operator: String,
        corrects_position: i64,
        corrects_version: i64,
        note: String,
    },
}

impl EventBody {
    pub fn type_name(&self) -> &'static str {
        match self {
            EventBody::Enqueued { .. } => "enqueued",
            EventBody::Claimed { .. } => "claimed",
            EventBody::TakenOver { .. } => "taken_over",
            EventBody::LeaseExtended { .. } => "lease_extended",
            EventBody::Progressed { .. } => "progressed",
            EventBody::Succeeded { .. } => "succeeded",
            EventBody::Submitted { .. } => "submitted",
            EventBody::Failed { .. } => "failed",
            EventBody::CancelRequested { .. } => "cancel_requested",
            EventBody::Cancelled { .. } => "cancelled",
            EventBody::CancelConfirmed { .. } => "cancel_confirmed",
            EventBody::CancelRefused { .. } => "cancel_refused",
            EventBody::ReceiptResolved { .. } => "receipt_resolved",
            EventBody::ReceiptTimedOut { .. } => "receipt_timed_out",
            EventBody::LeaseExpired { .. } => "lease_expired",
            EventBody::Released { .. } => "released",
            EventBody::Snoozed { .. } => "snoozed",
            EventBody::Replayed { .. } => "replayed",
            EventBody::Observed { .. } => "observed",
            EventBody::Purged {} => "purged",
            EventBody::StepFinished { .. } => "step_finished",
            EventBody::StepReopened { .. } => "step_reopened",
            EventBody::DependenciesResolved { .. } => "dependencies_resolved",
            EventBody::HoldReleased { .. } => "hold_released",
            EventBody::ResolvedByOperator { .. } => "resolved_by_operator",
            EventBody::Annotated { .. } => "annotated",
        }
    }

    /// Splits into the `type` and `data` columns.
    pub fn to_parts(&self) -> (String, Value) {
        let mut tagged = serde_json::to_value(self).expect("event bodies always serialise");
        let data = tagged
            .get_mut("data")
            .map(Value::take)
            .unwrap_or(Value::Object(Default::default()));
        (self.type_name().to_string(), data)
    }

    /// Rebuilds from the `type` and `data` columns, reading `data` where it
    /// lies (no copy).
    pub fn from_parts(kind: &str, data: &Value) -> Result<Self, serde_json::Error> {
        Self::tagged(&Value::String(kind.into()), data).or_else(|_| Self::buffered(kind, data.clone()))
    }

    /// `from_parts`, consuming the data.
    pub fn from_parts_owned(kind: &str, data: Value) -> Result<Self, serde_json::Error> {
        match Self::tagged(&Value::String(kind.into()), &data) {
            Ok(body) => Ok(body),
            Err(_) => Self::buffered(kind, data),
        }
    }

    /// The reading through serde's buffered form, which `tagged` falls back
    /// to when it refuses: that form also takes a few shapes the writer never
    /// makes (a unit variant as `{"execute": {}}`, a variant by its index),
    /// and an edited event in such a shape must read as it always did, so
    /// that `verify` names its hash, not its parse (review of issue 15).
    fn buffered(kind: &str, data: Value) -> Result<Self, serde_json::Error> {
        let mut m = serde_json::Map::new();
        m.insert("type".into(), Value::String(kind.into()));
        m.insert("data".into(), data);
        serde_json::from_value(Value::Object(m))
    }

    /// The body read from a map that yields `type` before `data`. A
    /// `serde_json::Map` sorts `data` first, and an adjacently tagged enum
    /// that meets its content before its tag buffers all of it in serde's
    /// intermediate form and then reads it again (issue 15: rebuilds).
    fn tagged(tag: &Value, data: &Value) -> Result<Self, serde_json::Error> {
        // By value: it also refuses a key left over.
        Self::deserialize(serde::de::value::MapDeserializer::new(
            [("type", tag), ("data", data)].into_iter(),
        ))
    }
}

/// One appended event. `position` is assigned by the database and is not part
/// of the hash (it only orders the global log).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub job_id: Uuid,
    pub version: i64,
    pub epoch: i64,
    pub token: i64,
    pub attempt: i32,
    pub run: i32,
    pub from_state: Option<JobState>,
    pub to_state: JobState,
    pub reason: Reason,
    pub error_class: Option<ErrorClass>,
    pub actor: String,
    pub recorded_at: DateTime<Utc>,
    /// `type` and `data`, at the top level when serialised.
    #[serde(flatten)]
    pub body: EventBody,
    pub prev_hash: Option<String>,
    pub hash: String,
}
