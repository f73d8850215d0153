//! A job's timeline: its events from the log, interleaved with the writes
//! the fence refused (and, for a workflow's parent, its steps' edges), so
//! "why did this job end like this?" reads top to bottom. Every front door
//! (the CLI's `history`, the demo, the HTTP API) renders this one.

use serde_json::{json, Value};
use uuid::Uuid;

use super::error::LedgerResult;
use super::validate::one_line;
use super::{HistoryEntry, Ledger};
use crate::domain::digest::fmt_time;
use crate::domain::EventBody;
use crate::store::rejections::RejectionRow;
use crate::store::StoreError;

type Result<T> = LedgerResult<T>;

enum Item {
    /// An event, and the workflow step it belongs to (for `history PARENT`).
    Event(Box<HistoryEntry>, Option<String>),
    Refused(RejectionRow, Option<String>),
}

impl Item {
    fn at(&self) -> (chrono::DateTime<chrono::Utc>, i64) {
        match self {
            Item::Event(h, _) => (h.event.recorded_at, h.position),
            Item::Refused(r, _) => (r.recorded_at, i64::MAX),
        }
    }
}

async fn items(ledger: &Ledger, job: Uuid) -> Result<Vec<Item>> {
    let history = ledger.history(job).await?;
    let members = ledger.workflow_members(&history[0].event).await?;
    let mut items: Vec<Item> = history
        .into_iter()
        .map(|h| Item::Event(Box::new(h), None))
        .collect();
    items.extend(
        ledger
            .rejections(job)
            .await?
            .into_iter()
            .map(|r| Item::Refused(r, None)),
    );
    // A workflow's history is its own edges and its steps', in time.
    for (m, events, refused) in members {
        items.extend(
            events
                .into_iter()
                .map(|h| Item::Event(Box::new(h), Some(m.step.clone()))),
        );
        items.extend(
            refused
                .into_iter()
                .map(|r| Item::Refused(r, Some(m.step.clone()))),
        );
    }
    // Stable: events keep their log order; a refusal sorts after the
    // events that were already there when it was refused.
    items.sort_by_key(Item::at);
    Ok(items)
}

fn label(step: &Option<String>) -> String {
    step.as_ref().map(|s| format!("[{s}] ")).unwrap_or_default()
}

pub fn event_line(h: &HistoryEntry) -> String {
    let e = &h.event;
    let from = e.from_state.map_or("-".to_string(), |s| s.to_string());
    let class = e.error_class.map(|c| format!(" [{c}]")).unwrap_or_default();
    format!(
        "{:>7} v{:<3} {}  {:<16} {:>16} -> {:<16} {:<24} token={} attempt={} by {}{class}{}",
        h.position,
        e.version,
        fmt_time(e.recorded_at),
        e.body.type_name(),
        from,
        e.to_state.as_str(),
        e.reason.as_str(),
        e.token,
        e.attempt,
        e.actor,
        detail(&e.body)
    )
}

/// What a person reading the line needs from the event's data: the next
/// action a claim hands out, and the words an operator gave.
fn detail(body: &EventBody) -> String {
    let quoted = |n: &str| format!(" {:?}", n);
    match body {
        EventBody::Claimed { next_action, .. } => format!(" next={}", next_action.as_str()),
        EventBody::TakenOver { .. } => " next=reconcile".into(),
        EventBody::Failed {
            next_action,
            run_at: Some(_),
            ..
        } => format!(" next={}", next_action.as_str()),
        EventBody::CancelRequested { note: Some(n) }
        | EventBody::Cancelled { note: Some(n) }
        | EventBody::CancelRefused { note: Some(n) } => quoted(n),
        EventBody::Replayed { note, .. } | EventBody::HoldReleased { note, .. } => quoted(note),
        EventBody::ResolvedByOperator { note, evidence, .. } => {
            format!("{} evidence={}", quoted(note), clipped(&evidence.to_string()))
        }
        EventBody::Annotated {
            corrects_version,
            note,
            ..
        } => format!(" corrects v{corrects_version}:{}", quoted(note)),
        _ => String::new(),
    }
}

