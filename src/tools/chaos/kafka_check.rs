//! Reads the run's whole topic back and checks that every event reached
//! Kafka at least once, unchanged, and in per-key version order.

use anyhow::{Context, Result};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};
use uuid::Uuid;

use super::check::Report;
use jobledger::ledger::Ledger;

pub async fn every_event_in_order(ledger: &Ledger, brokers: &str, topic: &str, r: &mut Report) -> Result<()> {
    let expected: HashMap<(Uuid, i64), String> = ledger
        .all_event_hashes()
        .await?
        .into_iter()
        .map(|(j, v, h)| ((j, v), h))
        .collect();
    let (brokers, topic) = (brokers.to_string(), topic.to_string());
    // rdkafka's BaseConsumer blocks; keep it off the async workers.
    let read = tokio::task::spawn_blocking(move || read_topic(&brokers, &topic)).await??;

    if let Ok(path) = std::env::var("JOBLEDGER_CHAOS_DUMP") {
        let lines: Vec<String> = read
            .iter()
            .map(|e| {
                format!(
                    "{}\t{}\t{}\t{}\t{}",
                    e.partition, e.offset, e.job_id, e.version, e.key
                )
            })
            .collect();
        let _ = std::fs::write(path, lines.join("\n"));
    }
    let mut problems = vec![];
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut seen: HashSet<(Uuid, i64)> = HashSet::new();
    let mut duplicates = 0u64;
    for ev in &read {
        let job_id = ev.job_id;
        let hash = ev.body["hash"].as_str().unwrap_or_default();
        if expected.get(&(job_id, ev.version)).map(String::as_str) != Some(hash) {
            problems.push(format!(
                "{job_id} v{}: not in the ledger with this hash",
                ev.version
            ));
        }
        let prev = last.entry(ev.key.clone()).or_insert(0);
        if ev.version <= *prev {
            duplicates += 1;
        } else if ev.version != *prev + 1 {
            problems.push(format!("key {}: v{} arrived after v{}", ev.key, ev.version, prev));
            *prev = ev.version;
        } else {
            *prev = ev.version;
        }
        seen.insert((job_id, ev.version));
    }
    let missing: Vec<_> = expected.keys().filter(|k| !seen.contains(k)).collect();
    if !missing.is_empty() {
        problems.push(format!(
            "{} events never reached Kafka, e.g. {:?}",
            missing.len(),
            missing[0]
        ));
    }
    r.kafka.insert("messages".into(), read.len() as u64);
    r.kafka.insert("duplicates".into(), duplicates);
    r.kafka.insert("keys".into(), last.len() as u64);
    r.check(
        "every event reached Kafka, unchanged, in per-key order",
        &problems,
    );
    Ok(())
}

fn consumer(brokers: &str) -> Result<BaseConsumer> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("chaos-check-{}", Uuid::new_v4().simple()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .context("checker consumer")
}

fn partitions_of(consumer: &BaseConsumer, topic: &str) -> Result<Vec<i32>> {
    let meta = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    Ok(meta
        .topics()
        .iter()
        .filter(|t| t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect())
}

/// The topic's partitions (none while it does not exist).
pub fn partitions(brokers: &str, topic: &str) -> Result<Vec<i32>> {
    partitions_of(&consumer(brokers)?, topic)
}

/// Every message of every partition, each partition in offset order and
/// without gaps. A read that skipped offsets (tansu sometimes answers a
/// fetch with a later batch) is repeated; a gap that stays is reported.
fn read_topic(brokers: &str, topic: &str) -> Result<Vec<jobledger_consumers::JobEvent>> {
    let consumer = consumer(brokers)?;
    let mut out = vec![];
    for p in partitions_of(&consumer, topic)? {
        let mut attempt = 0;
        loop {
            match read_partition(&consumer, topic, p)? {
                Ok(events) => {
                    out.extend(events);
                    break;
                }
                Err((expected, got)) if attempt < 3 => {
                    attempt += 1;
                    tracing::warn!(
                        p,
                        expected,
                        got,
                        "checker: the broker skipped offsets; reading again"
                    );
                }
                Err((expected, got)) => {
                    anyhow::bail!("partition {p}: offsets {expected}..{got} are missing on every read")
                }
            }
        }
    }
    Ok(out)
}

const QUIET: Duration = Duration::from_secs(5);

type PartitionRead = std::result::Result<Vec<jobledger_consumers::JobEvent>, (i64, i64)>;

fn read_partition(consumer: &BaseConsumer, topic: &str, p: i32) -> Result<PartitionRead> {
    let (_, mut end) = consumer.fetch_watermarks(topic, p, Duration::from_secs(30))?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, p, Offset::Beginning)?;
    consumer.assign(&tpl)?;
    let mut out = vec![];
    let mut next = 0i64;
    let deadline = Instant::now() + Duration::from_secs(900);
    let mut heard = Instant::now();
    // The high watermark alone is no end: tansu has reported one below
    // messages it had acknowledged and served. Read on until the partition
    // stays quiet and the watermark has nothing beyond.
    loop {
        anyhow::ensure!(Instant::now() < deadline, "reading partition {p} back timed out");
        if next >= end && heard.elapsed() > QUIET {
            let (_, now) = consumer.fetch_watermarks(topic, p, Duration::from_secs(30))?;
            if now <= next {
                break;
            }
            end = now;
            heard = Instant::now();
        }
        match consumer.poll(Duration::from_millis(500)) {
            Some(Ok(m)) if m.offset() != next => return Ok(Err((next, m.offset()))),
            Some(Ok(m)) => {
                heard = Instant::now();
                next = m.offset() + 1;
                match jobledger_consumers::decode::decode(&m) {
                    Ok(ev) => out.push(ev),
                    Err(e) => anyhow::bail!("undecodable message at {p}:{}: {e}", m.offset()),
                }
            }
            Some(Err(e)) => tracing::warn!("checker consumer: {e}"),
            None => {}
        }
    }
    Ok(Ok(out))
}
