//! JSON lines on stdout; exit codes.

use serde_json::{json, Value};

use jobledger::domain::{digest::fmt_time, Job, Outcome};
use jobledger::ledger::{Enqueued, LedgerError, WriteResult};
use jobledger::store::TombstoneRow;

pub const OK: i32 = 0;
pub const FAILURE: i32 = 1;
pub const BAD_INPUT: i32 = 2;
pub const STALE: i32 = 3;
pub const CONFLICT: i32 = 4;
pub const INVALID_TRANSITION: i32 = 5;
pub const NOT_FOUND: i32 = 6;

pub fn line(v: &Value) {
    println!("{v}");
}

pub fn outcome_code(o: Outcome) -> i32 {
    match o {
        Outcome::Committed | Outcome::AlreadyCommitted => OK,
        Outcome::Stale => STALE,
        Outcome::Conflict => CONFLICT,
        Outcome::InvalidTransition => INVALID_TRANSITION,
    }
}

pub fn error_code(e: &anyhow::Error) -> i32 {
    match e.downcast_ref::<LedgerError>() {
        Some(LedgerError::BadInput(_) | LedgerError::TooLarge { .. }) => BAD_INPUT,
        Some(LedgerError::KeyConflict { .. }) => CONFLICT,
        Some(LedgerError::NotFound(_)) => NOT_FOUND,
        _ if e.downcast_ref::<BadInput>().is_some() => BAD_INPUT,
        _ => FAILURE,
    }
}

/// Bad input found by the CLI itself (unreadable JSON argument, ...).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// The job's current state, as `show` prints it.
pub fn job_json(j: &Job) -> Value {
    let t = |o: Option<chrono::DateTime<chrono::Utc>>| o.map(fmt_time);
    json!({
        "job_id": j.job_id, "queue": j.queue, "kind": j.kind, "key": j.job_key,
        "state": j.state, "reason": j.reason, "epoch": j.epoch, "token": j.token, "run": j.run,
        "attempt": j.attempt, "max_attempts": j.policy.max_attempts, "priority": j.priority,
        "next_action": j.next_action, "run_at": fmt_time(j.run_at), "lease_until": t(j.lease_until),
        "holder": j.holder, "step": j.step, "receipt_id": j.receipt_id,
        "receipt_deadline": t(j.receipt_deadline), "result": j.result, "last_error": j.last_error,
        "payload": j.payload, "version": j.version,
        "created_at": fmt_time(j.created_at), "updated_at": fmt_time(j.updated_at),
    })
}

/// A fenced write's answer: {outcome, job_id, state, ...}.
pub fn write_json(r: &WriteResult) -> Value {
    let mut v = json!({ "outcome": r.outcome, "job_id": r.job_id });
    let o = v.as_object_mut().expect("object");
    if let Some(j) = &r.job {
        o.insert("state".into(), json!(j.state));
        o.insert("reason".into(), json!(j.reason));
        o.insert("epoch".into(), json!(j.epoch));
        o.insert("token".into(), json!(j.token));
        o.insert("attempt".into(), json!(j.attempt));
        if j.state == jobledger::domain::JobState::Queued {
            o.insert("run_at".into(), json!(fmt_time(j.run_at)));
        }
        if let Some(until) = j.lease_until {
            o.insert("lease_until".into(), json!(fmt_time(until)));
        }
    }
    if r.purged {
        o.insert("purged".into(), json!(true));
    }
    if let Some(p) = r.position {
        o.insert("position".into(), json!(p));
    }
    if let Some(d) = &r.detail {
        o.insert("detail".into(), json!(d));
    }
    v
}

/// What is left of a purged job, as `show` and `GET /v1/jobs/{id}` print it.
pub fn tombstone_json(t: &TombstoneRow) -> Value {
    json!({
        "job_id": t.job_id, "state": t.state, "purged": true, "purged_at": fmt_time(t.purged_at),
        "queue": t.queue, "key": t.job_key, "epoch": t.epoch, "token": t.token, "version": t.version,
    })
}

/// An enqueue's answer, as `enqueue` and `POST /v1/jobs` print it.
pub fn enqueued_json(e: &Enqueued) -> Value {
    json!({
        "job_id": e.job.job_id, "epoch": e.job.epoch, "token": e.job.token,
        "state": e.job.state, "created": e.created, "position": e.position,
    })
}
