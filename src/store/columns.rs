//! Rows as typed column arrays, for `UNNEST` inserts and updates: one
//! statement per batch, and far cheaper for the server than parsing JSON
//! records (measured: see docs/benchmarks.md).

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::rows::{EventRow, JobRow};

/// `$first::uuid[], $first+1::text[], ...` for the job columns, in order.
pub const JOB_TYPES: &[&str] = &[
    "uuid",
    "text",
    "text",
    "text",
    "int8",
    "int8",
    "int4",
    "int4",
    "text",
    "int2",
    "jsonb",
    "text",
    "jsonb",
    "timestamptz",
    "timestamptz",
    "text",
    "text",
    "text",
    "text",
    "timestamptz",
    "jsonb",
    "jsonb",
    "jsonb",
    "text",
    "timestamptz",
    "timestamptz",
    "int8",
    "text",
    "jsonb",
    "jsonb",
    "text",
];

pub const EVENT_TYPES: &[&str] = &[
    "uuid",
    "int8",
    "text",
    "text",
    "text",
    "text",
    "text",
    "text",
    "int8",
    "int8",
    "int4",
    "int4",
    "jsonb",
    "timestamptz",
    "text",
    "text",
    "int2",
    "text",
];

/// `UNNEST($from::t1[], ...)` over `types`.
pub fn unnest(types: &[&str], from: usize) -> String {
    let args: Vec<String> = types
        .iter()
        .enumerate()
        .map(|(i, t)| format!("${}::{t}[]", from + i))
        .collect();
    format!("UNNEST({})", args.join(", "))
}

#[derive(Default)]
pub struct JobArrays {
    pub job_id: Vec<Uuid>,
    pub queue: Vec<String>,
    pub kind: Vec<String>,
    pub job_key: Vec<Option<String>>,
    pub epoch: Vec<i64>,
    pub token: Vec<i64>,
    pub run: Vec<i32>,
    pub attempt: Vec<i32>,
    pub state: Vec<String>,
    pub priority: Vec<i16>,
    pub payload: Vec<Value>,
    pub payload_digest: Vec<String>,
    pub policy: Vec<Value>,
    pub run_at: Vec<DateTime<Utc>>,
    pub lease_until: Vec<Option<DateTime<Utc>>>,
    pub holder: Vec<Option<String>>,
    pub next_action: Vec<String>,
    pub step: Vec<Option<String>>,
    pub receipt_id: Vec<Option<String>>,
    pub receipt_deadline: Vec<Option<DateTime<Utc>>>,
    pub result: Vec<Option<Value>>,
    pub release: Vec<Option<Value>>,
    pub last_error: Vec<Option<Value>>,
    pub reason: Vec<String>,
    pub created_at: Vec<DateTime<Utc>>,
    pub updated_at: Vec<DateTime<Utc>>,
    pub version: Vec<i64>,
    pub last_hash: Vec<String>,
    pub workflow: Vec<Option<Value>>,
    pub admission: Vec<Option<Value>>,
    pub traceparent: Vec<Option<String>>,
}

impl JobArrays {
    pub fn of(rows: Vec<JobRow>) -> Self {
        let mut a = JobArrays::default();
        for r in rows {
            a.job_id.push(r.job_id);
            a.queue.push(r.queue);
            a.kind.push(r.kind);
            a.job_key.push(r.job_key);
            a.epoch.push(r.epoch);
            a.token.push(r.token);
            a.run.push(r.run);
            a.attempt.push(r.attempt);
            a.state.push(r.state);
            a.priority.push(r.priority);
            a.payload.push(r.payload);
            a.payload_digest.push(r.payload_digest);
            a.policy.push(r.policy);
            a.run_at.push(r.run_at);
            a.lease_until.push(r.lease_until);
            a.holder.push(r.holder);
            a.next_action.push(r.next_action);
            a.step.push(r.step);
            a.receipt_id.push(r.receipt_id);
            a.receipt_deadline.push(r.receipt_deadline);
            a.result.push(r.result);
            a.release.push(r.release);
            a.last_error.push(r.last_error);
            a.reason.push(r.reason);
            a.created_at.push(r.created_at);
            a.updated_at.push(r.updated_at);
            a.version.push(r.version);
            a.last_hash.push(r.last_hash);
            a.workflow.push(r.workflow);
            a.admission.push(r.admission);
            a.traceparent.push(r.traceparent);
        }
        a
    }

