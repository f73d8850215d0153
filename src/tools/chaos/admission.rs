//! The chaos run's admission share: every refund carries one of a few
//! merchant keys under a per-key limit, and a per-second schedule fires
//! refunds of its own through the worker processes' schedulers (whose
//! lease moves as processes die and freeze). The checker reads both back
//! from the log.

use anyhow::Result;
use serde_json::json;

use super::check::Report;
use super::QUEUE;
use jobledger::domain::schedule::{Missed, ScheduleSpec};
use jobledger::ledger::Ledger;
use jobledger::store::audit;

pub const MERCHANTS: usize = 8;
pub const PER_MERCHANT: i32 = 3;
pub const SCHEDULE: &str = "chaos-tick";

pub fn merchant_of(i: usize) -> String {
    format!("merchant-{}", i % MERCHANTS)
}

/// Sets the limit and creates the schedule, before any job exists.
pub async fn set_up(ledger: &Ledger) -> Result<()> {
    ledger
        .set_concurrency_limit(
            QUEUE,
            "per-merchant",
            None,
            Some("merchant-*"),
            PER_MERCHANT,
            "chaos",
            "per-merchant cap",
        )
        .await?;
    let spec = ScheduleSpec {
        cron: "* * * * * *".into(),
        tz: "UTC".into(),
        queue: QUEUE.into(),
        kind: "refund".into(),
        payload: json!({ "order": "tick", "amount_cents": 100, "refuse": false }),
        priority: 0,
        missed: Missed::All,
        max_catch_up: 1000,
    };
    ledger
        .create_schedule(SCHEDULE, &spec, "chaos", "a refund a second")
        .await?;
    Ok(())
}

/// Stops the schedule (the drain must end) and returns the jobs it fired.
pub async fn wind_down(ledger: &Ledger) -> Result<Vec<uuid::Uuid>> {
    ledger.pause_schedule(SCHEDULE, "chaos", "the run drains").await?;
    let fired = ledger
        .schedule_history(SCHEDULE)
        .await?
        .into_iter()
        .filter(|e| e.action.as_str() == "fired")
        .map(|e| serde_json::from_value(e.data["job_id"].clone()))
        .collect::<Result<_, _>>()?;
    Ok(fired)
}

/// Never more than the cap leased per key at once; every slot of the
/// schedule from its creation to its cursor fired once or was recorded as
/// skipped; slots fired in order.
pub async fn check(ledger: &Ledger, r: &mut Report) -> Result<()> {
    let most = audit::most_leased_per_key(ledger.pool()).await?;
    let over: Vec<String> = most
        .iter()
        .filter(|(_, n)| *n > i64::from(PER_MERCHANT))
        .map(|(k, n)| format!("{k}: {n} leased at once (cap {PER_MERCHANT})"))
        .collect();
    r.check(
        "never more than the cap leased per key at once (from the log)",
        &over,
    );
    r.most_leased_per_key = most.iter().map(|(_, n)| *n).max().unwrap_or(0);
    let h = ledger.schedule_history(SCHEDULE).await?;
    let time = |e: &jobledger::domain::schedule::ScheduleEvent, f: &str| {
        e.data[f]
            .as_str()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.timestamp())
    };
    let created = h.first().and_then(|e| time(e, "cursor")).unwrap_or_default();
    let mut last = created;
    let mut problems = vec![];
    let (mut fired, mut skipped) = (0i64, 0i64);
    for e in &h {
        let at = match e.action.as_str() {
            "fired" => {
                fired += 1;
                time(e, "slot")
            }
            "skipped" => {
                skipped += e.data["count"].as_i64().unwrap_or(0);
                time(e, "last")
            }
            _ => continue,
        };
        match at {
            Some(t) if t > last => last = t,
            other => problems.push(format!("v{}: slot {other:?} does not follow {last}", e.version)),
        }
    }
    if fired + skipped != last - created {
        problems.push(format!(
            "{} per-second slots from creation to the cursor, {fired} fired and {skipped} skipped",
            last - created
        ));
    }
    r.check(
        "every schedule slot fired once or was recorded as skipped",
        &problems,
    );
    r.schedule_fired = fired;
    r.schedule_skipped = skipped;
    Ok(())
}
