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

use anyhow::{bail, Context, Result};
use serde_json::json;
use std::sync::OnceLock;

use crate::tools::bench::{drain, enqueue_batched, expect_drained, noop_worker};
use crate::tools::otlp_sink::{self, machine_busy_ticks, postgres_ticks, process_ticks, Counts, ThreadCpu};
use jobledger::ledger::Ledger;
use jobledger::telemetry;

const ROUNDS: usize = 8;

/// The spans every job of an on round must have made and exported.
const PER_JOB: [&str; 3] = ["jobledger.claim", "jobledger.handle", "jobledger.complete"];

/// One per batch of 1,000 enqueued jobs (`enqueue_batched`).
const ENQUEUE: &str = "jobledger.enqueue";

static SINK: OnceLock<(Counts, ThreadCpu)> = OnceLock::new();

/// For `main`: the pipeline this workload measures, to a receiver in this
/// process, switched off until a round turns it on.
pub fn pipeline() -> Result<telemetry::Otlp> {
    let (endpoint, counts, cpu) = otlp_sink::start()?;
    let otlp = telemetry::Otlp::install(&endpoint)?;
    telemetry::set_enabled(false);
    let _ = SINK.set((counts, cpu));
    Ok(otlp)
}

/// Whether the command is a bench that names this workload.
pub fn wanted(cmd: &crate::cli::args::Cmd) -> bool {
    matches!(cmd, crate::cli::args::Cmd::Bench { only, .. } if only.iter().any(|o| o == "traces"))
}

/// One round's figures: drain throughput, and the CPU the whole machine
/// (this process, PostgreSQL, the kernel) spent per job, without the
/// receiver's own thread. The CPU figure is steadier than throughput on a VM
/// whose speed wanders, and it is what a 2-core machine runs out of.
struct Round {
    jobs_per_s: f64,
    cpu_ms_per_1k: f64,
    own_ms_per_1k: f64,
    pg_ms_per_1k: f64,
    sink_ms_per_1k: f64,
}

/// The receiver's counts before a round.
struct Spent(Vec<(String, u64)>);

impl Spent {
    fn of(sink: &Counts) -> Self {
        let names = PER_JOB
            .iter()
            .flat_map(|n| [n.to_string(), otlp_sink::root(n)])
            .chain([ENQUEUE.to_string()]);
        Spent(names.map(|k| (k.clone(), sink.get(&k))).collect())
    }

    /// Since `self`: each job's claim, handle and complete span, none of
    /// them the root of a trace (each continues its job's, which began at
    /// its enqueue), and one enqueue span per batch of 1,000.
    fn expect_round(&self, sink: &Counts, n: usize) -> Result<()> {
        for (name, was) in &self.0 {
            let got = sink.get(name) - was;
            let want = if name == ENQUEUE {
                n.div_ceil(1000) as u64
            } else if name.ends_with(" (root)") {
                0
            } else {
                n as u64
            };
            if got != want {
                bail!("{got} {name} spans reached the receiver, not {want}");
            }
        }
        Ok(())
    }
}

/// Median, min and max, to three places.
fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let r = |x: f64| (x * 1000.0).round() / 1000.0;
    let n = v.len();
    let mid = if n % 2 == 0 {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    };
    (r(mid), r(v[0]), r(v[n - 1]))
}

