//! Checks on outside input before anything is written.

use serde_json::Value;

use super::error::{LedgerError, LedgerResult};
use crate::domain::canonical_json;

/// Size limits on what callers may store.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Canonical JSON bytes of a payload, result or observation.
    pub max_payload_bytes: usize,
    /// Queue, kind, key, step, receipt id, codes and similar names.
    pub max_name_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload_bytes: 1024 * 1024,
            max_name_bytes: 256,
        }
    }
}

/// The deepest nesting a payload, result or observation may have. Every
/// reader of the log (the projections, `verify`, the audit export, the
/// relay's keys and consumers) parses an event's data with serde_json,
/// which stops at 128 levels; the data holds the caller's value a few
/// levels down (`payload`, a workflow's steps). Deeper data was stored,
/// and then failed every read of its batch, for good: a projection or an
/// export stopped at it.
pub const MAX_JSON_DEPTH: usize = 100;

/// How deeply `value` nests (a scalar is 0), walked with a stack of its own.
fn depth(value: &Value) -> usize {
    let mut deepest = 0;
    let mut todo = vec![(value, 0usize)];
    while let Some((v, d)) = todo.pop() {
        match v {
            Value::Array(a) => todo.extend(a.iter().map(|c| (c, d + 1))),
            Value::Object(o) => todo.extend(o.values().map(|c| (c, d + 1))),
            _ => continue,
        }
        deepest = deepest.max(d + 1);
    }
    deepest
}

impl Limits {
    pub fn json(&self, what: &str, value: &Value) -> LedgerResult<()> {
        // First, and without recursion: a value built in code can nest
        // deeper than any parser reads it back (review of issue 15).
        if depth(value) > MAX_JSON_DEPTH {
            return Err(LedgerError::BadInput(format!(
                "{what} nests deeper than {MAX_JSON_DEPTH} levels"
            )));
        }
        let size = canonical_json(value).len();
        if size > self.max_payload_bytes {
            return Err(LedgerError::TooLarge {
                size,
                limit: self.max_payload_bytes,
            });
        }
        if has_nul(value) {
            // PostgreSQL's jsonb cannot store U+0000; refuse it up front with a
            // clear message instead of a database error halfway through.
            return Err(LedgerError::BadInput(format!(
                "{what} contains a U+0000 character"
            )));
        }
        Ok(())
    }

    /// Who changes a control stream (a queue's, a schedule's) and why.
    pub fn control(&self, who: &str, operator: &str, reason: &str) -> LedgerResult<()> {
        self.name(who, operator)?;
        typed(who, operator)?;
        typed("reason", reason)?;
        self.text("reason", reason)
    }

    pub fn name(&self, what: &str, value: &str) -> LedgerResult<()> {
        if value.is_empty() {
            return Err(LedgerError::BadInput(format!("{what} must not be empty")));
        }
        if value.len() > self.max_name_bytes {
            return Err(LedgerError::BadInput(format!(
                "{what} is {} bytes, over the limit of {}",
                value.len(),
                self.max_name_bytes
            )));
        }
        if value.contains('\0') {
            return Err(LedgerError::BadInput(format!(
                "{what} contains a U+0000 character"
            )));
        }
        // A newline in a queue, kind, worker id or code would forge a line
        // of `history` (and of every line-based log that prints it).
        if value.chars().any(char::is_control) {
            return Err(LedgerError::BadInput(format!(
                "{what} contains a control character"
            )));
        }
        Ok(())
    }

    /// A lease's length: at least 1 ms, at most a day (a longer job
    /// heartbeats; a lease of years would hold a job forever).
    pub fn lease(&self, d: std::time::Duration) -> LedgerResult<()> {
        if d.is_zero() || d > MAX_LEASE {
            return Err(LedgerError::BadInput(format!(
                "a lease lasts 1 ms to {} s, not {} ms",
                MAX_LEASE.as_secs(),
                d.as_millis()
            )));
        }
        Ok(())
    }

    /// A snooze's delay: at most 100 years, like an enqueue's.
    pub fn delay(&self, d: std::time::Duration) -> LedgerResult<()> {
        if d > MAX_DELAY {
            return Err(LedgerError::BadInput("a delay is at most 100 years".into()));
        }
        Ok(())
    }

    pub fn text(&self, what: &str, value: &str) -> LedgerResult<()> {
        if value.len() > self.max_payload_bytes || value.contains('\0') {
            return Err(LedgerError::BadInput(format!(
                "{what} is too long or contains U+0000"
            )));
        }
        Ok(())
    }
}

const MAX_LEASE: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
const MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(100 * 366 * 24 * 3600);

/// `s` on one line: control characters (a newline in an old event's free
/// text) shown escaped, so no stored text can forge a line of a timeline.
pub fn one_line(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_string();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

fn has_nul(value: &Value) -> bool {
    match value {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(has_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

/// A name or a reason a person typed: not blank, and no control
/// characters (a newline would forge a line of `history`).
pub(crate) fn typed(what: &str, value: &str) -> LedgerResult<()> {
    if value.trim().is_empty() {
        return Err(LedgerError::BadInput(format!("{what} must not be blank")));
    }
    if value.chars().any(char::is_control) {
        return Err(LedgerError::BadInput(format!(
            "{what} contains a control character"
        )));
    }
    Ok(())
}
