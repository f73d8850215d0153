//! `jobledger chaos`: many refund jobs through several worker processes
//! against a misbehaving provider while processes die and freeze, the relay
//! restarts, the broker vanishes and PostgreSQL restarts; then an independent
//! checker over everything recorded (docs/reliability.md).

mod admission;
mod check;
mod faults;
mod kafka_check;
mod procs;
pub mod provider;
pub mod worker;

use anyhow::{Context, Result};
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use crate::tools::bench::{drop_database, with_database};
use crate::tools::output::{self, line};
use jobledger::ledger::Ledger;
use procs::Proc;

/// The run's progress bar, when stderr is a terminal: the run's messages
/// go above it (`say!`) instead of through it.
static BAR: std::sync::OnceLock<indicatif::ProgressBar> = std::sync::OnceLock::new();

/// `eprintln!` that keeps clear of the progress bar.
macro_rules! say {
    ($($t:tt)*) => {
        match crate::tools::chaos::BAR.get() {
            Some(bar) if !bar.is_finished() => bar.println(format!($($t)*)),
            _ => eprintln!($($t)*),
        }
    };
}
pub(crate) use say;

pub const QUEUE: &str = "chaos";

#[derive(clap::Args, Debug, Clone)]
pub struct ChaosArgs {
    /// Jobs to run [default: 20000, or 1000 with --quick].
    #[arg(long)]
    pub jobs: Option<usize>,
    /// The CI size: fewer jobs, a short window, the memory broker (no
    /// broker restart).
    #[arg(long)]
    pub quick: bool,
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Seconds over which jobs are enqueued while faults are injected
    /// [default: 240, or 20 with --quick].
    #[arg(long)]
    pub window: Option<u64>,
    /// Seed of the provider's and the fault schedule's randomness.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Database of the run (dropped and recreated; kept afterwards for
    /// inspection). The mirror consumer uses `<name>_mirror`.
    #[arg(long, default_value = "jobledger_chaos")]
    pub database: String,
    /// Broker storage: `sqlite` (durable; the broker is also killed and
    /// restarted once) or `memory` [default: sqlite, or memory with --quick].
    #[arg(long, value_parser = ["memory", "sqlite"])]
    pub storage: Option<String>,
    /// Do not restart PostgreSQL (for a cluster this user cannot restart).
    #[arg(long)]
    pub no_pg_restart: bool,
    /// Workers skip reconciliation (no lookup after a takeover or a lost
    /// answer). Shows that the checker catches double executions: such a
    /// run must fail.
    #[arg(long)]
    pub careless: bool,
    /// Logs of every process of the run go under here.
    #[arg(long, default_value = "target/chaos")]
    pub dir: PathBuf,
}

/// What one run does, derived from the arguments.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Plan {
    pub jobs: usize,
    pub workers: usize,
    pub window_s: u64,
    pub seed: u64,
    pub fault_every_ms: u64,
    pub lease_ms: u64,
    pub broker_stall_s: u64,
    pub durable_broker: bool,
    pub broker_restart: bool,
    pub pg_restart: bool,
    pub careless: bool,
}

impl Plan {
    fn from(a: &ChaosArgs) -> Self {
        Plan {
            jobs: a.jobs.unwrap_or(if a.quick { 1_000 } else { 20_000 }),
            workers: a.workers.max(2),
            window_s: a.window.unwrap_or(if a.quick { 20 } else { 240 }),
            seed: a.seed.unwrap_or_else(rand::random),
            fault_every_ms: if a.quick { 1_200 } else { 3_000 },
            lease_ms: 2_000,
            // Past the relay's message timeout (3s) and the clients' session timeouts.
            broker_stall_s: if a.quick { 5 } else { 15 },
            durable_broker: a.storage.as_deref().map_or(!a.quick, |s| s == "sqlite"),
            broker_restart: a.storage.as_deref().map_or(!a.quick, |s| s == "sqlite"),
            pg_restart: !a.no_pg_restart,
            careless: a.careless,
        }
    }
}

