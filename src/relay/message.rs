//! The Kafka message of one event: key, headers and JSON body (schema 1).
//!
//! Key: `job_key` if the job has one, else `job_id`, so one job's events
//! (and a reused key's later lifecycles) stay in one partition, in order.
//! Headers: `epoch`, `token`, `version`, `position`, `type`, `schema` (decimal
//! text). Body: the whole event, hash included, plus queue and key.

use serde_json::{json, Value};

use crate::domain::digest::fmt_time;
use crate::reader::LogEvent;

pub const SCHEMA: i64 = 1;

pub struct Message {
    pub key: String,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

pub fn message(e: &LogEvent, queue: &str, job_key: Option<&str>) -> Message {
    let ev = &e.event;
    let (kind, data) = ev.body.to_parts();
    let body = json!({
        "schema": SCHEMA,
        "job_id": ev.job_id,
        "job_key": job_key,
        "queue": queue,
        "version": ev.version,
        "position": e.position,
        "epoch": ev.epoch,
        "token": ev.token,
        "attempt": ev.attempt,
        "run": ev.run,
        "type": kind,
        "from_state": ev.from_state,
        "to_state": ev.to_state,
        "reason": ev.reason,
        "error_class": ev.error_class,
        "actor": ev.actor,
        "recorded_at": fmt_time(ev.recorded_at),
        "data": data,
        "prev_hash": ev.prev_hash,
        "hash": ev.hash,
    });
    Message {
        key: job_key.map_or_else(|| ev.job_id.to_string(), str::to_string),
        headers: vec![
            ("epoch", ev.epoch.to_string()),
            ("token", ev.token.to_string()),
            ("version", ev.version.to_string()),
            ("position", e.position.to_string()),
            ("type", kind),
            ("schema", SCHEMA.to_string()),
        ],
        body: serde_json::to_vec(&body).expect("json"),
    }
}

/// Rebuilds the event from a message body (the audit log check uses this).
pub fn event_of(body: &Value) -> Option<crate::domain::Event> {
    let kind = body.get("type")?.as_str()?;
    let data = body.get("data")?;
    Some(crate::domain::Event {
        job_id: serde_json::from_value(body.get("job_id")?.clone()).ok()?,
        version: body.get("version")?.as_i64()?,
        epoch: body.get("epoch")?.as_i64()?,
        token: body.get("token")?.as_i64()?,
        attempt: body.get("attempt")?.as_i64()? as i32,
        run: body.get("run")?.as_i64()? as i32,
        from_state: serde_json::from_value(body.get("from_state")?.clone()).ok()?,
        to_state: serde_json::from_value(body.get("to_state")?.clone()).ok()?,
        reason: serde_json::from_value(body.get("reason")?.clone()).ok()?,
        error_class: serde_json::from_value(body.get("error_class")?.clone()).ok()?,
        actor: body.get("actor")?.as_str()?.to_string(),
        recorded_at: chrono::DateTime::parse_from_rfc3339(body.get("recorded_at")?.as_str()?)
            .ok()?
            .to_utc(),
        body: crate::domain::EventBody::from_parts(kind, data).ok()?,
        prev_hash: body.get("prev_hash")?.as_str().map(str::to_string),
        hash: body.get("hash")?.as_str()?.to_string(),
    })
}
