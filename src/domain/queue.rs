//! Queue controls: an operator pauses a queue (its jobs are not claimed;
//! running jobs go on and may complete) and resumes it, each a recorded
//! action with who and why. A queue's controls are a stream of their own,
//! hash-chained like a job's (`jobledger.queue_events`), decided and
//! replayed here with no I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;

use super::admission::{ConcurrencyLimit, RateLimit};

use super::digest::{canonical_json, fmt_time};

/// A queue as its control events leave it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueControl {
    pub queue: String,
    pub paused: Option<Pause>,
    /// Concurrency limits by name.
    #[serde(default)]
    pub limits: BTreeMap<String, ConcurrencyLimit>,
    #[serde(default)]
    pub rate: Option<RateLimit>,
    /// Events so far (0: never controlled).
    pub version: i64,
    pub last_hash: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pause {
    pub since: DateTime<Utc>,
    pub by: String,
    pub reason: String,
}

/// What a stored control event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueAction {
    Pause,
    Resume,
    LimitSet,
    LimitRemoved,
    RateSet,
    RateRemoved,
}

const ACTIONS: [(QueueAction, &str); 6] = [
    (QueueAction::Pause, "paused"),
    (QueueAction::Resume, "resumed"),
    (QueueAction::LimitSet, "limit_set"),
    (QueueAction::LimitRemoved, "limit_removed"),
    (QueueAction::RateSet, "rate_set"),
    (QueueAction::RateRemoved, "rate_removed"),
];

impl QueueAction {
    pub fn as_str(self) -> &'static str {
        ACTIONS
            .iter()
            .find(|(a, _)| *a == self)
            .expect("every action is named")
            .1
    }

    pub fn parse(s: &str) -> Option<Self> {
        ACTIONS.iter().find(|(_, n)| *n == s).map(|(a, _)| *a)
    }
}

/// What an operator asks of a queue.
#[derive(Clone, Debug, PartialEq)]
pub enum QueueCommand {
    Pause,
    Resume,
    SetLimit { name: String, limit: ConcurrencyLimit },
    RemoveLimit { name: String },
    SetRate(RateLimit),
    RemoveRate,
}

/// One control event, as stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueEvent {
    pub queue: String,
    pub version: i64,
    pub action: QueueAction,
    pub actor: String,
    pub reason: String,
    /// The terms of a limit set or removed (None for pauses and resumes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    pub recorded_at: DateTime<Utc>,
    pub prev_hash: Option<String>,
    pub hash: String,
}

/// What a control command can answer besides an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QueueRefusal {
    /// Pausing a paused queue, resuming a running one, setting a limit to
    /// what it is: nothing to record.
    Already(&'static str),
    /// Terms no claim could honour (a limit of 0, an empty window).
    Invalid(String),
}

fn check_terms(cmd: &QueueCommand) -> Result<(), QueueRefusal> {
    match cmd {
        QueueCommand::SetLimit { limit, .. } if !(1..=1_000_000).contains(&limit.max) => {
            Err(QueueRefusal::Invalid(format!(
                "a concurrency limit of {} is not in 1..=1000000",
                limit.max
            )))
        }
        QueueCommand::SetRate(r) if !(1..=1_000_000).contains(&r.max) => Err(QueueRefusal::Invalid(format!(
            "a rate of {} claims is not in 1..=1000000",
            r.max
        ))),
        QueueCommand::SetRate(r) if !(1..=86_400_000).contains(&r.per_ms) => Err(QueueRefusal::Invalid(
            "a rate window must be from 1 ms to 1 day".into(),
        )),
        _ => Ok(()),
    }
}