/// Everything running during the run.
pub struct Cluster {
    pub workers: Vec<Proc>,
    pub relay: Proc,
    pub mirror: Proc,
    pub broker: Proc,
    pub broker_port: u16,
    pub pg_port: u16,
}

pub async fn run(base_url: &str, args: &ChaosArgs) -> Result<i32> {
    let plan = Plan::from(args);
    procs::kill_children_on_signal();
    let run_id = format!("{}", chrono::Utc::now().format("%Y%m%dT%H%M%S"));
    let dir = std::fs::canonicalize(".")?.join(&args.dir).join(&run_id);
    std::fs::create_dir_all(&dir)?;
    eprintln!("chaos: plan {}", serde_json::to_string(&plan)?);
    eprintln!("chaos: logs in {}", dir.display());

    let url = with_database(base_url, &args.database)?;
    let mirror_url = with_database(base_url, &format!("{}_mirror", args.database))?;
    drop_database(base_url, &args.database).await;
    drop_database(base_url, &format!("{}_mirror", args.database)).await;
    jobledger::store::schema::create_database_if_missing(&jobledger::ledger::connect_options(&url)?).await?;
    let ledger = Ledger::connect_and_migrate(&url, 8)
        .await
        .context("chaos database")?;
    let pg_port = jobledger::ledger::connect_options(&url)?.get_port();

    let stop = CancellationToken::new();
    let provider = provider::Provider::new(
        plan.seed,
        provider::Faults {
            transient: 0.04,
            lost: 0.03,
            late: 0.03,
            late_by: Duration::from_millis(1_200),
        },
    );
    let provider_addr = provider.serve(stop.clone()).await?;

    let broker_port = procs::free_port()?;
    let brokers = format!("127.0.0.1:{broker_port}");
    let topic = format!("chaos-{run_id}");
    let mut broker = procs::broker(&dir, broker_port, plan.durable_broker);
    broker.start()?;
    procs::wait_for_port(broker_port, Duration::from_secs(60)).await?;

    let exe = std::env::current_exe()?;
    let cmd = |name: &str, rest: &[&str]| {
        let mut a = vec!["--database-url".to_string(), url.clone()];
        a.extend(rest.iter().map(|s| s.to_string()));
        Proc::new(name, exe.clone(), a, &dir)
    };
    let lease = format!("{}ms", plan.lease_ms);
    let mut cluster = Cluster {
        workers: (0..plan.workers)
            .map(|i| {
                let name = format!("worker-{i}");
                let mut rest = vec![
                    "chaos-worker",
                    "--provider",
                    &provider_addr,
                    "--name",
                    &name,
                    "--lease",
                    &lease,
                ];
                if plan.careless {
                    rest.push("--careless");
                }
                cmd(&name, &rest)
            })
            .collect(),
        relay: cmd(
            "relay",
            &[
                "relay",
                "--brokers",
                &brokers,
                "--topic",
                &topic,
                "--partitions",
                "4",
                "--lease",
                "3s",
                "--message-timeout",
                "3s",
                "--batch",
                "2000",
            ],
        ),
        mirror: cmd(
            "mirror",
            &[
                "consume",
                "status-mirror",
                "--brokers",
                &brokers,
                "--topic",
                &topic,
                "--group",
                "chaos-mirror",
                "--consumer-database-url",
                &mirror_url,
            ],
        ),
        broker,
        broker_port,
        pg_port,
    };
    for w in &mut cluster.workers {
        w.start()?;
    }
    cluster.relay.start()?;
    let relay_reader = format!("relay:{topic}");
    check::until(
        "the relay has created its topic",
        Duration::from_secs(60),
        || async {
            let (b, t) = (brokers.clone(), topic.clone());
            tokio::task::spawn_blocking(move || kafka_check::partitions(&b, &t).is_ok_and(|p| !p.is_empty()))
                .await
                .unwrap_or(false)
        },
    )
    .await?;
    cluster.mirror.start()?;

    admission::set_up(&ledger).await?;
    let started = Instant::now();
    let bar = progress(&ledger, plan.jobs, stop.clone());
    let (mut enqueued, faults) = faults::inject(&ledger, &plan, &mut cluster).await?;
    enqueued.extend(
        admission::wind_down(&ledger)
            .await?
            .into_iter()
            .map(|job_id| faults::Enqueued { job_id }),
    );
    say!(
        "chaos: {} jobs enqueued in {:.0}s; faults stopped, draining",
        enqueued.len(),
        started.elapsed().as_secs_f64()
    );

    let drain = Duration::from_secs(if args.quick { 180 } else { 900 });
    let mirror = check::mirror_pool(&mirror_url).await?;
    let drained = check::drain(&ledger, &relay_reader, &mirror, drain).await;
    for w in &mut cluster.workers {
        w.stop(Duration::from_secs(10)).await;
    }
    cluster.relay.stop(Duration::from_secs(10)).await;
    cluster.mirror.stop(Duration::from_secs(10)).await;

    drop(bar); // leaves the last count on screen; messages go below it
    let mut report = check::Report::new(&plan, faults, started.elapsed());
    if let Err(e) = &drained {
        report.violation(format!("drain: {e:#}"));
    }
    check::ledger_invariants(&ledger, &enqueued, &mut report).await?;
    admission::check(&ledger, &mut report).await?;
    check::provider_agreement(&ledger, &provider, &mut report).await?;
    check::mirror_equals_jobs(&ledger, &mirror, &mut report).await?;
    report.consumers = check::process_outputs(&cluster.mirror.out_path());
    report.workers = check::process_outputs_sum(cluster.workers.iter().map(|w| w.out_path()));
    kafka_check::every_event_in_order(&ledger, &brokers, &topic, &mut report).await?;
    cluster.broker.stop(Duration::from_secs(5)).await;
    stop.cancel();
    mirror.close().await;
    ledger.pool().close().await;

    report.print();
    line(&json!({ "chaos": report }));
    Ok(if report.violations.is_empty() {
        output::OK
    } else {
        output::FAILURE
    })
}