pub async fn traces(ledger: &Ledger, n: usize) -> Result<()> {
    if n == 0 {
        bail!("the traces workload needs jobs (--w3-jobs at least 1)");
    }
    let Some((sink, sink_cpu)) = SINK.get() else {
        bail!("the traces workload needs its pipeline (run it as `bench --only traces`)");
    };
    let (mut speed, mut cpu) = (vec![], vec![]);
    for round in 0..ROUNDS {
        // Off first in even rounds, on first in odd ones: each round runs on
        // a log the one before it grew, and neither side always goes second.
        let mut pair = [None, None];
        for on in if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        } {
            let queue = format!("tr-{}-{round}", if on { "on" } else { "off" });
            let before = Spent::of(sink);
            let r = drain_round(ledger, &queue, n, on, sink_cpu).await?;
            if on {
                before
                    .expect_round(sink, n)
                    .with_context(|| format!("round {round}"))?;
            }
            expect_drained(ledger, &queue, n)
                .await
                .with_context(|| format!("round {round}"))?;
            println!(
                "{}",
                json!({ "workload": if on { "W3 drain, tracing on" } else { "W3 drain, tracing off" },
                        "jobs": n, "jobs_per_s": r.jobs_per_s.round(), "cpu_ms_per_1k_jobs": r.cpu_ms_per_1k.round() })
            );
            pair[usize::from(on)] = Some(r);
        }
        let [Some(off), Some(on)] = pair else {
            unreachable!("both sides ran")
        };
        speed.push(on.jobs_per_s / off.jobs_per_s);
        cpu.push(on.cpu_ms_per_1k / off.cpu_ms_per_1k);
        println!(
            "{}",
            json!({ "workload": "W3 with tracing on against off", "round": round,
                    "off_jobs_per_s": off.jobs_per_s.round(), "on_jobs_per_s": on.jobs_per_s.round(),
                    "on_of_off": (speed[round] * 1000.0).round() / 1000.0,
                    "off_cpu_ms_per_1k_jobs": off.cpu_ms_per_1k.round(),
                    "on_cpu_ms_per_1k_jobs": on.cpu_ms_per_1k.round(),
                    "receiver_cpu_ms_per_1k_jobs": on.sink_ms_per_1k.round(),
                    "jobledger_cpu_ms_per_1k_jobs": [off.own_ms_per_1k.round(), on.own_ms_per_1k.round()],
                    "postgres_cpu_ms_per_1k_jobs": [off.pg_ms_per_1k.round(), on.pg_ms_per_1k.round()],
                    "cpu_on_of_off": (cpu[round] * 1000.0).round() / 1000.0 })
        );
    }
    let ((s_med, s_min, s_max), (c_med, c_min, c_max)) = (median(speed), median(cpu));
    println!(
        "{}",
        json!({ "workload": "W3 tracing on against off, median of the rounds", "rounds": ROUNDS,
                "on_of_off": s_med, "min": s_min, "max": s_max,
                "cpu_on_of_off": c_med, "cpu_min": c_min, "cpu_max": c_max,
                "spans": { "enqueue": sink.get("jobledger.enqueue"), "claim": sink.get("jobledger.claim"),
                           "handle": sink.get("jobledger.handle"), "complete": sink.get("jobledger.complete") } })
    );
    Ok(())
}

/// Enqueues `n` jobs (traced when `on`: they carry their trace) and drains
/// them. On, the spans still queued are exported before the round's CPU is
/// read, so every span's export is counted in its own round.
async fn drain_round(
    ledger: &Ledger,
    queue: &str,
    n: usize,
    on: bool,
    sink_cpu: &ThreadCpu,
) -> Result<Round> {
    telemetry::set_enabled(on);
    enqueue_batched(ledger, queue, n).await?;
    let (busy, own, pg, sink) = (
        machine_busy_ticks(),
        process_ticks(),
        postgres_ticks(),
        sink_cpu.ticks(),
    );
    let took = drain(noop_worker(ledger, queue, 16, None)?, n).await?;
    telemetry::set_enabled(false);
    if on {
        tokio::task::spawn_blocking(telemetry::flush).await?;
    }
    let sink = sink_cpu.ticks().saturating_sub(sink);
    let own = process_ticks().saturating_sub(own).saturating_sub(sink);
    let pg = postgres_ticks().saturating_sub(pg);
    let busy = machine_busy_ticks().saturating_sub(busy).saturating_sub(sink);
    let ms_per_1k = |ticks: u64| ticks as f64 * 1000.0 / ticks_per_s() * 1000.0 / n as f64;
    Ok(Round {
        jobs_per_s: n as f64 / took.as_secs_f64(),
        cpu_ms_per_1k: ms_per_1k(busy),
        own_ms_per_1k: ms_per_1k(own),
        pg_ms_per_1k: ms_per_1k(pg),
        sink_ms_per_1k: ms_per_1k(sink),
    })
}

/// The kernel's clock ticks per second (USER_HZ), in which /proc counts:
/// 100 on every Linux x86-64 and arm64 build. The on/off ratio does not
/// depend on it, only the absolute milliseconds do.
fn ticks_per_s() -> f64 {
    100.0
}