/// The event a control command appends, or why none is due.
pub fn decide_queue(
    q: &QueueControl,
    cmd: &QueueCommand,
    actor: &str,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<QueueEvent, QueueRefusal> {
    check_terms(cmd)?;
    let (action, data) = match cmd {
        QueueCommand::Pause if q.paused.is_some() => {
            return Err(QueueRefusal::Already("the queue is already paused"))
        }
        QueueCommand::Resume if q.paused.is_none() => {
            return Err(QueueRefusal::Already("the queue is not paused"))
        }
        QueueCommand::Pause => (QueueAction::Pause, None),
        QueueCommand::Resume => (QueueAction::Resume, None),
        QueueCommand::SetLimit { name, limit } => {
            if q.limits.get(name) == Some(limit) {
                return Err(QueueRefusal::Already("the limit is already so"));
            }
            (
                QueueAction::LimitSet,
                Some(json!({ "name": name, "limit": limit })),
            )
        }
        QueueCommand::RemoveLimit { name } => {
            if !q.limits.contains_key(name) {
                return Err(QueueRefusal::Already("the queue has no limit of that name"));
            }
            (QueueAction::LimitRemoved, Some(json!({ "name": name })))
        }
        QueueCommand::SetRate(r) => {
            if q.rate.as_ref() == Some(r) {
                return Err(QueueRefusal::Already("the rate limit is already so"));
            }
            (QueueAction::RateSet, Some(json!(r)))
        }
        QueueCommand::RemoveRate => {
            if q.rate.is_none() {
                return Err(QueueRefusal::Already("the queue has no rate limit"));
            }
            (QueueAction::RateRemoved, None)
        }
    };
    let mut e = QueueEvent {
        queue: q.queue.clone(),
        version: q.version + 1,
        action,
        actor: actor.into(),
        reason: reason.into(),
        data,
        recorded_at: now,
        prev_hash: q.last_hash.clone(),
        hash: String::new(),
    };
    e.hash = queue_event_hash(&e);
    Ok(e)
}

fn data_of<T: serde::de::DeserializeOwned>(e: &QueueEvent, field: Option<&str>) -> Result<T, String> {
    let v = e
        .data
        .as_ref()
        .ok_or_else(|| format!("queue {:?} v{}: no data", e.queue, e.version))?;
    let v = match field {
        Some(f) => v.get(f).cloned().unwrap_or(Value::Null),
        None => v.clone(),
    };
    serde_json::from_value(v).map_err(|err| format!("queue {:?} v{}: {err}", e.queue, e.version))
}

/// Folds one event; refuses one that does not follow (a broken chain, a
/// version out of order, a pause of a paused queue).
pub fn apply_queue(q: &QueueControl, e: &QueueEvent) -> Result<QueueControl, String> {
    if e.version != q.version + 1 || e.prev_hash != q.last_hash {
        return Err(format!(
            "queue {:?} v{}: does not follow v{}",
            e.queue, e.version, q.version
        ));
    }
    if e.hash != queue_event_hash(e) {
        return Err(format!(
            "queue {:?} v{}: the hash does not match the event",
            e.queue, e.version
        ));
    }
    let mut next = q.clone();
    next.queue = e.queue.clone();
    let twice = || format!("queue {:?} v{}: {} twice", e.queue, e.version, e.action.as_str());
    match e.action {
        QueueAction::Pause if q.paused.is_none() => {
            next.paused = Some(Pause {
                since: e.recorded_at,
                by: e.actor.clone(),
                reason: e.reason.clone(),
            })
        }
        QueueAction::Resume if q.paused.is_some() => next.paused = None,
        QueueAction::Pause | QueueAction::Resume => return Err(twice()),
        QueueAction::LimitSet => {
            let name: String = data_of(e, Some("name"))?;
            next.limits.insert(name, data_of(e, Some("limit"))?);
        }
        QueueAction::LimitRemoved => {
            let name: String = data_of(e, Some("name"))?;
            next.limits.remove(&name).ok_or_else(twice)?;
        }
        QueueAction::RateSet => next.rate = Some(data_of(e, None)?),
        QueueAction::RateRemoved if q.rate.is_some() => next.rate = None,
        QueueAction::RateRemoved => return Err(twice()),
    }
    next.version = e.version;
    next.last_hash = Some(e.hash.clone());
    Ok(next)
}

/// SHA-256 of the event's canonical JSON (everything but the hash itself;
/// `data` only when present, so pauses hash as they did before limits).
pub fn queue_event_hash(e: &QueueEvent) -> String {
    use sha2::{Digest, Sha256};
    let mut v = json!({
        "queue": e.queue, "version": e.version, "action": e.action.as_str(), "actor": e.actor,
        "reason": e.reason, "at": fmt_time(e.recorded_at), "prev": e.prev_hash,
    });
    if let Some(d) = &e.data {
        v["data"] = d.clone();
    }
    hex::encode(Sha256::digest(canonical_json(&v).as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pause_resume_and_refusals() {
        let now = Utc::now();
        let q = QueueControl {
            queue: "q".into(),
            ..Default::default()
        };
        assert!(decide_queue(&q, &QueueCommand::Resume, "a", "r", now).is_err());
        let e = decide_queue(&q, &QueueCommand::Pause, "alice", "provider down", now).unwrap();
        let q = apply_queue(&q, &e).unwrap();
        assert_eq!(q.paused.as_ref().unwrap().by, "alice");
        assert!(decide_queue(&q, &QueueCommand::Pause, "a", "r", now).is_err());
        let mut forged = decide_queue(&q, &QueueCommand::Resume, "bob", "back", now).unwrap();
        forged.reason = "edited".into();
        assert!(
            apply_queue(&q, &forged).is_err(),
            "an edited event breaks its hash"
        );
        let e = decide_queue(&q, &QueueCommand::Resume, "bob", "back", now).unwrap();
        assert_eq!(apply_queue(&q, &e).unwrap().paused, None);
    }

    #[test]
    fn limits_are_events_and_replay() {
        let now = Utc::now();
        let q = QueueControl {
            queue: "q".into(),
            ..Default::default()
        };
        let set = QueueCommand::SetLimit {
            name: "per-tenant".into(),
            limit: ConcurrencyLimit::new(None, Some("t-*".into()), 2),
        };
        let e = decide_queue(&q, &set, "ops", "provider caps us", now).unwrap();
        let q = apply_queue(&q, &e).unwrap();
        assert_eq!(q.limits["per-tenant"].max, 2);
        assert_eq!(
            decide_queue(&q, &set, "ops", "r", now),
            Err(QueueRefusal::Already("the limit is already so"))
        );
        let zero = QueueCommand::SetRate(RateLimit { max: 0, per_ms: 1000 });
        assert!(matches!(
            decide_queue(&q, &zero, "ops", "r", now),
            Err(QueueRefusal::Invalid(_))
        ));
        let rate = QueueCommand::SetRate(RateLimit {
            max: 10,
            per_ms: 1000,
        });
        let e = decide_queue(&q, &rate, "ops", "r", now).unwrap();
        let q = apply_queue(&q, &e).unwrap();
        assert_eq!(
            q.rate,
            Some(RateLimit {
                max: 10,
                per_ms: 1000
            })
        );
        let mut forged = decide_queue(&q, &QueueCommand::RemoveRate, "ops", "r", now).unwrap();
        forged.data = Some(json!({"max": 1000}));
        assert!(apply_queue(&q, &forged).is_err(), "data is under the hash");
        let e = decide_queue(
            &q,
            &QueueCommand::RemoveLimit {
                name: "per-tenant".into(),
            },
            "ops",
            "r",
            now,
        )
        .unwrap();
        let q = apply_queue(&q, &e).unwrap();
        assert!(q.limits.is_empty());
        assert!(decide_queue(
            &q,
            &QueueCommand::RemoveLimit {
                name: "per-tenant".into()
            },
            "ops",
            "r",
            now
        )
        .is_err());
    }
}
