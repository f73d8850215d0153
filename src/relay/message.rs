//! The Kafka message of one event: key, headers and JSON body (schema 1).
//!
//! Key: `<queue>/<job_key>` if the job has a key, else its `job_id`, so one
//! job's events (and a reused key's later lifecycles) stay in one partition,
//! in order, and jobs of two queues sharing a `job_key` never share a
//! consumer's fence (keys are unique per queue only). See `message_key`.
//! Headers: `epoch`, `token`, `version`, `position`, `type`, `schema` (decimal
//! text: the stored event's schema version, `domain::schema`; its `data` is
//! published as stored, so its hash checks), and for a workflow step `workflow` (the parent's id) and `step`.
//! Body: the whole event, hash included, plus queue and key (and the step's
//! `workflow` and `step`), so a consumer can rebuild workflow trees.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::domain::digest::fmt_time;
use crate::reader::LogEvent;

pub struct Message {
    /// The job's queue (for the publish span).
    pub queue: String,
    pub key: String,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

/// The body, serialised straight from the stored row (no parsing into the
/// domain type and back: the relay's hot path).
#[derive(serde::Serialize)]
struct Body<'a> {
    schema: i16,
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
    data: Data<'a>,
    prev_hash: Option<&'a str>,
    hash: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    workflow: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    step: Option<&'a str>,
}

/// An event's data in a body: as read (the relay reads it unparsed), or
/// printed from the parsed value. The same JSON either way; only the
/// spacing and the order of keys differ. That is not free: jsonb prints
/// `", "` and `": "` (up to half as long again as compact JSON) and a
/// number such as `1e300` in full, so data longer than `RAW_DATA_MAX` is
/// printed compact, as before the relay read it unparsed (unless it is
/// nested too deep for serde_json, which the parsed read could not read at
/// all). Shorter data may print up to `RAW_DATA_MAX` longer than compact.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum Data<'a> {
    Raw(&'a RawValue),
    Parsed(&'a Value),
}

/// The longest data passed on as read; longer data is rare, and parsed and
/// printed compact (see `Data`).
const RAW_DATA_MAX: usize = 64 * 1024;

/// `step`: the parent's id and the step's name, for a workflow step.
pub fn message(e: &LogEvent, queue: &str, job_key: Option<&str>, step: Option<(&str, &str)>) -> Message {
    let r = &e.row;
    // Kept alive for the body when long data is printed compact.
    let compact: Option<Value> = e
        .raw_data
        .as_ref()
        .filter(|raw| raw.get().len() > RAW_DATA_MAX)
        .and_then(|raw| serde_json::from_str(raw.get()).ok());
    let body = Body {
        schema: r.schema,
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
        data: match (&compact, &e.raw_data) {
            (Some(v), _) => Data::Parsed(v),
            // Data too deep for serde_json's parser goes as read.
            (None, Some(raw)) => Data::Raw(raw),
            (None, None) => Data::Parsed(&r.data),
        },
        prev_hash: r.prev_hash.as_deref(),
        hash: &r.hash,
        workflow: step.map(|s| s.0),
        step: step.map(|s| s.1),
    };
    let mut headers = vec![
        ("epoch", r.epoch.to_string()),
        ("token", r.token.to_string()),
        ("version", r.version.to_string()),
        ("position", e.position.to_string()),
        ("type", r.kind.clone()),
        ("schema", r.schema.to_string()),
    ];
    if let Some((parent, name)) = step {
        headers.push(("workflow", parent.to_string()));
        headers.push(("step", name.to_string()));
    }
    Message {
        queue: queue.to_string(),
        key: message_key(queue, job_key, &r.job_id),
        headers,
        body: {
            // Sized for a typical message up front: growing from empty
            // reallocated eight times per message.
            let mut out = Vec::with_capacity(1024);
            serde_json::to_writer(&mut out, &body).expect("json");
            out
        },
    }
}

/// A job's queue, key and workflow tie as its `enqueued` event (version 1)
/// states them: the same fields `store::jobs::job_keys` reads from the job
/// (or, for a purged job, from this very event). `None` for any other event
/// or a shape this does not know: the relay then looks the job up.
pub fn keys_of_enqueued(e: &LogEvent) -> Option<crate::store::jobs::JobKeys> {
    let r = &e.row;
    if r.version != 1 || r.kind != "enqueued" {
        return None;
    }
    // Only these fields are read off the data (the rest is skipped, not
    // built); a shape that does not fit is left to the lookup. serde reads
    // a struct from an array too, by position, where the lookup (`->>`)
    // reads nothing: the data and its tie must be objects.
    #[derive(serde::Deserialize)]
    struct Enqueued {
        queue: String,
        #[serde(default)]
        job_key: Option<String>,
        #[serde(default)]
        workflow: Option<serde_json::Map<String, Value>>,
    }
    let d: Enqueued = match &e.raw_data {
        Some(raw) if raw.get().trim_start().starts_with('{') => serde_json::from_str(raw.get()).ok()?,
        None if r.data.is_object() => Enqueued::deserialize(&r.data).ok()?,
        _ => return None,
    };
    let text = |v: Option<&Value>| -> Result<Option<String>, ()> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(()),
        }
    };
    let tie = d.workflow.as_ref();
    let (parent, step) = (
        text(tie.and_then(|t| t.get("parent"))).ok()?,
        text(tie.and_then(|t| t.get("step"))).ok()?,
    );
    Some(crate::store::jobs::JobKeys {
        job_id: r.job_id,
        queue: d.queue,
        job_key: d.job_key,
        parent,
        step,
    })
}

/// The Kafka key of a job's events: `<queue>/<job_key>` for a keyed job, with
/// `%` and `/` in the queue name written `%25` and `%2F` (so the first `/`
/// always ends the queue, and two (queue, key) pairs never share a key);
/// the `job_id` (a UUID, which has no `/`) for a job without a key.
pub fn message_key(queue: &str, job_key: Option<&str>, job_id: &uuid::Uuid) -> String {
    match job_key {
        Some(k) => format!("{}/{k}", queue.replace('%', "%25").replace('/', "%2F")),
        None => job_id.to_string(),
    }
}

/// Rebuilds the stored row from a message body (the audit log check uses
/// this): the body carries the stored row's columns, so it reads back as one.
pub fn row_of(body: &Value) -> Option<crate::store::EventRow> {
    serde_json::from_value::<crate::store::EventRow>(body.clone()).ok()
}
