//! `jobledger projections list|status|run|rebuild NAME`.

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use super::output::{self, line};
use jobledger::ledger::Ledger;
use jobledger::reader::{Checkpoint, LogReader};
use jobledger_projections::registry;
use jobledger_projections::runner::Runner;
use jobledger_projections::shipped::{JobTimeline, QueueStats};
use jobledger_projections::Projection;

pub fn shipped() -> [&'static dyn Projection; 4] {
    [
        &JobTimeline,
        &QueueStats,
        &jobledger::rebuilt::JobsRebuilt,
        &jobledger_projections::workflows::Workflows,
    ]
}

pub async fn run(ledger: &Ledger, action: &str, name: Option<&str>) -> Result<i32> {
    let reader = LogReader::source(ledger.pool().clone());
    let runner = Runner::new(ledger.pool().clone(), &reader, 5000).await?;
    match action {
        "run" => {
            // One projection that cannot catch up does not keep the others
            // behind: each is tried, and the command fails at the end.
            let mut failed = vec![];
            for p in shipped() {
                match runner.catch_up(&[p]).await {
                    Ok(s) => line(
                        &json!({ "projection": p.name(), "applied": s.applied, "rebuilt": s.rebuilt,
                                  "switched_to": s.switched_to }),
                    ),
                    Err(e) => {
                        line(&json!({ "projection": p.name(), "error": e.to_string() }));
                        failed.push(p.name());
                    }
                }
            }
            if !failed.is_empty() {
                bail!("projections not caught up: {}", failed.join(", "));
            }
        }
        "rebuild" => {
            let Some(name) = name else {
                bail!(super::output::BadInput("rebuild needs a projection name".into()))
            };
            let table = start_rebuild(ledger, name).await?;
            let p = shipped()
                .into_iter()
                .find(|p| p.name() == name)
                .expect("start_rebuild knows it");
            let entry = registry::entries(ledger.pool())
                .await?
                .into_iter()
                .find(|e| e.name == name);
            let from = entry
                .map(|e| Checkpoint {
                    txid: e.b_txid,
                    position: e.b_position,
                })
                .unwrap_or_default();
            let total = reader.lag(from).await?.events.max(1) as u64;
            let bar = ProgressBar::new(total).with_style(
                ProgressStyle::with_template("{msg} [{bar:40}] {human_pos}/{human_len} events, ETA {eta}")
                    .expect("template")
                    .progress_chars("=> "),
            );
            bar.set_message(format!("rebuilding {name} into {table}"));
            let v = match runner.finish_rebuild(p, &table, |n| bar.inc(n as u64)).await {
                Ok(v) => v,
                Err(e) => {
                    bar.abandon();
                    return Err(e.into());
                }
            };
            bar.finish_with_message(format!("{name}: switched to the rebuilt table (version {v})"));
            line(&json!({ "projection": name, "rebuilt_events": bar.position(), "switched_to": v }));
        }
        _ => {
            for v in status_json(ledger, &reader, action == "status").await? {
                line(&v);
            }
        }
    }
    Ok(output::OK)
}

/// `projections query NAME [--job J] [--min-position P]`: the view's rows,
/// or `{"pending": true}` when the projection has not reached P within the
/// timeout — never an older generation silently.
pub async fn query(
    ledger: &Ledger,
    name: Option<&str>,
    job: Option<uuid::Uuid>,
    min_position: Option<i64>,
    timeout: std::time::Duration,
) -> Result<i32> {
    let Some(name) = name else {
        bail!(super::output::BadInput("query needs a projection name".into()))
    };
    if !shipped().iter().any(|p| p.name() == name) {
        bail!(super::output::BadInput(format!("unknown projection {name:?}")));
    }
    if let Some(p) = min_position {
        let Some(txid) = ledger.txid_of_position(p).await? else {
            bail!(super::output::BadInput(format!("no event at position {p}")));
        };
        use jobledger_projections::runner::{wait_for, Freshness};
        if wait_for(ledger.pool(), name, txid, p, timeout).await? == Freshness::Pending {
            line(&json!({ "pending": true, "projection": name, "min_position": p }));
            return Ok(output::OK);
        }
    }
    for row in ledger.projection_rows(name, job).await? {
        line(&row);
    }
    Ok(output::OK)
}

/// Each projection's registry entry; with `lag`, how far behind the log its
/// serving table (and a rebuild in progress) is. `projections list|status`
/// and `GET /v1/projections` print these.
pub async fn status_json(ledger: &Ledger, reader: &LogReader, lag: bool) -> Result<Vec<serde_json::Value>> {
    let mut out = vec![];
    for e in registry::entries(ledger.pool()).await? {
        let mut v = json!({ "projection": e.name, "version": e.version, "table": e.active_table,
                            "checkpoint": { "txid": e.txid, "position": e.position },
                            "rebuilding": e.building_version, "rebuild_table": e.building_table });
        if lag {
            let l = reader
                .lag(Checkpoint {
                    txid: e.txid,
                    position: e.position,
                })
                .await?;
            v["lag_events"] = json!(l.events);
            v["lag_seconds"] = json!(l.seconds);
            if e.building_table.is_some() {
                let b = reader
                    .lag(Checkpoint {
                        txid: e.b_txid,
                        position: e.b_position,
                    })
                    .await?;
                v["rebuild_remaining_events"] = json!(b.events);
            }
        }
        out.push(v);
    }
    Ok(out)
}

/// Starts rebuilding `name` into a fresh table and returns that table's
/// name; the projections service (`projections run`) carries it on while
/// the serving table keeps serving (`projections rebuild` also drives it).
pub async fn start_rebuild(ledger: &Ledger, name: &str) -> Result<String> {
    let Some(p) = shipped().into_iter().find(|p| p.name() == name) else {
        bail!(super::output::BadInput(format!("unknown projection {name:?}")));
    };
    let reader = LogReader::source(ledger.pool().clone());
    let runner = Runner::new(ledger.pool().clone(), &reader, 5000).await?;
    Ok(runner.start_rebuild(p).await?)
}

/// The `queue_stats` projection's rows, given `status_json`'s entries:
/// none before the projections service first ran (there is no view yet).
pub async fn queue_stats_rows(
    ledger: &Ledger,
    status: &[serde_json::Value],
) -> Result<Vec<serde_json::Value>> {
    if !status.iter().any(|p| p["projection"] == "queue_stats") {
        return Ok(vec![]);
    }
    Ok(ledger.projection_rows("queue_stats", None).await?)
}
