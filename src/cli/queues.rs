//! `jobledger queue pause|resume|limit|unlimit|rate|unrate|list|history`: parse, call the ledger,
//! render.

use anyhow::Result;
use serde_json::json;

use super::args::QueueCmd;
use super::output::{self, line};
use jobledger::domain::digest::fmt_time;
use jobledger::ledger::Ledger;

pub async fn run(ledger: &Ledger, action: &QueueCmd) -> Result<i32> {
    match action {
        QueueCmd::Pause {
            queue,
            reason,
            operator,
        } => line(&serde_json::to_value(
            ledger.pause_queue(queue, operator, reason).await?,
        )?),
        QueueCmd::Resume {
            queue,
            reason,
            operator,
        } => line(&serde_json::to_value(
            ledger.resume_queue(queue, operator, reason).await?,
        )?),
        QueueCmd::Limit {
            queue,
            name,
            max,
            kind,
            key,
            who,
        } => line(&serde_json::to_value(
            ledger
                .set_concurrency_limit(
                    queue,
                    name,
                    kind.as_deref(),
                    key.as_deref(),
                    *max,
                    &who.operator,
                    &who.reason,
                )
                .await?,
        )?),
        QueueCmd::Unlimit { queue, name, who } => line(&serde_json::to_value(
            ledger
                .remove_concurrency_limit(queue, name, &who.operator, &who.reason)
                .await?,
        )?),
        QueueCmd::Rate { queue, max, per, who } => line(&serde_json::to_value(
            ledger
                .set_rate_limit(queue, *max, *per, &who.operator, &who.reason)
                .await?,
        )?),
        QueueCmd::Unrate { queue, who } => line(&serde_json::to_value(
            ledger
                .remove_rate_limit(queue, &who.operator, &who.reason)
                .await?,
        )?),
        QueueCmd::List => {
            for q in ledger.queue_controls().await? {
                line(&serde_json::to_value(q)?);
            }
        }
        QueueCmd::History { queue } => {
            for e in ledger.queue_history(queue).await? {
                line(
                    &json!({ "queue": e.queue, "version": e.version, "action": e.action.as_str(),
                              "by": e.actor, "reason": e.reason, "data": e.data, "at": fmt_time(e.recorded_at),
                              "hash": e.hash }),
                );
            }
        }
    }
    Ok(output::OK)
}
