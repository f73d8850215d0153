//! The CLI's reads: a job, its timeline, the log, counts, verify.

use anyhow::Result;
use serde_json::json;

use super::args::{Cli, Cmd};
use super::human::{self, Render};
use super::output::{self, line};
use jobledger::ledger::{Found, Ledger};

/// `show`, `history`, `replay-log`, `stats`.
async fn basic(ledger: &Ledger, cli: &Cli) -> Result<i32> {
    match &cli.command {
        Cmd::Show { job, format } => {
            let v = match ledger.show(*job).await? {
                Found::Live(j) => super::workflow::shown(ledger, &j).await?,
                Found::Purged(t) => output::tombstone_json(&t),
            };
            match format.render() {
                Render::Json => line(&v),
                r => human::fields(r.colour(), &v).iter().for_each(|l| println!("{l}")),
            }
            Ok(output::OK)
        }
        Cmd::History { job, format, story } => {
            let render = format.render();
            if *story {
                for l in jobledger::ledger::timeline::story(ledger, *job).await? {
                    let at = jobledger::domain::digest::fmt_time(l.at);
                    let step = l.step.map(|s| format!("[{s}] ")).unwrap_or_default();
                    let sent = match l.delivery {
                        Some(jobledger::ledger::timeline::Delivery::Sending) => "  (committed, sending)",
                        Some(jobledger::ledger::timeline::Delivery::Published) => "  (published)",
                        _ => "",
                    };
                    println!("{at}  {step}{}{sent}", human::clean(&l.words));
                    for c in l.corrections {
                        println!("{:27}  ↳ corrected: {}", "", human::clean(&c));
                    }
                }
            } else if render == Render::Json {
                for v in jobledger::ledger::timeline::json_lines(ledger, *job).await? {
                    line(&v);
                }
            } else {
                for l in jobledger::ledger::timeline::parts(ledger, *job).await? {
                    println!("{}", human::timeline_line(render.colour(), &l));
                }
            }
            Ok(output::OK)
        }
        Cmd::ReplayLog { from, to, job, json } => {
            let mut after = from - 1;
            loop {
                let page = ledger.log_page(*from, *to, *job, after, 1000).await?;
                let Some(last) = page.last() else { break };
                after = last.position();
                for entry in &page {
                    match entry {
                        _ if *json => {
                            let mut v = serde_json::to_value(entry)?;
                            if let jobledger::ledger::LogEntry::Log { position, .. } = entry {
                                v["position"] = json!(position);
                            }
                            line(&v);
                        }
                        jobledger::ledger::LogEntry::Job(h) => {
                            println!(
                                "{} {}",
                                h.event.job_id,
                                jobledger::ledger::timeline::event_line(h)
                            )
                        }
                        jobledger::ledger::LogEntry::Log { position, row } => println!(
                            "{} #{position} checkpoint: tree of {} leaves signed, root {}",
                            row.job_id,
                            row.data["tree_size"],
                            row.data["root"].as_str().unwrap_or("?")
                        ),
                    }
                }
            }
            Ok(output::OK)
        }
        Cmd::Stats { format } => {
            let states: Vec<_> = ledger
                .counts_by_state()
                .await?
                .into_iter()
                .map(|(state, n)| json!({ "state": state, "jobs": n }))
                .collect();
            let readers = readers_json(ledger).await?;
            match format.render() {
                Render::Json => states.iter().chain(&readers).for_each(line),
                r => {
                    let columns = [
                        "reader",
                        "position",
                        "lag_events",
                        "lag_seconds",
                        "horizon_held_by",
                    ];
                    let readers: Vec<_> = readers.iter().map(reader_row).collect();
                    let mut out = human::table(r.colour(), &["state", "jobs"], &states);
                    out.push(String::new());
                    out.extend(human::table(r.colour(), &columns, &readers));
                    out.iter().for_each(|l| println!("{l}"));
                }
            }
            Ok(output::OK)
        }
        _ => unreachable!("dispatched by `run`"),
    }
}

