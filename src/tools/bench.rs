//! `jobledger bench`: throughput and latency figures, printed as JSON lines
//! {workload, jobs, seconds, jobs_per_s, ...}. Every job gets its events,
//! hash chain and fence; nothing is skipped to look fast. Runs in a
//! throwaway database on the server of --database-url, dropped afterwards.

use anyhow::{bail, Context, Result};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use jobledger::domain::NewJob;
use jobledger::ledger::Ledger;
use jobledger::worker::{HandlerOutcome, Worker};

pub struct BenchArgs {
    pub url: String,
    pub only: Vec<String>,
    pub w1_jobs: usize,
    pub w2_jobs: usize,
    pub w2_clients: usize,
    pub w3_jobs: usize,
    pub history_events: usize,
    pub latency_samples: usize,
    pub brokers: String,
    /// Worker prefetch for W3 (default: the worker's own, which follows the
    /// handlers' pace).
    pub prefetch: Option<usize>,
}

pub(crate) fn job(queue: &str, i: usize) -> NewJob {
    NewJob {
        queue: queue.into(),
        kind: "noop".into(),
        job_key: None,
        payload: json!({ "i": i }),
        priority: 0,
        run_at: None,
        delay_ms: None,
        policy: None,
        concurrency_key: None,
        unique_for_ms: None,
    }
}

/// Prints one figure: `jobs` done in `took`.
pub(crate) fn report(workload: &str, jobs: usize, took: Duration, extra: serde_json::Value) {
    let seconds = took.as_secs_f64();
    let mut v = json!({ "workload": workload, "jobs": jobs, "seconds": (seconds * 1000.0).round() / 1000.0,
                        "jobs_per_s": (jobs as f64 / seconds).round() });
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    println!("{v}");
}

pub async fn run(args: BenchArgs) -> Result<i32> {
    let name = format!("jobledger_bench_{}", std::process::id());
    let url = with_database(&args.url, &name)?;
    let ledger = Ledger::connect_and_migrate(&url, 40)
        .await
        .context("bench database")?;
    let wants = |w: &str| args.only.is_empty() || args.only.iter().any(|o| o == w);
    let result = async {
        if wants("w1") {
            w1(&ledger, args.w1_jobs).await?;
        }
        if wants("w2") {
            w2(&ledger, "w2", args.w2_jobs, args.w2_clients).await?;
        }
        if wants("w3") {
            w3(&ledger, "w3", args.w3_jobs, args.prefetch).await?;
        }
        if wants("latency") {
            latency(&ledger, args.latency_samples).await?;
        }
        if wants("relay") {
            crate::tools::bench_kafka::relay_throughput(&ledger, &args.brokers, 200_000).await?;
        }
        if wants("e2e") {
            let curl = with_database(&args.url, &format!("{name}_consumer"))?;
            let r = crate::tools::bench_kafka::end_to_end(&ledger, &args.brokers, &curl, 1000, 10).await;
            drop_database(&args.url, &format!("{name}_consumer")).await;
            r?;
        }
        if wants("lag") {
            catch_up_lag(&ledger, args.w3_jobs).await?;
        }
        if wants("rebuild") {
            rebuild_rate(&ledger, args.history_events).await?;
        }
        if wants("workflows") {
            crate::tools::bench_workflows::workflows(&ledger, 1000).await?;
        }
        if wants("serve") {
            crate::tools::bench_serve::serve(&ledger, args.history_events, 10_000).await?;
        }
        if wants("audit") {
            crate::tools::bench_audit::audit(&ledger, args.history_events, args.w3_jobs).await?;
        }
        if wants("limits") {
            crate::tools::bench_limits::limits(&ledger, args.w3_jobs).await?;
        }
        // Only when named: it needs the pipeline `main` installs for it.
        if args.only.iter().any(|o| o == "traces") {
            crate::tools::bench_traces::traces(&ledger, args.w3_jobs).await?;
        }
        if wants("w3-history") {
            history(&ledger, args.history_events).await?;
            w3(&ledger, "w3-history", args.w3_jobs, args.prefetch).await?;
        }
        anyhow::Ok(())
    }
    .await;
    ledger.pool().close().await;
    // JOBLEDGER_BENCH_KEEP=1 keeps the database (profiling one phase of a
    // bench by hand afterwards, e.g. `export` and `audit` on its log).
    if std::env::var_os("JOBLEDGER_BENCH_KEEP").is_some() {
        eprintln!("bench: kept database {name}");
    } else {
        drop_database(&args.url, &name).await;
    }
    result.map(|_| 0)
}

