//! `jobledger demo`: the main job end to end on a real database, with real
//! `Worker`s. Enqueues refund jobs against an in-process fake provider, runs
//! several workers, freezes one worker (handlers and heartbeats) past its
//! leases so others take over and reconcile, resumes it (its writes are
//! rejected as stale and counted), cancels some jobs before start and
//! mid-flight, fails some transiently and permanently, and checks the
//! invariants.

use anyhow::{bail, Context, Result};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::tools::fake_provider::{FakeProvider, ProviderError};
use crate::tools::mock_broker::{self, MockBroker};
use crate::tools::private_pg::PrivateCluster;
use jobledger::domain::{JobState, NewJob, NextAction, Policy};
use jobledger::ledger::{Found, Ledger};
use jobledger::worker::{HandlerOutcome, Hooks, JobContext, Worker, WorkerReport};

const LEASE: Duration = Duration::from_millis(1500);
const ZOMBIES: usize = 3;

type CancelRequest = (Uuid, oneshot::Sender<()>);

struct Demo {
    ledger: Ledger,
    provider: Arc<FakeProvider>,
    queue: String,
}

/// Every scripted case (failures, refusals, slow jobs, cancels, the
/// double-click enqueue of job 10) shows up at least once from here on.
const MIN_JOBS: usize = 30;

pub async fn run(url: &str, jobs: usize, workers: usize, brokers: &str) -> Result<i32> {
    if jobs < MIN_JOBS || workers == 0 {
        bail!("the demo needs --jobs {MIN_JOBS} or more and --workers 1 or more (got {jobs} and {workers})");
    }
    let started = Instant::now();
    // Keep the private cluster (if any) alive until the end of the demo.
    let server_answers =
        jobledger::store::schema::create_database_if_missing(&jobledger::ledger::connect_options(url)?).await;
    let (_cluster, url) = match server_answers {
        Ok(_) => (None, url.to_string()),
        Err(e) => {
            eprintln!("demo: nothing answers at {url} ({e}); starting a private PostgreSQL under target/");
            let c = PrivateCluster::start().context("no database and no private cluster")?;
            let u = c.url.clone();
            (Some(c), u)
        }
    };
    let ledger = Ledger::connect_and_migrate(&url, (workers as u32 * 4 + 8).max(16))
        .await
        .with_context(|| format!("cannot reach PostgreSQL at {url}"))?;
    let queue = format!("demo-refunds-{}", Uuid::now_v7().simple());
    eprintln!("demo: queue {queue}, {jobs} refund jobs, {workers} workers + 1 that will freeze");
    let demo = Arc::new(Demo {
        ledger: ledger.clone(),
        provider: Arc::new(FakeProvider::new()),
        queue,
    });
    // With the mock cluster to fall back on, the Kafka side always runs:
    // when it cannot start, the demo says why and does not pass.
    let kafka = start_kafka(&demo, &url, brokers, jobs)
        .await
        .inspect_err(|why| eprintln!("demo: no relay and no consumer: {why}"))
        .ok();
    let keys = enqueue_all(&demo, jobs).await?;

    let (cancel_tx, cancel_rx) = mpsc::channel::<CancelRequest>(16);
    let canceller = tokio::spawn(canceller(ledger.clone(), cancel_rx));
    let stop = CancellationToken::new();

    // The zombie: claims the first jobs, calls the provider, then freezes
    // (handlers and heartbeats) until the demo thaws it.
    let (thaw_tx, thaw_rx) = watch::channel(false);
    let (stalled_tx, mut stalled_rx) = mpsc::channel::<Uuid>(ZOMBIES);
    let zombie = zombie_worker(&demo, thaw_rx, stalled_tx, cancel_tx.clone())?;
    let zombie_run = tokio::spawn({
        let (z, s) = (zombie.clone(), stop.clone());
        async move { z.run(s).await }
    });
    let mut stalled = vec![];
    while stalled.len() < ZOMBIES {
        stalled.push(stalled_rx.recv().await.context("zombie never stalled")?);
    }
    eprintln!("demo: worker-zombie called the provider for {ZOMBIES} jobs and froze");

    let mut runs = vec![];
    for w in 0..workers {
        let worker = refund_worker(&demo, &format!("worker-{w}"), cancel_tx.clone())?;
        let s = stop.clone();
        runs.push(tokio::spawn(async move { worker.run(s).await }));
    }
    wait_until(&demo, Duration::from_secs(30), |d| {
        let stalled = stalled.clone();
        async move { all_terminal(&d.ledger, &stalled).await }
    })
    .await
    .context("the frozen worker's jobs were never taken over")?;
    eprintln!("demo: other workers took over and reconciled; thawing worker-zombie");
    let _ = thaw_tx.send(true);
    wait_until(&demo, Duration::from_secs(45), |d| async move {
        queue_settled(&d).await
    })
    .await?;
    stop.cancel();
    stop.cancel(); // stopping twice is harmless
    let zombie_report = zombie_run.await??;
    let mut reports = vec![];
    for r in runs {
        reports.push(r.await??);
    }
    canceller.abort();
    let kafka = match kafka {
        Some(k) => Some(finish_kafka(&demo, k).await?),
        None => None,
    };
    summary(&demo, &keys, &stalled, zombie_report, &reports, kafka, started).await
}