/// Jobs ended of those planned, with rate and ETA, on a terminal's stderr
/// (nothing when piped: no bar and no polling). Reads the database once a
/// second and shrugs off the errors of the planned PostgreSQL restart.
fn progress(ledger: &Ledger, jobs: usize, stop: CancellationToken) -> Option<BarTask> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let ledger = ledger.clone();
    Some(BarTask(tokio::spawn(async move {
        let bar = BAR
            .get_or_init(|| indicatif::ProgressBar::new(jobs as u64))
            .clone()
            .with_style(
                indicatif::ProgressStyle::with_template("chaos [{bar:40}] {pos}/{len} jobs ended, ETA {eta}")
                    .expect("template")
                    .progress_chars("=> "),
            );
        while !stop.is_cancelled() {
            if let Ok(counts) = ledger.counts_by_state().await {
                let (mut ended, mut all) = (0, 0);
                for (state, n) in counts {
                    all += n as u64;
                    if jobledger::domain::JobState::parse(&state).is_some_and(|s| s.is_terminal()) {
                        ended += n as u64;
                    }
                }
                bar.set_length(all.max(jobs as u64));
                bar.set_position(ended);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        bar.finish();
    })))
}

/// The bar's polling task: stopped, and the bar finished, however the run
/// leaves (an error between the start and the drain included).
struct BarTask(tokio::task::JoinHandle<()>);

impl Drop for BarTask {
    fn drop(&mut self) {
        self.0.abort();
        if let Some(b) = BAR.get() {
            b.finish();
        }
    }
}
