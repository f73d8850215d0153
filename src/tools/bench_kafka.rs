//! `bench`'s broker workloads: the relay's throughput beside a plain
//! producer's, and commit-to-consumer latency at a steady rate (split from
//! bench.rs, which keeps the database-only workloads).

use anyhow::Result;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use crate::tools::bench::{enqueue_batched, job};
use jobledger::ledger::Ledger;

/// Relay throughput from a pre-filled log, next to a plain producer's rate
/// into the same broker in the same run.
pub async fn relay_throughput(ledger: &Ledger, brokers: &str, events: usize) -> Result<()> {
    use jobledger::relay::{Relay, RelayConfig};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let have = ledger.count_events_total().await? as usize;
    enqueue_batched(ledger, "relay", events.saturating_sub(have)).await?;
    let total = ledger.count_events_total().await? as u64;
    let topic = format!("bench-relay-{}", std::process::id());
    let mut cfg = RelayConfig::new(brokers, &topic);
    cfg.batch = 10_000;
    let relay = Relay::new(ledger.clone(), cfg);
    relay.ensure_topic().await?;
    let counters = relay.counters();
    let stop = CancellationToken::new();
    let started = Instant::now();
    let run = tokio::spawn({
        let s = stop.clone();
        async move { relay.run(s).await }
    });
    // The first batch also pays for the producer's start (its connection,
    // the topic's metadata, an idempotent producer id): up to a second on
    // tansu. Past it, the steady rate is what a running relay sustains.
    let mut first: Option<(u64, Instant)> = None;
    loop {
        let done = counters.published.load(std::sync::atomic::Ordering::Relaxed);
        if first.is_none() && done > 0 {
            first = Some((done, Instant::now()));
        }
        if done >= total {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let relay_s = started.elapsed().as_secs_f64();
    let steady = first.map(|(n, at)| (total - n) as f64 / at.elapsed().as_secs_f64());
    stop.cancel();
    run.await??;

    let plain: FutureProducer = rdkafka::config::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("queue.buffering.max.messages", "1000000")
        .set("linger.ms", "2")
        .create()?;
    let payload = vec![b'x'; 100];
    let started = Instant::now();
    let mut pending = Vec::with_capacity(total as usize);
    for i in 0..total {
        let key = i.to_string();
        pending.push(
            plain
                .send_result(FutureRecord::to(&topic).key(&key).payload(&payload))
                .map_err(|(e, _)| e)?,
        );
    }
    for f in pending {
        f.await?.map_err(|(e, _)| e)?;
    }
    let plain_s = started.elapsed().as_secs_f64();
    let relay_rate = total as f64 / relay_s;
    let plain_rate = total as f64 / plain_s;
    println!(
        "{}",
        json!({ "workload": "relay: pre-filled log to the broker", "events": total,
                "seconds": (relay_s * 1000.0).round() / 1000.0, "events_per_s": relay_rate.round(),
                "after_first_batch_events_per_s": steady.map(f64::round),
                "plain_producer_events_per_s": plain_rate.round(),
                "share_of_plain_producer": (relay_rate / plain_rate * 1000.0).round() / 1000.0 })
    );
    Ok(())
}

/// Commit-to-consumer-applied latency at a steady `rate` of events/s.
pub async fn end_to_end(
    ledger: &Ledger,
    brokers: &str,
    consumer_url: &str,
    rate: u64,
    seconds: u64,
) -> Result<()> {
    use jobledger::relay::{Relay, RelayConfig};
    use jobledger_consumers::consumer::HandlerFuture;
    use jobledger_consumers::{ConsumerConfig, EventHandler, FencedConsumer, JobEvent};
    use std::collections::HashMap;
    use std::sync::Mutex;

    struct Stamp(Arc<Mutex<HashMap<String, Instant>>>);
    impl EventHandler for Stamp {
        fn handle<'a>(&'a self, _c: &'a mut sqlx::PgConnection, e: &'a JobEvent) -> HandlerFuture<'a> {
            self.0
                .lock()
                .expect("stamps")
                .insert(e.key.clone(), Instant::now());
            Box::pin(async { Ok(jobledger_consumers::Handled::Applied) })
        }
    }
    let topic = format!("bench-e2e-{}", std::process::id());
    let mut cfg = RelayConfig::new(brokers, &topic);
    cfg.poll = Duration::from_millis(500);
    let relay = Relay::new(ledger.clone(), cfg);
    relay.ensure_topic().await?;
    // Start from the end of the log: only this workload's events count.
    jobledger::reader::LogReader::open(ledger.pool().clone(), &format!("relay:{topic}"))
        .await?
        .skip_to_end()
        .await?;
    jobledger::store::schema::create_database_if_missing(&jobledger::ledger::connect_options(consumer_url)?)
        .await?;
    let cpool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(consumer_url)
        .await?;
    let cfgc = ConsumerConfig {
        brokers: brokers.into(),
        group: format!("bench-{}", std::process::id()),
        topic: topic.clone(),
    };
    let consumer = FencedConsumer::new(cfgc, cpool.clone())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let applied = Arc::new(Mutex::new(HashMap::new()));
    let stamp = Stamp(applied.clone());
    let stop = CancellationToken::new();
    let relay_run = tokio::spawn({
        let s = stop.clone();
        async move { relay.run(s).await }
    });
    let consumer_run = tokio::spawn({
        let s = stop.clone();
        async move { consumer.run(&stamp, s).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await; // consumer joins its group
    let n = rate * seconds;
    let mut committed: HashMap<String, Instant> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    for i in 0..n {
        tick.tick().await;
        let e = ledger.enqueue(job("e2e", i as usize)).await?;
        committed.insert(e.job.job_id.to_string(), Instant::now());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while applied.lock().expect("stamps").len() < n as usize && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    relay_run.await??;
    consumer_run.await??;
    let applied = applied.lock().expect("stamps").clone();
    let mut ms: Vec<f64> = committed
        .iter()
        .filter_map(|(k, t)| {
            applied
                .get(k)
                .map(|a| a.saturating_duration_since(*t).as_secs_f64() * 1000.0)
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        ms.get(((ms.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    println!(
        "{}",
        json!({ "workload": "commit to consumer applied", "rate_per_s": rate, "events": n, "received": ms.len(),
                "p50_ms": (pct(0.5) * 100.0).round() / 100.0, "p99_ms": (pct(0.99) * 100.0).round() / 100.0,
                "max_ms": (pct(1.0) * 100.0).round() / 100.0 })
    );
    cpool.close().await;
    Ok(())
}
