//! `bench --only traces`: what tracing costs W3. Rounds alternate tracing
//! off and on (the VM's speed wanders, docs/benchmarks.md), each draining
//! fresh no-op jobs with the same 16-way worker; on, every job's enqueue,
//! claim, handler and completion are spans exported over OTLP/gRPC to a
//! receiver in this process (`otlp_sink`), which must have got them all.
//!
//! The process installs the OpenTelemetry layer once (`pipeline`), and the
//! rounds switch it with `telemetry::set_enabled`: off here still has the
//! layer and its filter, a little more than a process without an endpoint.
//! That one is compared with the build before tracing in docs/benchmarks.md.

use anyhow::{bail, Result};
use serde_json::json;
use std::sync::OnceLock;
use std::time::Instant;

use crate::tools::bench::{drain, enqueue_batched, noop_worker, report};
use crate::tools::otlp_sink::{self, Counts};
use jobledger::ledger::Ledger;
use jobledger::telemetry;

const ROUNDS: usize = 5;

/// The spans every job of an on round must have made and exported.
const PER_JOB: [&str; 3] = ["jobledger.claim", "jobledger.handle", "jobledger.complete"];

static SINK: OnceLock<Counts> = OnceLock::new();

/// For `main`: the pipeline this workload measures, to a receiver in this
/// process, switched off until a round turns it on.
pub fn pipeline() -> Result<telemetry::Otlp> {
    let (endpoint, counts) = otlp_sink::start()?;
    let otlp = telemetry::Otlp::install(&endpoint)?;
    telemetry::set_enabled(false);
    let _ = SINK.set(counts);
    Ok(otlp)
}

/// Whether the command is a bench that names this workload.
pub fn wanted(cmd: &crate::cli::args::Cmd) -> bool {
    matches!(cmd, crate::cli::args::Cmd::Bench { only, .. } if only.iter().any(|o| o == "traces"))
}

pub async fn traces(ledger: &Ledger, n: usize) -> Result<()> {
    let Some(sink) = SINK.get() else {
        bail!("the traces workload needs its pipeline (run it as `bench --only traces`)");
    };
    let mut ratios = vec![];
    for round in 0..ROUNDS {
        let off = drain_round(ledger, &format!("tr-off-{round}"), n, false).await?;
        let before: Vec<u64> = PER_JOB.iter().map(|s| sink.get(s)).collect();
        let on = drain_round(ledger, &format!("tr-on-{round}"), n, true).await?;
        tokio::task::spawn_blocking(telemetry::flush).await?;
        for (name, was) in PER_JOB.iter().zip(before) {
            let got = sink.get(name) - was;
            if got != n as u64 {
                bail!("round {round}: {got} {name} spans reached the receiver, not {n}");
            }
        }
        ratios.push(on / off);
        println!(
            "{}",
            json!({ "workload": "W3 with tracing on against off", "round": round,
                    "off_jobs_per_s": off.round(), "on_jobs_per_s": on.round(),
                    "on_of_off": (on / off * 1000.0).round() / 1000.0 })
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "{}",
        json!({ "workload": "W3 tracing on against off, median of the rounds", "rounds": ROUNDS,
                "on_of_off": (ratios[ROUNDS / 2] * 1000.0).round() / 1000.0,
                "min": (ratios[0] * 1000.0).round() / 1000.0,
                "max": (ratios[ROUNDS - 1] * 1000.0).round() / 1000.0,
                "spans": { "enqueue": sink.get("jobledger.enqueue"), "claim": sink.get("jobledger.claim"),
                           "handle": sink.get("jobledger.handle"), "complete": sink.get("jobledger.complete") } })
    );
    Ok(())
}

/// Enqueues `n` jobs (traced when `on`: they carry their trace) and drains
/// them; jobs/s of the drain.
async fn drain_round(ledger: &Ledger, queue: &str, n: usize, on: bool) -> Result<f64> {
    telemetry::set_enabled(on);
    enqueue_batched(ledger, queue, n).await?;
    let took = drain(noop_worker(ledger, queue, 16, None)?, n).await?;
    telemetry::set_enabled(false);
    report(
        if on {
            "W3 drain, tracing on"
        } else {
            "W3 drain, tracing off"
        },
        n,
        Instant::now() - took,
        json!({}),
    );
    Ok(n as f64 / took.as_secs_f64())
}
