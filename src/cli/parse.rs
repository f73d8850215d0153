//! Parsers for outside input on the command line.

use chrono::{DateTime, Utc};
use serde_json::Value;
use std::io::Read;
use std::time::Duration;

use jobledger::domain::{ErrorClass, ExpiryPolicy, ReceiptPolicy, ReceiptStatus};

/// Longest duration accepted anywhere: beyond this a value is a typo.
const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// Human durations: `500ms`, `30s`, `5m`, `2h 30m`.
pub fn duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.starts_with('-') {
        return Err(format!("negative duration {s:?}"));
    }
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 500ms, 30s or 5m: {e}"))?;
    if d > MAX_DURATION {
        return Err(format!("{s:?} is longer than a year"));
    }
    Ok(d)
}

/// A lease must last at least a millisecond.
pub fn lease(s: &str) -> Result<Duration, String> {
    let d = duration(s)?;
    if d < Duration::from_millis(1) {
        return Err(format!("lease {s:?} is shorter than 1ms"));
    }
    Ok(d)
}

pub fn time(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s.trim())
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("{s:?} is not an RFC 3339 time: {e}"))
}

fn named<T>(s: &str, parse: fn(&str) -> Option<T>, all: &[&str]) -> Result<T, String> {
    parse(s).ok_or_else(|| format!("{s:?} is not one of {}", all.join(", ")))
}

pub fn error_class(s: &str) -> Result<ErrorClass, String> {
    named(
        s,
        ErrorClass::parse,
        &ErrorClass::ALL.iter().map(|c| c.as_str()).collect::<Vec<_>>(),
    )
}
pub fn expiry_policy(s: &str) -> Result<ExpiryPolicy, String> {
    named(
        s,
        ExpiryPolicy::parse,
        &ExpiryPolicy::ALL.iter().map(|c| c.as_str()).collect::<Vec<_>>(),
    )
}
pub fn receipt_policy(s: &str) -> Result<ReceiptPolicy, String> {
    named(
        s,
        ReceiptPolicy::parse,
        &ReceiptPolicy::ALL.iter().map(|c| c.as_str()).collect::<Vec<_>>(),
    )
}
pub fn receipt_status(s: &str) -> Result<ReceiptStatus, String> {
    named(
        s,
        ReceiptStatus::parse,
        &ReceiptStatus::ALL.iter().map(|c| c.as_str()).collect::<Vec<_>>(),
    )
}

/// A JSON argument: inline, `@FILE`, or `@-` for standard input. Reading
/// stops just past `limit` bytes so an enormous file is refused, not loaded.
pub fn json_arg(flag: &str, raw: &str, limit: usize) -> Result<Value, String> {
    let text = match raw.strip_prefix('@') {
        None => raw.to_string(),
        Some(path) => {
            let mut buf = Vec::new();
            let cap = (limit as u64).saturating_mul(4).saturating_add(1);
            let read = if path == "-" {
                std::io::stdin().lock().take(cap).read_to_end(&mut buf)
            } else {
                std::fs::File::open(path).and_then(|f| f.take(cap).read_to_end(&mut buf))
            };
            read.map_err(|e| format!("{flag}: cannot read {path}: {e}"))?;
            if buf.len() as u64 >= cap {
                return Err(format!(
                    "{flag}: {path} is larger than the payload limit of {limit} bytes"
                ));
            }
            String::from_utf8(buf).map_err(|_| format!("{flag}: {path} is not UTF-8"))?
        }
    };
    serde_json::from_str(&text).map_err(|e| format!("{flag}: malformed JSON: {e}"))
}
