//! Event schema versions and the upcasters between them.
//!
//! Every stored event carries the schema version its `data` was written in
//! (`jobledger.events.schema`; rows from before the column are version 1).
//! The stored bytes never change: the hash is checked on them as written,
//! and reading goes through `upcast`, which turns the data of any older
//! version into the current one before the domain sees it. So a log written
//! by any earlier version replays, verifies and rebuilds with today's code
//! (tests/fixture_log.rs keeps a version-1 log for that, forever).
//!
//! Versions:
//! - 1: the format of 2026-11-29 to 2026-12-02.
//! - 2: `observed` names who observed as one fence, `by: {epoch, token}`
//!   (or null for an unfenced observation), instead of the two loose
//!   fields `by_epoch` / `by_token` that could disagree (one set, one null).

use serde_json::{Map, Value};

/// The version every event is written in today.
pub const CURRENT: i16 = 2;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UpcastError {
    #[error("event schema {0} is newer than this build reads (up to {CURRENT}): upgrade jobledger")]
    TooNew(i16),
    #[error("event schema {0} does not exist (versions start at 1)")]
    Unknown(i16),
    #[error("schema {from} `{kind}` data cannot be read as schema {to}: {why}")]
    Malformed {
        from: i16,
        to: i16,
        kind: String,
        why: String,
    },
}

/// The `data` of an event of type `kind` stored at `schema`, as the current
/// schema has it.
pub fn upcast(schema: i16, kind: &str, data: &Value) -> Result<Value, UpcastError> {
    upcast_owned(schema, kind, data.clone())
}

/// `upcast`, consuming the data (no copy when it is already current).
pub fn upcast_owned(schema: i16, kind: &str, data: Value) -> Result<Value, UpcastError> {
    if schema < 1 {
        return Err(UpcastError::Unknown(schema));
    }
    if schema > CURRENT {
        return Err(UpcastError::TooNew(schema));
    }
    let mut data = data;
    for from in schema..CURRENT {
        data = step(from, kind, data)?;
    }
    Ok(data)
}

/// One version up.
fn step(from: i16, kind: &str, data: Value) -> Result<Value, UpcastError> {
    match (from, kind) {
        (1, "observed") => v1_observed(data).map_err(|why| UpcastError::Malformed {
            from,
            to: from + 1,
            kind: kind.into(),
            why,
        }),
        _ => Ok(data),
    }
}

fn v1_observed(data: Value) -> Result<Value, String> {
    let Value::Object(mut m) = data else {
        return Err("not an object".into());
    };
    let epoch = m.remove("by_epoch").unwrap_or(Value::Null);
    let token = m.remove("by_token").unwrap_or(Value::Null);
    let by = match (epoch, token) {
        (Value::Null, Value::Null) => Value::Null,
        (e @ Value::Number(_), t @ Value::Number(_)) => Value::Object(Map::from_iter([
            ("epoch".to_string(), e),
            ("token".to_string(), t),
        ])),
        (e, t) => return Err(format!("by_epoch {e} and by_token {t} do not make a fence")),
    };
    m.insert("by".into(), by);
    Ok(Value::Object(m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_version_1_observation_names_its_fence() {
        let v1 = json!({"key": "k", "data": {}, "digest": "d", "by_epoch": 3, "by_token": 7});
        assert_eq!(
            upcast(1, "observed", &v1).unwrap(),
            json!({"key": "k", "data": {}, "digest": "d", "by": {"epoch": 3, "token": 7}})
        );
        let unfenced = json!({"key": "k", "data": {}, "digest": "d", "by_epoch": null, "by_token": null});
        assert_eq!(upcast(1, "observed", &unfenced).unwrap()["by"], Value::Null);
        let half = json!({"key": "k", "data": {}, "digest": "d", "by_epoch": 3, "by_token": null});
        assert!(matches!(
            upcast(1, "observed", &half),
            Err(UpcastError::Malformed { .. })
        ));
    }

    #[test]
    fn other_types_and_current_data_pass_unchanged() {
        let claimed = json!({"holder": "w", "lease_until": "t", "next_action": "execute"});
        assert_eq!(upcast(1, "claimed", &claimed).unwrap(), claimed);
        let v2 = json!({"key": "k", "data": {}, "digest": "d", "by": null});
        assert_eq!(upcast(CURRENT, "observed", &v2).unwrap(), v2);
    }

    #[test]
    fn unknown_versions_are_refused() {
        assert_eq!(
            upcast(CURRENT + 1, "claimed", &json!({})),
            Err(UpcastError::TooNew(CURRENT + 1))
        );
        assert_eq!(upcast(0, "claimed", &json!({})), Err(UpcastError::Unknown(0)));
    }
}