pub fn with_database(url: &str, name: &str) -> Result<String> {
    let mut u = url::Url::parse(url).context("database url")?;
    u.set_path(&format!("/{name}"));
    Ok(u.to_string())
}

pub async fn drop_database(url: &str, name: &str) {
    let Ok(admin_url) = with_database(url, "postgres") else {
        return;
    };
    if let Ok(admin) = Ledger::connect(&admin_url, 1).await {
        if let Err(e) = jobledger::store::schema::drop_database(admin.pool(), name).await {
            eprintln!("bench: could not drop {name}: {e}");
        }
    }
}

/// A figure prints only when the log holds what it claims: `n` events of
/// `kind` in `queue`, counted after the clock stopped.
async fn expect_events(ledger: &Ledger, queue: &str, kind: &str, n: usize) -> Result<()> {
    let got = ledger.count_events_in(queue, kind).await?;
    if got != n as i64 {
        bail!("{queue}: {got} {kind} events in the log, not {n}");
    }
    Ok(())
}

/// A drain's figure prints only when each of its `n` jobs has its
/// `enqueued`, `claimed` and `succeeded` event in `queue`.
pub(crate) async fn expect_drained(ledger: &Ledger, queue: &str, n: usize) -> Result<()> {
    for kind in ["enqueued", "claimed", "succeeded"] {
        expect_events(ledger, queue, kind, n).await?;
    }
    Ok(())
}