/// At most 200 characters of `s` (evidence can be a megabyte).
fn clipped(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}

/// The line shown under a corrected event, for each annotation of it.
fn correction_line(h: &HistoryEntry) -> Option<(i64, String)> {
    let EventBody::Annotated {
        corrects_position,
        note,
        ..
    } = &h.event.body
    else {
        return None;
    };
    Some((
        *corrects_position,
        format!(
            "{:>7}      ^ corrected at position {} (v{}) at {} by {}: {:?}",
            "",
            h.position,
            h.event.version,
            fmt_time(h.event.recorded_at),
            h.event.actor,
            note
        ),
    ))
}

fn refused_line(r: &RejectionRow) -> String {
    format!(
        "{:>7} {:<4} {}  REFUSED {} {}: {} (token={} by {})",
        "-",
        "",
        fmt_time(r.recorded_at),
        r.command,
        r.outcome,
        r.detail,
        r.token.map_or("-".into(), |t| t.to_string()),
        r.actor
    )
}

/// One line of `lines`, with what a renderer needs to mark it up without
/// reading the text (which carries names and words people chose).
#[derive(Debug, Clone)]
pub struct TimelineLine {
    /// `[step] ` for a workflow step's line, else empty.
    pub label: String,
    pub kind: LineKind,
    /// The line without its label.
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LineKind {
    /// An event, and the state it moved the job to.
    Event {
        to_state: String,
    },
    Refused,
    Correction,
}

impl TimelineLine {
    fn new(label: String, kind: LineKind, text: String) -> Self {
        TimelineLine {
            label: one_line(&label),
            kind,
            text: one_line(&text),
        }
    }
}

impl std::fmt::Display for TimelineLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.label, self.text)
    }
}

/// One line per event and refusal, in time; an annotated event is followed
/// by a line for each correction of it (the correction also has its own
/// line, when it was made).
pub async fn lines(ledger: &Ledger, job: Uuid) -> Result<Vec<String>> {
    Ok(parts(ledger, job).await?.iter().map(|l| l.to_string()).collect())
}

/// `lines`, each with its label and kind apart.
pub async fn parts(ledger: &Ledger, job: Uuid) -> Result<Vec<TimelineLine>> {
    let items = items(ledger, job).await?;
    let mut corrections: std::collections::HashMap<i64, Vec<TimelineLine>> = Default::default();
    for i in &items {
        if let Item::Event(h, step) = i {
            if let Some((at, line)) = correction_line(h) {
                corrections.entry(at).or_default().push(TimelineLine::new(
                    label(step),
                    LineKind::Correction,
                    line,
                ));
            }
        }
    }
    let mut out = Vec::with_capacity(items.len());
    for i in &items {
        match i {
            Item::Event(h, step) => {
                let kind = LineKind::Event {
                    to_state: h.event.to_state.as_str().to_string(),
                };
                out.push(TimelineLine::new(label(step), kind, event_line(h)));
                out.extend(corrections.remove(&h.position).unwrap_or_default());
            }
            Item::Refused(r, step) => {
                out.push(TimelineLine::new(label(step), LineKind::Refused, refused_line(r)))
            }
        }
    }
    Ok(out)
}

/// One JSON object per line: events as stored, refusals as `{"refused": …}`.
pub async fn json_lines(ledger: &Ledger, job: Uuid) -> Result<Vec<Value>> {
    items(ledger, job)
        .await?
        .iter()
        .map(|i| {
            Ok(match i {
                Item::Event(h, None) => {
                    serde_json::to_value(h).map_err(|e| StoreError::Corrupt(e.to_string()))?
                }
                Item::Event(h, Some(step)) => {
                    let mut v = serde_json::to_value(h).map_err(|e| StoreError::Corrupt(e.to_string()))?;
                    v["step"] = json!(step);
                    v
                }
                Item::Refused(r, None) => json!({ "refused": r }),
                Item::Refused(r, Some(step)) => json!({ "refused": r, "step": step }),
            })
        })
        .collect()
}