struct Kafka {
    /// Which broker: the one at `--brokers`, or the in-process mock cluster
    /// (kept alive here until the relay and the consumer stopped).
    broker: String,
    mock: Option<Arc<MockBroker>>,
    faults: Option<tokio::task::JoinHandle<Vec<String>>>,
    stop: CancellationToken,
    relay: tokio::task::JoinHandle<()>,
    published: Arc<jobledger::relay::RelayCounters>,
    consumer: tokio::task::JoinHandle<()>,
    counters: Arc<jobledger_consumers::ConsumerCounters>,
    mirror: sqlx::PgPool,
}

/// What the Kafka side showed: events published, the consumer's counts, and
/// whether the status mirror ended equal to the ledger.
struct KafkaReport {
    broker: String,
    faults: Vec<String>,
    relay_restarts: u64,
    published: u64,
    consumer: serde_json::Value,
    mirror_equal: bool,
}

impl KafkaReport {
    /// Every event of the run reached the consumer and was applied (the
    /// mirror keeps only each job's last version, so its equality alone
    /// would not show a lost intermediate event).
    fn reached(&self, events: u64) -> bool {
        self.consumer["applied"].as_u64().is_some_and(|a| a >= events)
    }
}

/// Starts the relay and a status-mirror consumer: against the broker at
/// `brokers` when one answers, else against librdkafka's in-process mock
/// cluster (so a first run needs no broker build), with a leader move and
/// a broker down during the relay's run.
async fn start_kafka(demo: &Arc<Demo>, url: &str, brokers: &str, jobs: usize) -> Result<Kafka, String> {
    use jobledger::relay::{Relay, RelayConfig};
    let topic = format!("jobledger.{}", demo.queue);
    let partitions = 4;
    let (mock, bootstrap, broker) = if mock_broker::answers(brokers, Duration::from_secs(3)).await {
        (None, brokers.to_string(), format!("Kafka at {brokers}"))
    } else {
        eprintln!("demo: no Kafka broker answers at {brokers}; using librdkafka's in-process mock cluster ({} brokers, replication {})", mock_broker::BROKERS, mock_broker::BROKERS);
        let mock = match MockBroker::start() {
            Ok(m) => Arc::new(m),
            Err(e) => return Err(format!("no broker at {brokers} and no mock cluster either: {e}")),
        };
        mock.create_topic(&topic, partitions)
            .await
            .map_err(|e| format!("the mock cluster refused the topic: {e}"))?;
        let b = mock.bootstrap.clone();
        let name = format!(
            "in-process mock cluster ({} brokers at {b})",
            mock_broker::BROKERS
        );
        (Some(mock), b, name)
    };
    let mut cfg = RelayConfig::new(&bootstrap, &topic);
    cfg.partitions = partitions;
    cfg.poll = Duration::from_millis(100);
    cfg.create_topic = mock.is_none();
    // This run's topic gets this run's events, not the database's history.
    let reader = jobledger::reader::LogReader::open(demo.ledger.pool().clone(), &cfg.reader)
        .await
        .map_err(|e| format!("the relay's log reader: {e}"))?;
    reader
        .skip_to_end()
        .await
        .map_err(|e| format!("the relay's log reader: {e}"))?;
    let relay = Relay::new(demo.ledger.clone(), cfg);
    if mock.is_none()
        && tokio::time::timeout(Duration::from_secs(5), relay.ensure_topic())
            .await
            .map(|r| r.is_ok())
            != Ok(true)
    {
        return Err(format!(
            "the broker at {brokers} would not make the topic {topic}"
        ));
    }
    let mirror_url = {
        let mut u = url::Url::parse(url).map_err(|e| format!("the database URL: {e}"))?;
        let db = u.path().trim_start_matches('/').to_string();
        u.set_path(&format!("/{db}_mirror"));
        u.to_string()
    };
    let mirror_opts =
        jobledger::ledger::connect_options(&mirror_url).map_err(|e| format!("the mirror's URL: {e}"))?;
    jobledger::store::schema::create_database_if_missing(&mirror_opts)
        .await
        .map_err(|e| format!("the mirror database {mirror_url}: {e}"))?;
    let mirror = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&mirror_url)
        .await
        .map_err(|e| format!("the mirror database {mirror_url}: {e}"))?;
    let ccfg = jobledger_consumers::ConsumerConfig {
        brokers: bootstrap.clone(),
        group: format!("demo-{}", demo.queue),
        topic: topic.clone(),
    };
    let consumer = jobledger_consumers::FencedConsumer::new(ccfg, mirror.clone())
        .await
        .map_err(|e| format!("the status-mirror consumer: {e}"))?;
    let stop = CancellationToken::new();
    let published = relay.counters();
    let counters = consumer.counters();
    let s = stop.clone();
    let relay = tokio::spawn(async move {
        if let Err(e) = relay.run(s).await {
            eprintln!("demo: relay stopped: {e}");
        }
    });
    let s = stop.clone();
    let consumer = tokio::spawn(async move {
        if let Err(e) = consumer.run(&jobledger_consumers::shipped::StatusMirror, s).await {
            eprintln!("demo: consumer stopped: {e}");
        }
    });
    let faults = mock.as_ref().map(|m| {
        let ends = (jobs as u64, 2 * jobs as u64);
        let f = mock_broker::faults(
            m.clone(),
            topic.clone(),
            partitions,
            published.clone(),
            ends,
            stop.clone(),
        );
        tokio::spawn(f)
    });
    eprintln!("demo: relaying to the {broker}, mirroring job states into {mirror_url}");
    Ok(Kafka {
        broker,
        mock,
        faults,
        stop,
        relay,
        published,
        consumer,
        counters,
        mirror,
    })
}

