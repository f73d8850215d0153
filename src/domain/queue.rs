//! Queue controls: an operator pauses a queue (its jobs are not claimed;
//! running jobs go on and may complete) and resumes it, each a recorded
//! action with who and why. A queue's controls are a stream of their own,
//! hash-chained like a job's (`jobledger.queue_events`), decided and
//! replayed here with no I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::digest::{canonical_json, fmt_time};

/// A queue as its control events leave it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueControl {
    pub queue: String,
    pub paused: Option<Pause>,
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueAction {
    Pause,
    Resume,
}

impl QueueAction {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueAction::Pause => "paused",
            QueueAction::Resume => "resumed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "paused" => Some(QueueAction::Pause),
            "resumed" => Some(QueueAction::Resume),
            _ => None,
        }
    }
}

/// One control event, as stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QueueEvent {
    pub queue: String,
    pub version: i64,
    pub action: QueueAction,
    pub actor: String,
    pub reason: String,
    pub recorded_at: DateTime<Utc>,
    pub prev_hash: Option<String>,
    pub hash: String,
}

/// What a control command can answer besides an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QueueRefusal {
    /// Pausing a paused queue, resuming a running one: nothing to record.
    Already(&'static str),
}

/// The event a pause or resume appends, or why none is due.
pub fn decide_queue(
    q: &QueueControl,
    action: QueueAction,
    actor: &str,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<QueueEvent, QueueRefusal> {
    match (action, &q.paused) {
        (QueueAction::Pause, Some(_)) => return Err(QueueRefusal::Already("the queue is already paused")),
        (QueueAction::Resume, None) => return Err(QueueRefusal::Already("the queue is not paused")),
        _ => {}
    }
    let mut e = QueueEvent {
        queue: q.queue.clone(),
        version: q.version + 1,
        action,
        actor: actor.into(),
        reason: reason.into(),
        recorded_at: now,
        prev_hash: q.last_hash.clone(),
        hash: String::new(),
    };
    e.hash = queue_event_hash(&e);
    Ok(e)
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
    let paused = match (e.action, &q.paused) {
        (QueueAction::Pause, None) => Some(Pause {
            since: e.recorded_at,
            by: e.actor.clone(),
            reason: e.reason.clone(),
        }),
        (QueueAction::Resume, Some(_)) => None,
        _ => {
            return Err(format!(
                "queue {:?} v{}: {} twice",
                e.queue,
                e.version,
                e.action.as_str()
            ))
        }
    };
    Ok(QueueControl {
        queue: e.queue.clone(),
        paused,
        version: e.version,
        last_hash: Some(e.hash.clone()),
    })
}

/// SHA-256 of the event's canonical JSON (everything but the hash itself).
pub fn queue_event_hash(e: &QueueEvent) -> String {
    use sha2::{Digest, Sha256};
    let v = json!({
        "queue": e.queue, "version": e.version, "action": e.action.as_str(), "actor": e.actor,
        "reason": e.reason, "at": fmt_time(e.recorded_at), "prev": e.prev_hash,
    });
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
        assert!(decide_queue(&q, QueueAction::Resume, "a", "r", now).is_err());
        let e = decide_queue(&q, QueueAction::Pause, "alice", "provider down", now).unwrap();
        let q = apply_queue(&q, &e).unwrap();
        assert_eq!(q.paused.as_ref().unwrap().by, "alice");
        assert!(decide_queue(&q, QueueAction::Pause, "a", "r", now).is_err());
        let mut forged = decide_queue(&q, QueueAction::Resume, "bob", "back", now).unwrap();
        forged.reason = "edited".into();
        assert!(
            apply_queue(&q, &forged).is_err(),
            "an edited event breaks its hash"
        );
        let e = decide_queue(&q, QueueAction::Resume, "bob", "back", now).unwrap();
        assert_eq!(apply_queue(&q, &e).unwrap().paused, None);
    }
}
