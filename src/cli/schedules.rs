//! `jobledger schedule create|list|pause|resume|delete|history`: parse,
//! call the ledger, render.

use anyhow::Result;
use clap::Subcommand;
use serde_json::json;

use super::args::Who;
use super::output::{self, line, BadInput};
use super::parse::json_arg;
use jobledger::domain::digest::fmt_time;
use jobledger::domain::schedule::{Missed, ScheduleSpec};
use jobledger::ledger::Ledger;

#[derive(Subcommand, Debug)]
pub enum ScheduleCmd {
    /// A cron schedule that enqueues a job per slot (5 fields, or 6 with seconds).
    Create {
        name: String,
        #[arg(long)]
        cron: String,
        /// An IANA zone the expression is read in.
        #[arg(long, default_value = "UTC")]
        tz: String,
        #[arg(long)]
        queue: String,
        #[arg(long)]
        kind: String,
        /// JSON, @FILE or @- (stdin).
        #[arg(long, default_value = "{}")]
        payload: String,
        #[arg(long, default_value_t = 0)]
        priority: i16,
        /// What becomes of slots missed while no scheduler ran.
        #[arg(long, value_parser = ["skip", "once", "all"], default_value = "skip")]
        missed: String,
        /// With --missed all: at most this many missed slots fire.
        #[arg(long, default_value_t = 10)]
        max_catch_up: u32,
        #[command(flatten)]
        who: Who,
    },
    /// Every schedule, with its cursor and next slot.
    List,
    Pause {
        name: String,
        #[command(flatten)]
        who: Who,
    },
    /// Resume: slots that came due while paused do not fire.
    Resume {
        name: String,
        #[command(flatten)]
        who: Who,
    },
    Delete {
        name: String,
        #[command(flatten)]
        who: Who,
    },
    /// The schedule's events: changes, firings, skipped slots.
    History { name: String },
}

pub async fn run(ledger: &Ledger, action: &ScheduleCmd) -> Result<i32> {
    let shown = match action {
        ScheduleCmd::Create {
            name,
            cron,
            tz,
            queue,
            kind,
            payload,
            priority,
            missed,
            max_catch_up,
            who,
        } => {
            let missed = match missed.as_str() {
                "once" => Missed::Once,
                "all" => Missed::All,
                _ => Missed::Skip,
            };
            let spec = ScheduleSpec {
                cron: cron.clone(),
                tz: tz.clone(),
                queue: queue.clone(),
                kind: kind.clone(),
                payload: json_arg("--payload", payload, 1024 * 1024).map_err(BadInput)?,
                priority: *priority,
                missed,
                max_catch_up: *max_catch_up,
            };
            ledger
                .create_schedule(name, &spec, &who.operator, &who.reason)
                .await?
        }
        ScheduleCmd::Pause { name, who } => ledger.pause_schedule(name, &who.operator, &who.reason).await?,
        ScheduleCmd::Resume { name, who } => ledger.resume_schedule(name, &who.operator, &who.reason).await?,
        ScheduleCmd::Delete { name, who } => ledger.delete_schedule(name, &who.operator, &who.reason).await?,
        ScheduleCmd::List => {
            for s in ledger.schedules().await? {
                line(&serde_json::to_value(s)?);
            }
            return Ok(output::OK);
        }
        ScheduleCmd::History { name } => {
            for e in ledger.schedule_history(name).await? {
                line(
                    &json!({ "schedule": e.name, "version": e.version, "action": e.action.as_str(),
                              "by": e.actor, "reason": e.reason, "data": e.data,
                              "at": fmt_time(e.recorded_at), "hash": e.hash }),
                );
            }
            return Ok(output::OK);
        }
    };
    line(&serde_json::to_value(shown)?);
    Ok(output::OK)
}