async fn finish_kafka(demo: &Arc<Demo>, k: Kafka) -> Result<KafkaReport> {
    let expected: Vec<(Uuid, String, i64)> = demo.ledger.states_in(&demo.queue).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut mirror_equal = false;
    while Instant::now() < deadline {
        let rows = jobledger_consumers::shipped::mirror_rows(&k.mirror).await?;
        let mirrored: std::collections::HashMap<Uuid, (String, i64)> =
            rows.into_iter().map(|(id, s, v)| (id, (s, v))).collect();
        if expected
            .iter()
            .all(|(id, s, v)| mirrored.get(id) == Some(&(s.clone(), *v)))
        {
            mirror_equal = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    k.stop.cancel();
    let faults = match k.faults {
        Some(f) => f.await.unwrap_or_default(),
        None => vec![],
    };
    let _ = k.relay.await;
    let _ = k.consumer.await;
    drop(k.mock);
    Ok(KafkaReport {
        broker: k.broker,
        faults,
        relay_restarts: k.published.failures.load(std::sync::atomic::Ordering::Relaxed),
        published: k.published.published.load(std::sync::atomic::Ordering::Relaxed),
        consumer: k.counters.snapshot(),
        mirror_equal,
    })
}

async fn enqueue_all(demo: &Demo, jobs: usize) -> Result<Vec<String>> {
    let policy = Policy {
        max_attempts: 3,
        backoff_base_ms: 50,
        backoff_cap_ms: 200,
        ..Policy::default()
    };
    let mut news = Vec::with_capacity(jobs);
    let mut keys = Vec::with_capacity(jobs);
    for i in 0..jobs {
        let key = format!("refund-{i:04}");
        match i {
            _ if i % 23 == 5 => demo.provider.fail_always(&key),
            _ if i % 17 == 4 => demo.provider.refuse(&key),
            _ if i % 7 == 3 => demo.provider.fail_once(&key),
            _ => {}
        }
        news.push(NewJob {
            queue: demo.queue.clone(),
            kind: "refund".into(),
            job_key: Some(key.clone()),
            payload: json!({ "order": format!("ord-{i}"), "amount_cents": 1000 + i, "slow": i % 29 == 9 }),
            priority: if i < ZOMBIES { -1 } else { 0 },
            run_at: None,
            delay_ms: None,
            policy: Some(policy.clone()),
            concurrency_key: None,
            unique_for_ms: None,
        });
        keys.push(key);
    }
    let mut tx = demo.ledger.pool().begin().await?;
    let enqueued = demo.ledger.enqueue_many_in(&mut tx, news.clone()).await?;
    tx.commit().await?;
    // A double click: the same request again is the same job.
    let again = demo.ledger.enqueue(news[10].clone()).await?;
    if again.created || again.job.job_id != enqueued[10].job.job_id {
        bail!("duplicate enqueue created a second job");
    }
    for (i, e) in enqueued.iter().enumerate() {
        if i % 13 == 7 {
            demo.ledger
                .cancel(e.job.job_id, Some("customer withdrew"))
                .await?;
        }
    }
    Ok(keys)
}

/// What a careful refund handler does: reconcile first when told to, stop
/// at step boundaries when cancelled, use the job key (never the token)
/// with the provider.
async fn refund(
    ctx: JobContext,
    provider: Arc<FakeProvider>,
    cancels: mpsc::Sender<CancelRequest>,
) -> HandlerOutcome {
    let key = ctx.job_key().unwrap_or_default().to_string();
    if ctx.next_action() == NextAction::Reconcile {
        if let Some(refund_id) = provider.lookup(&key) {
            return HandlerOutcome::success(json!({ "refund_id": refund_id, "reconciled": true }));
        }
    }
    if let Err(stop) = ctx.step("prepared").await {
        return stop.into();
    }
    if ctx.payload()["slow"] == json!(true) {
        let (ack_tx, ack_rx) = oneshot::channel();
        if cancels.send((ctx.job().job_id, ack_tx)).await.is_ok() {
            let _ = ack_rx.await;
        }
    }
    if let Err(stop) = ctx.step("calling_provider").await {
        return stop.into();
    }
    match provider.refund(&key) {
        Ok(id) => HandlerOutcome::success(json!({ "refund_id": id })),
        Err(ProviderError::Transient) => HandlerOutcome::transient("provider_busy"),
        Err(ProviderError::Permanent(code)) => HandlerOutcome::permanent(&code),
    }
}

fn builder(demo: &Demo, name: &str) -> jobledger::worker::WorkerBuilder {
    Worker::builder(demo.ledger.clone())
        .name(name)
        .queue(&demo.queue)
        .concurrency(4)
        .lease(LEASE)
        .heartbeat_every(Duration::from_millis(400))
        .poll_every(Duration::from_millis(50))
        .sweeper(Some(Duration::from_millis(200)))
}

fn refund_worker(demo: &Demo, name: &str, cancels: mpsc::Sender<CancelRequest>) -> Result<Worker> {
    let provider = demo.provider.clone();
    Ok(builder(demo, name)
        .handler("refund", move |ctx| {
            refund(ctx, provider.clone(), cancels.clone())
        })
        .build()?)
}

fn zombie_worker(
    demo: &Demo,
    thaw: watch::Receiver<bool>,
    stalled: mpsc::Sender<Uuid>,
    cancels: mpsc::Sender<CancelRequest>,
) -> Result<Worker> {
    let provider = demo.provider.clone();
    let thawed = thaw.clone();
    let frozen_heartbeats: Arc<dyn Fn() -> jobledger::worker::BoxFuture<()> + Send + Sync> =
        Arc::new(move || {
            let mut t = thawed.clone();
            Box::pin(async move {
                let _ = t.wait_for(|v| *v).await;
            })
        });
    let handler = move |ctx: JobContext| {
        let (provider, mut thaw, stalled, cancels) =
            (provider.clone(), thaw.clone(), stalled.clone(), cancels.clone());
        async move {
            if *thaw.borrow() {
                return refund(ctx, provider, cancels).await;
            }
            // Calls the provider; the response "gets lost" while the process
            // is frozen past its lease.
            let key = ctx.job_key().unwrap_or_default().to_string();
            let Ok(refund_id) = provider.refund(&key) else {
                return HandlerOutcome::transient("provider_busy");
            };
            let _ = stalled.send(ctx.job().job_id).await;
            let _ = thaw.wait_for(|v| *v).await;
            // Evidence is kept even though the lease is gone...
            let _ = ctx
                .observe(
                    "provider-response",
                    json!({ "refund_id": refund_id, "late": true }),
                )
                .await;
            // ...but the late write itself will be refused as stale.
            HandlerOutcome::success(json!({ "refund_id": refund_id }))
        }
    };
    let hooks = Hooks {
        before_heartbeat: Some(frozen_heartbeats),
        ..Hooks::default()
    };
    Ok(builder(demo, "worker-zombie")
        .concurrency(ZOMBIES)
        .prefetch(0)
        .handler("refund", handler)
        .hooks(hooks)
        .build()?)
}

async fn canceller(ledger: Ledger, mut rx: mpsc::Receiver<CancelRequest>) -> Result<()> {
    while let Some((job, ack)) = rx.recv().await {
        ledger.cancel(job, Some("operator stopped it mid-flight")).await?;
        let _ = ack.send(());
    }
    Ok(())
}

async fn all_terminal(ledger: &Ledger, ids: &[Uuid]) -> Result<bool> {
    for id in ids {
        match ledger.show(*id).await? {
            Found::Live(j) if !j.state.is_terminal() => return Ok(false),
            _ => {}
        }
    }
    Ok(true)
}

async fn queue_settled(demo: &Demo) -> Result<bool> {
    let counts = demo.ledger.counts_by_state_in(&demo.queue).await?;
    Ok(counts
        .iter()
        .all(|(s, _)| JobState::parse(s).is_some_and(|s| s.is_terminal())))
}

/// Polls a condition of the database (the demo is not a test: real time is fine).
async fn wait_until<F, Fut>(demo: &Arc<Demo>, limit: Duration, cond: F) -> Result<()>
where
    F: Fn(Arc<Demo>) -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + limit;
    while !cond(demo.clone()).await? {
        if Instant::now() > deadline {
            let counts = demo.ledger.counts_by_state_in(&demo.queue).await?;
            bail!("not settled after {limit:?}: {counts:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

async fn summary(
    demo: &Demo,
    keys: &[String],
    stalled: &[Uuid],
    zombie: WorkerReport,
    reports: &[WorkerReport],
    kafka: Option<KafkaReport>,
    started: Instant,
) -> Result<i32> {
    let l = &demo.ledger;
    let counts = l.counts_by_state_in(&demo.queue).await?;
    let takeovers = l.count_events_in(&demo.queue, "taken_over").await?;
    let duplicates = demo.provider.duplicate_refunds();
    let (calls, lookups) = demo.provider.traffic();
    let lost: u64 = zombie.lost_leases + reports.iter().map(|r| r.lost_leases).sum::<u64>();
    let multi = keys.iter().filter(|k| demo.provider.executions(k) > 1).count();
    let mut problems = vec![];
    let mut verified = 0u64;
    for id in l.jobs_with_event_in(&demo.queue, "enqueued").await? {
        let r = l.verify(Some(id)).await?;
        verified += r.events;
        problems.extend(r.problems);
    }
    eprintln!("\n== jobledger demo: summary ==");
    for (state, n) in &counts {
        eprintln!("  {state:<26} {n}");
    }
    eprintln!("  takeovers                  {takeovers}");
    eprintln!(
        "  stale writes rejected      {lost} (the thawed zombie: {})",
        zombie.lost_leases
    );
    eprintln!(
        "  provider refunds / lookups {calls} / {lookups} (reconcile share {:.1}%)",
        100.0 * lookups as f64 / (calls + lookups).max(1) as f64
    );
    eprintln!("  duplicate external refunds {duplicates}");
    eprintln!(
        "  events verified            {verified} (hash chains + replay), problems: {}",
        problems.len()
    );
    if kafka.is_none() {
        eprintln!("  kafka                      not run (the reason is above): the demo does not pass");
    }
    if let Some(k) = &kafka {
        eprintln!("  broker                     {}", k.broker);
        for f in &k.faults {
            eprintln!("  broker fault               {f}");
        }
        eprintln!(
            "  events published to Kafka  {} (relay sessions restarted: {})",
            k.published, k.relay_restarts
        );
        eprintln!(
            "  status-mirror consumer     {} (every event applied: {}, mirror equals the ledger: {})",
            k.consumer,
            k.reached(verified),
            k.mirror_equal
        );
    }
    if let Some(id) = stalled.first() {
        eprintln!("\n== history of taken-over job {id} ==");
        for line in jobledger::ledger::timeline::lines(l, *id).await? {
            eprintln!("{line}");
        }
    }
    let ok = duplicates == 0
        && multi == 0
        && takeovers >= stalled.len() as i64
        && zombie.lost_leases >= stalled.len() as u64
        && problems.is_empty()
        && kafka
            .as_ref()
            .is_some_and(|k| k.mirror_equal && k.reached(verified))
        && counts
            .iter()
            .all(|(s, _)| JobState::parse(s).is_some_and(|s| s.is_terminal()));
    let by_state: serde_json::Map<_, _> = counts.iter().map(|(s, n)| (s.clone(), json!(n))).collect();
    println!(
        "{}",
        json!({
            "ok": ok, "queue": demo.queue, "jobs": keys.len(), "by_state": by_state,
            "takeovers": takeovers, "stale_rejected": lost, "duplicate_refunds": duplicates,
            "provider_calls": calls, "provider_lookups": lookups, "verified_events": verified,
            "problems": problems.len(), "seconds": started.elapsed().as_secs_f64(),
            "kafka": kafka.as_ref().map(|k| json!({ "broker": k.broker, "faults": k.faults, "relay_restarts": k.relay_restarts, "published": k.published, "consumer": k.consumer, "mirror_equal": k.mirror_equal })),
        })
    );
    eprintln!(
        "\ninvariants {} in {:.1}s",
        if ok { "held" } else { "VIOLATED" },
        started.elapsed().as_secs_f64()
    );
    Ok(if ok { 0 } else { 1 })
}
