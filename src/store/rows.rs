//! Row shapes of `jobledger.jobs` / `events` / `tombstones`, and their
//! conversion to and from the domain types.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::StoreError;
use crate::domain::{Event, EventBody, Job, JobState, NextAction, Reason};

pub const JOB_COLUMNS: &str = "job_id, queue, kind, job_key, epoch, token, run, attempt, state, priority, \
     payload, payload_digest, policy, run_at, lease_until, holder, next_action, step, receipt_id, \
     receipt_deadline, result, release, last_error, reason, created_at, updated_at, version, last_hash, workflow, admission, traceparent";

pub const EVENT_COLUMNS: &str = "job_id, version, type, from_state, to_state, reason, error_class, actor, \
     epoch, token, attempt, run, data, recorded_at, prev_hash, hash, schema, trace";

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct JobRow {
    pub job_id: Uuid,
    pub queue: String,
    pub kind: String,
    pub job_key: Option<String>,
    pub epoch: i64,
    pub token: i64,
    pub run: i32,
    pub attempt: i32,
    pub state: String,
    pub priority: i16,
    pub payload: Value,
    pub payload_digest: String,
    pub policy: Value,
    pub run_at: DateTime<Utc>,
    pub lease_until: Option<DateTime<Utc>>,
    pub holder: Option<String>,
    pub next_action: String,
    pub step: Option<String>,
    pub receipt_id: Option<String>,
    pub receipt_deadline: Option<DateTime<Utc>>,
    pub result: Option<Value>,
    pub release: Option<Value>,
    pub last_error: Option<Value>,
    pub reason: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub version: i64,
    pub last_hash: String,
    pub workflow: Option<Value>,
    pub admission: Option<Value>,
    #[serde(default)]
    #[sqlx(default)]
    pub traceparent: Option<String>,
}

fn corrupt(what: &str, value: &str) -> StoreError {
    StoreError::Corrupt(format!("unknown {what} {value:?}"))
}

fn from_json<T: serde::de::DeserializeOwned>(what: &str, v: Option<Value>) -> Result<Option<T>, StoreError> {
    v.filter(|v| !v.is_null())
        .map(|v| serde_json::from_value(v).map_err(|e| StoreError::Corrupt(format!("{what}: {e}"))))
        .transpose()
}

pub(super) fn to_json<T: Serialize>(v: &Option<T>) -> Option<Value> {
    v.as_ref()
        .map(|v| serde_json::to_value(v).expect("domain values serialise"))
}

impl TryFrom<JobRow> for Job {
    type Error = StoreError;

    fn try_from(r: JobRow) -> Result<Job, StoreError> {
        Ok(Job {
            state: JobState::parse(&r.state).ok_or_else(|| corrupt("state", &r.state))?,
            next_action: NextAction::parse(&r.next_action)
                .ok_or_else(|| corrupt("next_action", &r.next_action))?,
            reason: Reason::parse(&r.reason).ok_or_else(|| corrupt("reason", &r.reason))?,
            policy: from_json("policy", Some(r.policy))?.ok_or_else(|| corrupt("policy", "null"))?,
            release: from_json("release", r.release)?,
            last_error: from_json("last_error", r.last_error)?,
            workflow: from_json("workflow", r.workflow)?,
            admission: from_json("admission", r.admission)?,
            traceparent: r.traceparent,
            job_id: r.job_id,
            queue: r.queue,
            kind: r.kind,
            job_key: r.job_key,
            epoch: r.epoch,
            token: r.token,
            run: r.run,
            attempt: r.attempt,
            priority: r.priority,
            payload: r.payload,
            payload_digest: r.payload_digest,
            run_at: r.run_at,
            lease_until: r.lease_until,
            holder: r.holder,
            step: r.step,
            receipt_id: r.receipt_id,
            receipt_deadline: r.receipt_deadline,
            // JSON null is no result, as the `succeeded` event reads back
            // (rows written before `decide` said so kept `null`; review of
            // issue 15).
            result: r.result.filter(|v| !v.is_null()),
            created_at: r.created_at,
            updated_at: r.updated_at,
            version: r.version,
            last_hash: r.last_hash,
        })
    }
}