    /// Binds every column, in `JOB_COLUMNS` order.
    pub fn bind_all<'q, O>(
        self,
        q: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        q.bind(self.job_id)
            .bind(self.queue)
            .bind(self.kind)
            .bind(self.job_key)
            .bind(self.epoch)
            .bind(self.token)
            .bind(self.run)
            .bind(self.attempt)
            .bind(self.state)
            .bind(self.priority)
            .bind(self.payload)
            .bind(self.payload_digest)
            .bind(self.policy)
            .bind(self.run_at)
            .bind(self.lease_until)
            .bind(self.holder)
            .bind(self.next_action)
            .bind(self.step)
            .bind(self.receipt_id)
            .bind(self.receipt_deadline)
            .bind(self.result)
            .bind(self.release)
            .bind(self.last_error)
            .bind(self.reason)
            .bind(self.created_at)
            .bind(self.updated_at)
            .bind(self.version)
            .bind(self.last_hash)
            .bind(self.workflow)
            .bind(self.admission)
            .bind(self.traceparent)
    }
}

#[derive(Default)]
pub struct EventArrays {
    pub job_id: Vec<Uuid>,
    pub version: Vec<i64>,
    pub kind: Vec<String>,
    pub from_state: Vec<Option<String>>,
    pub to_state: Vec<String>,
    pub reason: Vec<String>,
    pub error_class: Vec<Option<String>>,
    pub actor: Vec<String>,
    pub epoch: Vec<i64>,
    pub token: Vec<i64>,
    pub attempt: Vec<i32>,
    pub run: Vec<i32>,
    pub data: Vec<Value>,
    pub recorded_at: Vec<DateTime<Utc>>,
    pub prev_hash: Vec<Option<String>>,
    pub hash: Vec<String>,
    pub schema: Vec<i16>,
    pub trace: Vec<Option<String>>,
}

impl EventArrays {
    pub fn of(rows: Vec<EventRow>) -> Self {
        let mut a = EventArrays::default();
        for r in rows {
            a.job_id.push(r.job_id);
            a.version.push(r.version);
            a.kind.push(r.kind);
            a.from_state.push(r.from_state);
            a.to_state.push(r.to_state);
            a.reason.push(r.reason);
            a.error_class.push(r.error_class);
            a.actor.push(r.actor);
            a.epoch.push(r.epoch);
            a.token.push(r.token);
            a.attempt.push(r.attempt);
            a.run.push(r.run);
            a.data.push(r.data);
            a.recorded_at.push(r.recorded_at);
            a.prev_hash.push(r.prev_hash);
            a.hash.push(r.hash);
            a.schema.push(r.schema);
            a.trace.push(r.trace);
        }
        a
    }

    /// Binds every column, in `EVENT_COLUMNS` order.
    pub fn bind_all<'q, O>(
        self,
        q: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        q.bind(self.job_id)
            .bind(self.version)
            .bind(self.kind)
            .bind(self.from_state)
            .bind(self.to_state)
            .bind(self.reason)
            .bind(self.error_class)
            .bind(self.actor)
            .bind(self.epoch)
            .bind(self.token)
            .bind(self.attempt)
            .bind(self.run)
            .bind(self.data)
            .bind(self.recorded_at)
            .bind(self.prev_hash)
            .bind(self.hash)
            .bind(self.schema)
            .bind(self.trace)
    }
}
