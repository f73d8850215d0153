//! Canonical JSON, result digests and the per-job hash chain.
//!
//! Canonical form (version 1): object keys sorted by their UTF-8 bytes, no
//! whitespace, strings escaped as serde_json escapes them, numbers as
//! serde_json prints the parsed value. Equal JSON values therefore give equal
//! bytes whatever the key order or spacing of the input. The algorithm version
//! is part of every digest (`v1:<sha256 hex>`) so it can change without
//! re-interpreting old receipts.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::event::Event;

pub const DIGEST_VERSION: &str = "v1";

pub fn canonical_json(value: &Value) -> String {
    let mut out = Vec::with_capacity(256);
    write_canonical(value, &mut out);
    String::from_utf8(out).expect("JSON is UTF-8")
}

/// A JSON string, quoted and escaped exactly as serde_json escapes it,
/// written straight into `out` (no intermediate `Value` or `String`).
fn push_str(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
}

fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push(b'{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                push_str(out, key);
                out.push(b':');
                write_canonical(&map[key], out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        // PostgreSQL's numeric has no negative zero: -0.0 is stored as 0.0, so
        // the canonical form must not tell them apart either.
        Value::Number(n) if n.is_f64() && n.as_f64() == Some(0.0) => out.extend_from_slice(b"0.0"),
        Value::String(v) => push_str(out, v),
        scalar => serde_json::to_writer(&mut *out, scalar).expect("writing to a Vec cannot fail"),
    }
}

/// Versioned digest of a JSON value's canonical form.
pub fn digest(value: &Value) -> String {
    format!(
        "{DIGEST_VERSION}:{}",
        hex::encode(Sha256::digest(canonical_json(value).as_bytes()))
    )
}

/// Database timestamps have microsecond precision; every time the domain
/// produces is truncated to that so replay equals what the database stored.
pub fn to_micros(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(t.timestamp_micros()).expect("in range")
}

pub fn fmt_time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Hash of an event chained to the previous event of the same job. Covers
/// every column an auditor relies on; `position` is excluded because the
/// database assigns it after the hash is known.
///
/// The hashed bytes are the canonical JSON of the object
/// `{h, prev, job_id, version, epoch, token, attempt, run, from, to, reason,
/// error_class, actor, at, type, data}` (layout `h` 1, the events of schema
/// 1), plus `schema` (layout 2, schema 2 on): the schema is under the hash,
/// so an event cannot be relabelled to be read by another upcaster.
/// `covered_value` builds that object and a test checks that this direct
/// writer produces exactly its bytes. New events are written in
/// `schema::CURRENT`.
pub fn event_hash(event: &Event) -> String {
    let (kind, data) = event.body.to_parts();
    hash_parts(event, &kind, &data)
}

/// `event_hash` with the `type`/`data` split already done.
pub fn hash_parts(event: &Event, kind: &str, data: &Value) -> String {
    hash_stored(&HashInput {
        job_id: &event.job_id.to_string(),
        version: event.version,
        epoch: event.epoch,
        token: event.token,
        attempt: event.attempt,
        run: event.run,
        from_state: event.from_state.map(|s| s.as_str()),
        to_state: event.to_state.as_str(),
        reason: event.reason.as_str(),
        error_class: event.error_class.map(|c| c.as_str()),
        actor: &event.actor,
        recorded_at: event.recorded_at,
        kind,
        data,
        prev_hash: event.prev_hash.as_deref(),
        schema: super::schema::CURRENT,
    })
}

/// The columns of a stored event as written (the data in its own schema):
/// what `hash_stored` checks, whatever version wrote it.
pub struct HashInput<'a> {
    pub job_id: &'a str,
    pub version: i64,
    pub epoch: i64,
    pub token: i64,
    pub attempt: i32,
    pub run: i32,
    pub from_state: Option<&'a str>,
    pub to_state: &'a str,
    pub reason: &'a str,
    pub error_class: Option<&'a str>,
    pub actor: &'a str,
    pub recorded_at: DateTime<Utc>,
    pub kind: &'a str,
    pub data: &'a Value,
    pub prev_hash: Option<&'a str>,
    pub schema: i16,
}

/// The hash of a stored event, in the layout of its schema.
pub fn hash_stored(e: &HashInput<'_>) -> String {
    use std::io::Write;
    let mut out: Vec<u8> = Vec::with_capacity(512);
    let opt = |out: &mut Vec<u8>, v: Option<&str>| match v {
        Some(v) => push_str(out, v),
        None => out.extend_from_slice(b"null"),
    };
    let layout = if e.schema <= 1 { 1 } else { 2 };
    // Keys in byte order: actor, at, attempt, data, epoch, error_class, from,
    // h, job_id, prev, reason, run, [schema,] to, token, type, version.
    let w = "writing to a Vec cannot fail";
    out.extend_from_slice(b"{\"actor\":");
    push_str(&mut out, e.actor);
    out.extend_from_slice(b",\"at\":");
    push_str(&mut out, &fmt_time(e.recorded_at));
    write!(out, ",\"attempt\":{},\"data\":", e.attempt).expect(w);
    write_canonical(e.data, &mut out);
    write!(out, ",\"epoch\":{},\"error_class\":", e.epoch).expect(w);
    opt(&mut out, e.error_class);
    out.extend_from_slice(b",\"from\":");
    opt(&mut out, e.from_state);
    write!(out, ",\"h\":{layout},\"job_id\":").expect(w);
    push_str(&mut out, e.job_id);
    out.extend_from_slice(b",\"prev\":");
    opt(&mut out, e.prev_hash);
    out.extend_from_slice(b",\"reason\":");
    push_str(&mut out, e.reason);
    write!(out, ",\"run\":{}", e.run).expect(w);
    if layout >= 2 {
        write!(out, ",\"schema\":{}", e.schema).expect(w);
    }
    out.extend_from_slice(b",\"to\":");
    push_str(&mut out, e.to_state);
    write!(out, ",\"token\":{},\"type\":", e.token).expect(w);
    push_str(&mut out, e.kind);
    write!(out, ",\"version\":{}}}", e.version).expect(w);
    hex::encode(Sha256::digest(&out))
}

/// The object whose canonical JSON `event_hash` hashes (the specification;
/// the writer above is the fast path).
pub fn covered_value(event: &Event) -> Value {
    let (kind, data) = event.body.to_parts();
    serde_json::json!({
        "h": 2,
        "schema": super::schema::CURRENT,
        "prev": event.prev_hash,
        "job_id": event.job_id.to_string(),
        "version": event.version,
        "epoch": event.epoch,
        "token": event.token,
        "attempt": event.attempt,
        "run": event.run,
        "from": event.from_state.map(|s| s.as_str()),
        "to": event.to_state.as_str(),
        "reason": event.reason.as_str(),
        "error_class": event.error_class.map(|c| c.as_str()),
        "actor": event.actor,
        "at": fmt_time(event.recorded_at),
        "type": kind,
        "data": data,
    })
}
