//! The Kafka message of one event: key, headers and JSON body (schema 1).
//!
//! Key: `job_key` if the job has one, else `job_id`, so one job's events
//! (and a reused key's later lifecycles) stay in one partition, in order.
//! Headers: `epoch`, `token`, `version`, `position`, `type`, `schema` (decimal
//! text). Body: the whole event, hash included, plus queue and key.

use serde_json::Value;

use crate::domain::digest::fmt_time;
use crate::reader::LogEvent;

pub const SCHEMA: i64 = 1;

pub struct Message {
    pub key: String,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

/// The body, serialised straight from the stored row (no parsing into the
/// domain type and back: the relay's hot path).
#[derive(serde::Serialize)]
struct Body<'a> {
    schema: i64,
    job_id: &'a uuid::Uuid,
    job_key: Option<&'a str>,
    queue: &'a str,
    version: i64,
    position: i64,
    epoch: i64,
    token: i64,
    attempt: i32,
    run: i32,
    #[serde(rename = "type")]
    kind: &'a str,
    from_state: Option<&'a str>,
    to_state: &'a str,
    reason: &'a str,
    error_class: Option<&'a str>,
    actor: &'a str,
    recorded_at: String,
    data: &'a Value,
    prev_hash: Option<&'a str>,
    hash: &'a str,
}

pub fn message(e: &LogEvent, queue: &str, job_key: Option<&str>) -> Message {
    let r = &e.row;
    let body = Body {
        schema: SCHEMA,
        job_id: &r.job_id,
        job_key,
        queue,
        version: r.version,
        position: e.position,
        epoch: r.epoch,
        token: r.token,
        attempt: r.attempt,
        run: r.run,
        kind: &r.kind,
        from_state: r.from_state.as_deref(),
        to_state: &r.to_state,
        reason: &r.reason,
        error_class: r.error_class.as_deref(),
        actor: &r.actor,
        recorded_at: fmt_time(r.recorded_at),
        data: &r.data,
        prev_hash: r.prev_hash.as_deref(),
        hash: &r.hash,
    };
    Message {
        key: job_key.map_or_else(|| r.job_id.to_string(), str::to_string),
        headers: vec![
            ("epoch", r.epoch.to_string()),
            ("token", r.token.to_string()),
            ("version", r.version.to_string()),
            ("position", e.position.to_string()),
            ("type", r.kind.clone()),
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