/// Where an event is on its way downstream (003: the seconds between commit
/// and delivery must not look like a failure).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// No relay has run on this ledger.
    NoRelay,
    /// Committed; not every relay's checkpoint has passed it yet.
    Sending,
    /// Every relay's checkpoint has passed it.
    Published,
}

/// One line of a job's story: the sentence, and what it was made from.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StoryLine {
    /// The log position (absent for a refused write, which is not an event).
    pub position: Option<i64>,
    pub at: chrono::DateTime<chrono::Utc>,
    /// The workflow step the line belongs to (on a parent's page).
    pub step: Option<String>,
    pub words: String,
    pub refused: bool,
    /// The event or refusal as stored: token, attempt, actor, hash, data.
    pub raw: Value,
    pub delivery: Option<Delivery>,
    /// Later corrections of this event (annotations), in words.
    pub corrections: Vec<String>,
}

/// The job's story in plain words, with each event's delivery state.
pub async fn story(ledger: &Ledger, job: Uuid) -> Result<Vec<StoryLine>> {
    let items = items(ledger, job).await?;
    let positions: Vec<i64> = items
        .iter()
        .filter_map(|i| match i {
            Item::Event(h, _) => Some(h.position),
            Item::Refused(..) => None,
        })
        .collect();
    let delivered = delivery(ledger, &positions).await?;
    let mut corrections: std::collections::HashMap<i64, Vec<String>> = Default::default();
    for i in &items {
        if let Item::Event(h, _) = i {
            if let EventBody::Annotated {
                corrects_position, ..
            } = &h.event.body
            {
                let words = format!(
                    "{} (at position {})",
                    super::narrative::sentence(&h.event),
                    h.position
                );
                corrections.entry(*corrects_position).or_default().push(words);
            }
        }
    }
    let to_raw =
        |v: std::result::Result<Value, serde_json::Error>| v.map_err(|e| StoreError::Corrupt(e.to_string()));
    items
        .iter()
        .map(|i| {
            Ok(match i {
                Item::Event(h, step) => StoryLine {
                    position: Some(h.position),
                    at: h.event.recorded_at,
                    step: step.clone(),
                    words: super::narrative::sentence(&h.event),
                    refused: false,
                    raw: to_raw(serde_json::to_value(h))?,
                    delivery: delivered.get(&h.position).cloned(),
                    corrections: corrections.get(&h.position).cloned().unwrap_or_default(),
                },
                Item::Refused(r, step) => StoryLine {
                    position: None,
                    at: r.recorded_at,
                    step: step.clone(),
                    words: super::narrative::refused(r),
                    refused: true,
                    raw: to_raw(serde_json::to_value(r))?,
                    delivery: None,
                    corrections: vec![],
                },
            })
        })
        .collect()
}

/// Each event's delivery state: published once every relay's checkpoint
/// (txid, position) has passed it, in the relay's own order.
async fn delivery(ledger: &Ledger, positions: &[i64]) -> Result<std::collections::HashMap<i64, Delivery>> {
    let mut relays = vec![];
    for name in ledger.reader_names().await? {
        if name.starts_with("relay:") {
            if let Some(cp) = crate::store::readers::reader_checkpoint(ledger.pool(), &name).await? {
                relays.push(cp);
            }
        }
    }
    let txids = crate::store::events::txids_at(ledger.pool(), positions).await?;
    Ok(txids
        .into_iter()
        .map(|(position, txid)| {
            let d = if relays.is_empty() {
                Delivery::NoRelay
            } else if relays.iter().all(|&cp| (txid, position) <= cp) {
                Delivery::Published
            } else {
                Delivery::Sending
            };
            (position, d)
        })
        .collect())
}
