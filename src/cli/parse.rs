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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Durations: whatever the text, an answer and never a panic; what
        /// humantime prints parses back to the same value.
        #[test]
        fn duration_never_panics(s in "\\PC{0,24}") {
            let _ = duration(&s);
            let _ = lease(&s);
        }

        #[test]
        fn duration_round_trips(ms in 0u64..(365 * 24 * 3600 * 1000)) {
            let d = Duration::from_millis(ms);
            prop_assert_eq!(duration(&humantime::format_duration(d).to_string()), Ok(d));
        }

        /// JSON arguments: malformed input is a clear error, valid input parses.
        #[test]
        fn json_arg_never_panics(s in "\\PC{0,64}") {
            match json_arg("--payload", &s, 1024) {
                Ok(v) => prop_assert_eq!(Some(v), serde_json::from_str::<Value>(&s).ok()),
                Err(e) => prop_assert!(e.starts_with("--payload")),
            }
        }
    }

    #[test]
    fn absurd_and_negative_durations_are_refused() {
        assert!(duration("-5s").unwrap_err().contains("negative"));
        assert!(duration("400days").unwrap_err().contains("longer than a year"));
        assert!(lease("0s").unwrap_err().contains("shorter than 1ms"));
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("5m"), Ok(Duration::from_secs(300)));
    }

    #[test]
    fn deeply_nested_json_is_an_error_not_a_stack_overflow() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(json_arg("--payload", &deep, usize::MAX)
            .unwrap_err()
            .contains("malformed JSON"));
    }
}