impl From<&Job> for JobRow {
    fn from(j: &Job) -> JobRow {
        JobRow {
            job_id: j.job_id,
            queue: j.queue.clone(),
            kind: j.kind.clone(),
            job_key: j.job_key.clone(),
            epoch: j.epoch,
            token: j.token,
            run: j.run,
            attempt: j.attempt,
            state: j.state.as_str().to_string(),
            priority: j.priority,
            payload: j.payload.clone(),
            payload_digest: j.payload_digest.clone(),
            policy: serde_json::to_value(&j.policy).expect("policy serialises"),
            run_at: j.run_at,
            lease_until: j.lease_until,
            holder: j.holder.clone(),
            next_action: j.next_action.as_str().to_string(),
            step: j.step.clone(),
            receipt_id: j.receipt_id.clone(),
            receipt_deadline: j.receipt_deadline,
            result: j.result.clone(),
            release: to_json(&j.release),
            last_error: to_json(&j.last_error),
            reason: j.reason.as_str().to_string(),
            created_at: j.created_at,
            updated_at: j.updated_at,
            version: j.version,
            last_hash: j.last_hash.clone(),
            workflow: to_json(&j.workflow),
            admission: to_json(&j.admission),
            traceparent: j.traceparent.clone(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct EventRow {
    #[serde(default, skip_serializing)]
    #[sqlx(default)]
    pub position: i64,
    pub job_id: Uuid,
    pub version: i64,
    #[serde(rename = "type")]
    #[sqlx(rename = "type")]
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
    pub prev_hash: Option<String>,
    pub hash: String,
    /// The schema version `data` was written in (`domain::schema`); absent
    /// in what older versions exported or published: 1.
    #[serde(default = "schema_1")]
    pub schema: i16,
    /// The trace context of the span that wrote the event (W3C
    /// `traceparent`), when tracing was on. Telemetry, not history: outside
    /// the hash, never exported; the relay carries it as a Kafka header.
    #[serde(skip)]
    #[sqlx(default)]
    pub trace: Option<String>,
}

fn schema_1() -> i16 {
    1
}

impl EventRow {
    /// The hash of the event as stored (its data in its own schema): what
    /// the stored `hash` must equal.
    pub fn stored_hash(&self) -> String {
        crate::domain::digest::hash_stored(&crate::domain::digest::HashInput {
            job_id: &self.job_id.to_string(),
            version: self.version,
            epoch: self.epoch,
            token: self.token,
            attempt: self.attempt,
            run: self.run,
            from_state: self.from_state.as_deref(),
            to_state: &self.to_state,
            reason: &self.reason,
            error_class: self.error_class.as_deref(),
            actor: &self.actor,
            recorded_at: self.recorded_at,
            kind: &self.kind,
            data: &self.data,
            prev_hash: self.prev_hash.as_deref(),
            schema: self.schema,
        })
    }

    /// The event as the domain reads it today: its data upcast from the
    /// schema it was written in to the current one.
    pub fn to_event(&self) -> Result<Event, StoreError> {
        self.clone().into_event()
    }

    /// `to_event`, consuming the row (no copy of its data).
    pub fn into_event(mut self) -> Result<Event, StoreError> {
        let data = std::mem::take(&mut self.data);
        self.into_event_with(std::borrow::Cow::Owned(data))
    }

    /// `into_event` with the event's data given apart from the row (whose
    /// own is ignored): read where it lies, with no copy, when it is in the
    /// current schema. `jobs_rebuilt` folds borrowed events.
    pub fn into_event_with(self, data: std::borrow::Cow<'_, Value>) -> Result<Event, StoreError> {
        use crate::domain::schema::{upcast_owned, CURRENT};
        use crate::domain::ErrorClass;
        let state = |s: &str| JobState::parse(s).ok_or_else(|| corrupt("state", s));
        let body = match data {
            std::borrow::Cow::Borrowed(d) if self.schema == CURRENT => {
                EventBody::from_parts(&self.kind, d).map_err(|e| e.to_string())
            }
            d => upcast_owned(self.schema, &self.kind, d.into_owned())
                .map_err(|e| e.to_string())
                .and_then(|data| EventBody::from_parts_owned(&self.kind, data).map_err(|e| e.to_string())),
        }
        .map_err(|e| StoreError::Corrupt(format!("event {} v{}: {e}", self.job_id, self.version)))?;
        Ok(Event {
            job_id: self.job_id,
            version: self.version,
            epoch: self.epoch,
            token: self.token,
            attempt: self.attempt,
            run: self.run,
            from_state: self.from_state.as_deref().map(state).transpose()?,
            to_state: state(&self.to_state)?,
            reason: Reason::parse(&self.reason).ok_or_else(|| corrupt("reason", &self.reason))?,
            error_class: self
                .error_class
                .as_deref()
                .map(|c| ErrorClass::parse(c).ok_or_else(|| corrupt("error class", c)))
                .transpose()?,
            actor: self.actor,
            recorded_at: self.recorded_at,
            body,
            prev_hash: self.prev_hash,
            hash: self.hash,
        })
    }
}

impl From<&Event> for EventRow {
    fn from(e: &Event) -> EventRow {
        let (kind, data) = e.body.to_parts();
        EventRow {
            position: 0,
            job_id: e.job_id,
            version: e.version,
            kind,
            from_state: e.from_state.map(|s| s.as_str().to_string()),
            to_state: e.to_state.as_str().to_string(),
            reason: e.reason.as_str().to_string(),
            error_class: e.error_class.map(|c| c.as_str().to_string()),
            actor: e.actor.clone(),
            epoch: e.epoch,
            token: e.token,
            attempt: e.attempt,
            run: e.run,
            data,
            recorded_at: e.recorded_at,
            prev_hash: e.prev_hash.clone(),
            hash: e.hash.clone(),
            schema: crate::domain::schema::CURRENT,
            trace: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct TombstoneRow {
    pub job_id: Uuid,
    pub queue: String,
    pub job_key: Option<String>,
    pub epoch: i64,
    pub token: i64,
    pub state: String,
    pub version: i64,
    pub last_hash: String,
    pub release: Option<Value>,
    pub purged_at: DateTime<Utc>,
}

impl TombstoneRow {
    pub fn of(job: &Job, purged_at: DateTime<Utc>) -> TombstoneRow {
        TombstoneRow {
            job_id: job.job_id,
            queue: job.queue.clone(),
            job_key: job.job_key.clone(),
            epoch: job.epoch,
            token: job.token,
            state: job.state.as_str().to_string(),
            version: job.version,
            last_hash: job.last_hash.clone(),
            release: to_json(&job.release),
            purged_at,
        }
    }
}
