//! Decoding a Kafka message into a job event (schemas 1 and 2 of the relay:
//! the `schema` header and body field are the stored event's schema
//! version, docs/schema.md; the envelope is the same in both).

use rdkafka::message::{BorrowedMessage, Headers, Message};
use serde_json::Value;

/// The newest event schema this crate decodes (it decodes every older one).
pub const SCHEMA: i64 = 2;

/// One job event as the relay published it. Every field a handler relies
/// on is checked at decode: a message that decodes can be applied (or is a
/// deterministic handler failure, dead-lettered), never a poison that stops
/// the consumer.
#[derive(Debug, Clone)]
pub struct JobEvent {
    /// The message key: `<queue>/<job_key>` (queue percent-escaped) when the
    /// job has a key, else its `job_id` (docs/log-reader.md).
    pub key: String,
    pub job_id: uuid::Uuid,
    pub epoch: i64,
    pub token: i64,
    pub version: i64,
    pub position: i64,
    pub kind: String,
    pub to_state: String,
    pub reason: String,
    pub hash: String,
    /// The schema version the event's `data` is written in.
    pub schema: i64,
    /// The whole event as JSON (job_id, states, reason, data, hash, ...).
    pub body: Value,
    pub partition: i32,
    pub offset: i64,
    /// The W3C trace context the relay sent (`traceparent` header), if any:
    /// the job's trace, for a handler that continues it by hand. With an
    /// OpenTelemetry layer installed, the handler already runs in a span
    /// of that trace (`jobledger.consume`).
    pub traceparent: Option<String>,
}

impl JobEvent {
    pub fn job_id(&self) -> uuid::Uuid {
        self.job_id
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("message has no key")]
    NoKey,
    #[error("key is not UTF-8")]
    KeyNotUtf8,
    #[error("missing header {0}")]
    MissingHeader(&'static str),
    #[error("header {0} is not an integer")]
    BadHeader(&'static str),
    #[error("unknown schema version {0}")]
    UnknownSchema(i64),
    #[error("message has no payload")]
    NoPayload,
    #[error("payload is not a JSON object: {0}")]
    NotJson(String),
    #[error("header {0} disagrees with the body")]
    Mismatch(&'static str),
    #[error("body field {0} is missing or malformed")]
    BadField(&'static str),
}

pub(crate) fn header(m: &BorrowedMessage<'_>, name: &'static str) -> Result<String, DecodeError> {
    let headers = m.headers().ok_or(DecodeError::MissingHeader(name))?;
    let h = headers
        .iter()
        .find(|h| h.key == name)
        .ok_or(DecodeError::MissingHeader(name))?;
    let v = h.value.ok_or(DecodeError::MissingHeader(name))?;
    String::from_utf8(v.to_vec()).map_err(|_| DecodeError::BadHeader(name))
}

fn int_header(m: &BorrowedMessage<'_>, name: &'static str) -> Result<i64, DecodeError> {
    header(m, name)?
        .trim()
        .parse()
        .map_err(|_| DecodeError::BadHeader(name))
}

/// Decodes, or says precisely why not (the message then goes to the
/// dead-letter table).
pub fn decode(m: &BorrowedMessage<'_>) -> Result<JobEvent, DecodeError> {
    decode_parts(
        m.key(),
        m.payload(),
        |name| int_header(m, name),
        |name| header(m, name),
        m.partition(),
        m.offset(),
    )
}

/// The decoding rules, independent of rdkafka's message type (fuzzed).
pub fn decode_parts(
    key: Option<&[u8]>,
    payload: Option<&[u8]>,
    int: impl Fn(&'static str) -> Result<i64, DecodeError>,
    text: impl Fn(&'static str) -> Result<String, DecodeError>,
    partition: i32,
    offset: i64,
) -> Result<JobEvent, DecodeError> {
    let schema = int("schema")?;
    if !(1..=SCHEMA).contains(&schema) {
        return Err(DecodeError::UnknownSchema(schema));
    }
    let key = std::str::from_utf8(key.ok_or(DecodeError::NoKey)?)
        .map_err(|_| DecodeError::KeyNotUtf8)?
        .to_string();
    let (epoch, token, version, position) = (int("epoch")?, int("token")?, int("version")?, int("position")?);
    let kind = text("type")?;
    // Only a valid trace context, in its normal form: the header is
    // untrusted bytes, handed to handlers as a parent.
    let traceparent = text(crate::trace::TRACEPARENT)
        .ok()
        .and_then(|v| crate::trace::context_of(&v))
        .and_then(|cx| crate::trace::traceparent_of(&cx));
    let payload = payload.ok_or(DecodeError::NoPayload)?;
    let body: Value = serde_json::from_slice(payload).map_err(|e| DecodeError::NotJson(e.to_string()))?;
    if !body.is_object() {
        return Err(DecodeError::NotJson("not an object".into()));
    }
    if body.get("schema").is_some_and(|s| s.as_i64() != Some(schema)) {
        return Err(DecodeError::Mismatch("schema"));
    }
    for (name, v) in [("epoch", epoch), ("token", token), ("version", version)] {
        if body.get(name).and_then(Value::as_i64) != Some(v) {
            return Err(DecodeError::Mismatch(name));
        }
    }
    if body.get("position").is_some_and(|p| p.as_i64() != Some(position)) {
        return Err(DecodeError::Mismatch("position"));
    }
    if body
        .get("type")
        .is_some_and(|t| t.as_str() != Some(kind.as_str()))
    {
        return Err(DecodeError::Mismatch("type"));
    }
    if version < 1 {
        return Err(DecodeError::BadField("version"));
    }
    if token < 0 {
        return Err(DecodeError::BadField("token"));
    }
    let text = |name: &'static str| -> Result<String, DecodeError> {
        match body.get(name).and_then(Value::as_str) {
            Some(s) if !s.is_empty() && !s.contains('\0') => Ok(s.to_string()),
            _ => Err(DecodeError::BadField(name)),
        }
    };
    let job_id = text("job_id")?
        .parse::<uuid::Uuid>()
        .map_err(|_| DecodeError::BadField("job_id"))?;
    let (to_state, reason, hash) = (text("to_state")?, text("reason")?, text("hash")?);
    if let Some(t) = body.get("recorded_at") {
        let ok = t
            .as_str()
            .is_some_and(|t| chrono::DateTime::parse_from_rfc3339(t).is_ok());
        if !ok {
            return Err(DecodeError::BadField("recorded_at"));
        }
    }
    for optional in ["queue", "job_key"] {
        if body
            .get(optional)
            .is_some_and(|v| !(v.is_null() || v.is_string()))
        {
            return Err(DecodeError::BadField(optional));
        }
    }
    Ok(JobEvent {
        key,
        job_id,
        epoch,
        token,
        version,
        position,
        kind,
        to_state,
        reason,
        hash,
        schema,
        body,
        partition,
        offset,
        traceparent,
    })
}