/// `verify`: the log's replay, the audit copy or the rebuilt projection.
async fn verify(ledger: &Ledger, cli: &Cli) -> Result<i32> {
    match &cli.command {
        Cmd::Verify {
            job,
            audit_log,
            rebuilt,
            pubkey,
            head,
        } => {
            if let Some(url) = audit_log {
                return super::consume::verify_audit_log(ledger, url).await;
            }
            if *rebuilt {
                let reader = jobledger::reader::LogReader::source(ledger.pool().clone());
                let runner =
                    jobledger_projections::runner::Runner::new(ledger.pool().clone(), &reader, 5000).await?;
                runner.catch_up(&[&jobledger::rebuilt::JobsRebuilt]).await?;
                runner.check_serving(&jobledger::rebuilt::JobsRebuilt).await?;
                let problems = ledger.compare_rebuilt().await?;
                // A newer version switched in during the comparison may
                // have been read in part.
                runner.check_serving(&jobledger::rebuilt::JobsRebuilt).await?;
                for p in &problems {
                    line(&json!({ "problem": p }));
                }
                line(
                    &json!({ "ok": problems.is_empty(), "compared": "jobs_rebuilt", "problems": problems.len() }),
                );
                return Ok(if problems.is_empty() {
                    output::OK
                } else {
                    output::FAILURE
                });
            }
            let key = pubkey
                .as_deref()
                .map(jobledger::audit::keys::public_key)
                .transpose()
                .map_err(|e| super::output::BadInput(e.to_string()))?;
            let held = head
                .iter()
                .map(|h| jobledger::audit::offline::read_head(h))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| super::output::BadInput(e.to_string()))?;
            let report = ledger.verify_with(*job, key.as_ref(), &held).await?;
            for p in &report.problems {
                line(&json!({ "problem": p }));
            }
            line(
                &json!({ "ok": report.ok(), "jobs": report.jobs, "events": report.events,
                          "leaves": report.leaves, "checkpoints": report.checkpoints,
                          "problems": report.problems.len() }),
            );
            Ok(if report.ok() { output::OK } else { output::FAILURE })
        }
        _ => unreachable!("dispatched by `run`"),
    }
}

pub async fn run(ledger: &Ledger, cli: &Cli) -> Result<i32> {
    match &cli.command {
        Cmd::Verify { .. } => verify(ledger, cli).await,
        _ => basic(ledger, cli).await,
    }
}

/// A reader's line of the `stats` table: its checkpoint's position, and who
/// holds the horizon back in a few words (the JSON has the query text).
fn reader_row(v: &serde_json::Value) -> serde_json::Value {
    let h = &v["horizon_held_by"];
    let held = match h["kind"].as_str() {
        None => serde_json::Value::Null,
        Some(kind) => {
            let who = h["pid"].as_i64().map(|p| format!(" pid {p}")).unwrap_or_default();
            let gid = h["gid"].as_str().map(|g| format!(" {g:?}")).unwrap_or_default();
            let state = h["state"].as_str().map(|s| format!(", {s}")).unwrap_or_default();
            let open = h["open_seconds"]
                .as_f64()
                .map(|s| format!(", open {s:.0} s"))
                .unwrap_or_default();
            json!(format!("{kind}{who}{gid}{state}{open}"))
        }
    };
    json!({ "reader": v["reader"], "position": v["checkpoint"]["position"], "lag_events": v["lag_events"],
            "lag_seconds": v["lag_seconds"], "horizon_held_by": held })
}

/// Every named log reader (the relay, consumers) with how far behind the
/// log it is and what holds the horizon back: `stats` and `GET /v1/readers`.
pub async fn readers_json(ledger: &Ledger) -> Result<Vec<serde_json::Value>> {
    let mut out = vec![];
    for name in ledger.reader_names().await? {
        let reader = jobledger::reader::LogReader::open(ledger.pool().clone(), &name).await?;
        let cp = reader.checkpoint().await?;
        let lag = reader.lag(cp).await?;
        out.push(
            json!({ "reader": name, "checkpoint": cp, "lag_events": lag.events,
                         "lag_seconds": lag.seconds, "horizon_held_by": lag.horizon_holder }),
        );
    }
    Ok(out)
}
