//! A job's timeline: its events from the log, interleaved with the writes
//! the fence refused (and, for a workflow's parent, its steps' edges), so
//! "why did this job end like this?" reads top to bottom. Every front door
//! (the CLI's `history`, the demo, the HTTP API) renders this one.

use serde_json::{json, Value};
use uuid::Uuid;

use super::error::LedgerResult;
use super::{HistoryEntry, Ledger};
use crate::domain::digest::fmt_time;
use crate::store::rejections::RejectionRow;
use crate::store::StoreError;

type Result<T> = LedgerResult<T>;

enum Item {
    /// An event, and the workflow step it belongs to (for `history PARENT`).
    Event(HistoryEntry, Option<String>),
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
    let mut items: Vec<Item> = history.into_iter().map(|h| Item::Event(h, None)).collect();
    items.extend(
        ledger
            .rejections(job)
            .await?
            .into_iter()
            .map(|r| Item::Refused(r, None)),
    );
    // A workflow's history is its own edges and its steps', in time.
    for (m, events, refused) in members {
        items.extend(events.into_iter().map(|h| Item::Event(h, Some(m.step.clone()))));
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
        "{:>7} v{:<3} {}  {:<16} {:>16} -> {:<16} {:<24} token={} attempt={} by {}{class}",
        h.position,
        e.version,
        fmt_time(e.recorded_at),
        e.body.type_name(),
        from,
        e.to_state.as_str(),
        e.reason.as_str(),
        e.token,
        e.attempt,
        e.actor
    )
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

pub async fn lines(ledger: &Ledger, job: Uuid) -> Result<Vec<String>> {
    Ok(items(ledger, job)
        .await?
        .iter()
        .map(|i| match i {
            Item::Event(h, step) => format!("{}{}", label(step), event_line(h)),
            Item::Refused(r, step) => format!("{}{}", label(step), refused_line(r)),
        })
        .collect())
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