/// W1: one job per call from 8 concurrent clients, each call waiting for
/// its job's commit.
async fn w1(ledger: &Ledger, n: usize) -> Result<()> {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..8 {
        let l = ledger.clone();
        tasks.spawn(async move {
            for i in (c..n).step_by(8) {
                l.enqueue(job("w1", i)).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let took = started.elapsed();
    expect_events(ledger, "w1", "enqueued", n).await?;
    // Each call enqueues one job and returns once it is committed; calls
    // that overlap share a statement (ledger::combine): say how many.
    let transactions = ledger.count_transactions_in("w1", "enqueued").await?;
    report(
        "W1 enqueue, 1 job per call, 8 clients",
        n,
        took,
        json!({ "transactions": transactions }),
    );
    Ok(())
}

/// W2: batches of 1,000 jobs per transaction, from 4 concurrent clients by
/// default (one client leaves a core idle while the other works).
async fn w2(ledger: &Ledger, queue: &str, n: usize, clients: usize) -> Result<()> {
    let started = Instant::now();
    enqueue_batched_by(ledger, queue, n, clients).await?;
    let took = started.elapsed();
    expect_events(ledger, queue, "enqueued", n).await?;
    let label = format!(
        "W2 enqueue, batches of 1000, {clients} client{}",
        if clients == 1 { "" } else { "s" }
    );
    report(&label, n, took, json!({}));
    Ok(())
}

pub(crate) async fn enqueue_batched(ledger: &Ledger, queue: &str, n: usize) -> Result<()> {
    enqueue_batched_by(ledger, queue, n, 4).await
}

async fn enqueue_batched_by(ledger: &Ledger, queue: &str, n: usize, clients: usize) -> Result<()> {
    let chunks: Vec<Vec<usize>> = (0..n)
        .collect::<Vec<_>>()
        .chunks(1000)
        .map(<[usize]>::to_vec)
        .collect();
    let chunks = Arc::new(std::sync::Mutex::new(chunks));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (l, chunks, queue) = (ledger.clone(), chunks.clone(), queue.to_string());
        tasks.spawn(async move {
            loop {
                let Some(chunk) = chunks.lock().expect("chunks").pop() else {
                    return anyhow::Ok(());
                };
                let mut tx = l.pool().begin().await?;
                l.enqueue_many_in(&mut tx, chunk.iter().map(|i| job(&queue, *i)).collect())
                    .await?;
                tx.commit().await?;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

pub(crate) fn noop_worker(
    ledger: &Ledger,
    queue: &str,
    concurrency: usize,
    prefetch: Option<usize>,
) -> Result<Worker> {
    let b = Worker::builder(ledger.clone())
        .name("bench")
        .queue(queue)
        .concurrency(concurrency);
    // None: the worker's default, which follows the handlers' pace.
    let b = match prefetch {
        Some(n) => b.prefetch(n),
        None => b,
    };
    Ok(b.poll_every(Duration::from_millis(100))
        .sweeper(None)
        .scheduler(None)
        .handler("noop", |_ctx| async { HandlerOutcome::Success(None) })
        .build()?)
}

/// Runs `worker` until it has completed `n` jobs; returns how long it took.
pub(crate) async fn drain(worker: Worker, n: usize) -> Result<Duration> {
    let stop = CancellationToken::new();
    let started = Instant::now();
    let run = tokio::spawn({
        let (w, s) = (worker.clone(), stop.clone());
        async move { w.run(s).await }
    });
    while (worker.counters().report().succeeded as usize) < n {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    stop.cancel();
    run.await??;
    Ok(elapsed)
}

/// W3: drain pre-enqueued no-op jobs with 16-way concurrency in one process.
async fn w3(ledger: &Ledger, queue: &str, n: usize, prefetch: Option<usize>) -> Result<()> {
    enqueue_batched(ledger, queue, n).await?;
    let elapsed = drain(noop_worker(ledger, queue, 16, prefetch)?, n).await?;
    expect_drained(ledger, queue, n).await?;
    let events: i64 = ledger.count_events_total().await?;
    let label = if queue == "w3" {
        "W3 drain no-op jobs, 16-way"
    } else {
        "W3 again on top of the history"
    };
    report(
        label,
        n,
        elapsed,
        json!({ "events_in_log": events, "prefetch": prefetch.map_or(json!("auto"), |n| json!(n)) }),
    );
    Ok(())
}

/// Enqueue-to-start latency of an idle worker (woken by LISTEN/NOTIFY).
async fn latency(ledger: &Ledger, samples: usize) -> Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Instant>();
    let tx = Arc::new(tx);
    let worker = Worker::builder(ledger.clone())
        .name("latency")
        .queue("latency")
        .concurrency(4)
        .poll_every(Duration::from_secs(5))
        .sweeper(None)
        .handler("noop", move |_ctx| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(Instant::now());
                HandlerOutcome::Success(None)
            }
        })
        .build()?;
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let s = stop.clone();
        async move { worker.run(s).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await; // let it LISTEN and go idle
    let mut ms = Vec::with_capacity(samples);
    for i in 0..samples {
        let t = Instant::now();
        ledger.enqueue(job("latency", i)).await?;
        let started = rx.recv().await.context("handler never started")?;
        ms.push((started - t).as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_millis(5)).await; // idle again
    }
    stop.cancel();
    run.await??;
    ms.sort_by(f64::total_cmp);
    let pct = |p: f64| ms[((ms.len() as f64 - 1.0) * p).round() as usize];
    println!(
        "{}",
        json!({ "workload": "enqueue-to-start latency, idle worker", "samples": samples,
                "p50_ms": (pct(0.5) * 100.0).round() / 100.0, "p99_ms": (pct(0.99) * 100.0).round() / 100.0,
                "max_ms": (pct(1.0) * 100.0).round() / 100.0 })
    );
    Ok(())
}

/// Builds a history of about `events` events by running real jobs
/// (3 events each: enqueued, claimed, succeeded).
pub(crate) async fn history(ledger: &Ledger, events: usize) -> Result<()> {
    let have = ledger.count_events_total().await? as usize;
    let jobs = events.saturating_sub(have) / 3;
    let started = Instant::now();
    enqueue_batched(ledger, "history", jobs).await?;
    // The worker's own prefetch (it follows the pace): the history's speed
    // is not a figure, only its size is.
    drain(noop_worker(ledger, "history", 16, None)?, jobs).await?;
    // What autovacuum does on a live database; this machine runs with it off.
    ledger.vacuum_log().await?;
    eprintln!(
        "bench: history of {} events built in {:.0}s",
        ledger.count_events_total().await?,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Rebuild rate of the shipped projections from a log of about `events`
/// events (built by running real jobs when the log is shorter): for each,
/// a new projection's first catch-up, then a rebuild beside it (what
/// `projections rebuild` and a new version do) until it switches in.
pub async fn rebuild_rate(ledger: &Ledger, events: usize) -> Result<()> {
    use jobledger_projections::runner::Runner;
    use jobledger_projections::Projection;
    if (ledger.count_events_total().await? as usize) < events {
        history(ledger, events).await?;
    }
    let total = ledger.count_events_total().await?;
    let reader = jobledger::reader::LogReader::open(ledger.pool().clone(), "bench-projections").await?;
    let runner = Runner::new(ledger.pool().clone(), &reader, 10_000).await?;
    let shipped: [&dyn Projection; 3] = [
        &jobledger::rebuilt::JobsRebuilt,
        &jobledger_projections::shipped::QueueStats,
        &jobledger_projections::shipped::JobTimeline,
    ];
    let print = |workload: String, events: usize, secs: f64| {
        println!(
            "{}",
            json!({ "workload": workload, "events": events, "log_events": total,
                    "seconds": (secs * 1000.0).round() / 1000.0,
                    "events_per_s": (events as f64 / secs).round() })
        )
    };
    for p in shipped {
        // A new projection catches its serving table up from position 0.
        let started = Instant::now();
        let s = runner.catch_up(&[p]).await?;
        print(
            format!("catch up new {} from position 0", p.name()),
            s.applied,
            started.elapsed().as_secs_f64(),
        );
        // A rebuild (`projections rebuild`, or a new version after a schema
        // change) builds a fresh table beside the serving one, then switches.
        let started = Instant::now();
        runner.start_rebuild(p).await?;
        let s = runner.catch_up(&[p]).await?;
        anyhow::ensure!(
            s.switched_to.is_some(),
            "the rebuild of {} did not switch in",
            p.name()
        );
        print(
            format!("rebuild {} beside the serving table", p.name()),
            s.rebuilt,
            started.elapsed().as_secs_f64(),
        );
    }
    Ok(())
}

/// Catch-up lag of the shipped projections while W3 runs: a runner follows
/// the log; the lag (events not yet applied, age of the oldest) is sampled
/// every 100 ms.
pub async fn catch_up_lag(ledger: &Ledger, n: usize) -> Result<()> {
    use jobledger_projections::runner::Runner;
    use jobledger_projections::Projection;
    let reader = jobledger::reader::LogReader::open(ledger.pool().clone(), "bench-lag").await?;
    {
        let runner = Runner::new(ledger.pool().clone(), &reader, 5000).await?;
        runner
            .catch_up(&[&jobledger_projections::shipped::QueueStats])
            .await?;
        runner
            .catch_up(&[&jobledger_projections::shipped::JobTimeline])
            .await?;
    }
    enqueue_batched(ledger, "lag", n).await?;
    // W3 runs in its own task; this task follows the log with the runner
    // and samples the lag (the runner's futures stay on this task).
    let worker = noop_worker(ledger, "lag", 16, None)?;
    let w3 = tokio::spawn(async move { drain(worker, n).await });
    let runner = Runner::new(ledger.pool().clone(), &reader, 5000).await?;
    let shipped: [&dyn Projection; 2] = [
        &jobledger_projections::shipped::QueueStats,
        &jobledger_projections::shipped::JobTimeline,
    ];
    let mut samples = vec![];
    let mut last_sample = Instant::now();
    while !w3.is_finished() {
        let mut moved = 0;
        for p in shipped {
            moved += runner.step(&[p]).await?.applied;
        }
        if last_sample.elapsed() >= Duration::from_millis(100) {
            last_sample = Instant::now();
            if let Some(q) = jobledger_projections::registry::entries(ledger.pool())
                .await?
                .iter()
                .find(|e| e.name == "queue_stats")
            {
                let lag = reader
                    .lag(jobledger::reader::Checkpoint {
                        txid: q.txid,
                        position: q.position,
                    })
                    .await?;
                samples.push((lag.events, lag.seconds));
            }
        }
        if moved == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let elapsed = w3.await??;
    samples.sort_by(|a, b| a.1.total_cmp(&b.1));
    let p = |q: f64| {
        samples
            .get(((samples.len().max(1) - 1) as f64 * q) as usize)
            .copied()
            .unwrap_or((0, 0.0))
    };
    println!(
        "{}",
        json!({ "workload": "projection catch-up lag under W3 (queue_stats + job_timeline following)",
                "jobs": n, "jobs_per_s": (n as f64 / elapsed.as_secs_f64()).round(), "samples": samples.len(),
                "lag_seconds_p50": (p(0.5).1 * 1000.0).round() / 1000.0, "lag_seconds_max": (p(1.0).1 * 1000.0).round() / 1000.0,
                "lag_events_max": samples.iter().map(|s| s.0).max().unwrap_or(0) })
    );
    Ok(())
}
