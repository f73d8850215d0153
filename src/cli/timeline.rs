//! `history`: a job's events from the log, interleaved with the writes the
//! fence refused, so "why did this job end like this?" reads top to bottom.

use anyhow::Result;
use serde_json::{json, Value};
use uuid::Uuid;

use jobledger::domain::digest::fmt_time;
use jobledger::ledger::{HistoryEntry, Ledger};
use jobledger::store::rejections::RejectionRow;

enum Item {
    Event(HistoryEntry),
    Refused(RejectionRow),
}

impl Item {
    fn at(&self) -> chrono::DateTime<chrono::Utc> {
        match self {
            Item::Event(h) => h.event.recorded_at,
            Item::Refused(r) => r.recorded_at,
        }
    }
}

async fn items(ledger: &Ledger, job: Uuid) -> Result<Vec<Item>> {
    let mut items: Vec<Item> = ledger.history(job).await?.into_iter().map(Item::Event).collect();
    items.extend(ledger.rejections(job).await?.into_iter().map(Item::Refused));
    // Stable: events keep their version order; a refusal sorts after the
    // events that were already there when it was refused.
    items.sort_by_key(Item::at);
    Ok(items)
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
            Item::Event(h) => event_line(h),
            Item::Refused(r) => refused_line(r),
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
                Item::Event(h) => serde_json::to_value(h)?,
                Item::Refused(r) => json!({ "refused": r }),
            })
        })
        .collect()
}
