//! Kafka test support shared by the relay and consumer tests.

use super::TestDb;
use jobledger::relay::{Relay, RelayConfig};
use jobledger_consumers::{ConsumerConfig, EventHandler, FencedConsumer};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub fn brokers() -> String {
    std::env::var("JOBLEDGER_TEST_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

pub fn topic() -> String {
    format!("t-{}", Uuid::new_v4().simple())
}

pub fn relay_cfg(topic: &str) -> RelayConfig {
    let mut c = RelayConfig::new(&brokers(), topic);
    c.partitions = 3;
    c.batch = 50;
    c.poll = Duration::from_millis(50);
    c
}

/// A consumer database of its own.
pub async fn consumer_db() -> sqlx::PgPool {
    let url = format!("{}/jlt_{}", super::server_url(), Uuid::new_v4().simple());
    jobledger::store::schema::create_database_if_missing(&jobledger::ledger::connect_options(&url).unwrap())
        .await
        .unwrap();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap()
}

pub async fn fenced(topic: &str, pool: sqlx::PgPool) -> FencedConsumer {
    let cfg = ConsumerConfig {
        brokers: brokers(),
        group: format!("g-{}", Uuid::new_v4().simple()),
        topic: topic.into(),
    };
    FencedConsumer::new(cfg, pool).await.unwrap()
}

pub async fn produce(p: &FutureProducer, topic: &str, key: &str, headers: &[(&str, &str)], body: &[u8]) {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    p.send(
        FutureRecord::to(topic).key(key).payload(body).headers(h),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
}

pub fn gen_headers<'a>(e: &'a str, t: &'a str, v: &'a str) -> Vec<(&'static str, &'a str)> {
    vec![
        ("schema", "1"),
        ("epoch", e),
        ("token", t),
        ("version", v),
        ("position", "1"),
        ("type", "x"),
    ]
}

/// A schema-1 body as the relay writes it (the fields the decoder checks).
pub fn body(job: &str, e: i64, t: i64, v: i64, state: &str) -> Vec<u8> {
    serde_json::to_vec(
        &json!({"job_id": job, "epoch": e, "token": t, "version": v, "position": 1,
                               "type": "x", "to_state": state, "reason": "r", "queue": "q",
                               "job_key": "refund-1", "hash": format!("h{v}"),
                               "recorded_at": "2026-12-01T00:00:00.000000Z"}),
    )
    .unwrap()
}

/// Counts what the handler applied, in order.
pub struct Recorder(pub tokio::sync::Mutex<Vec<(i64, i64, i64)>>);

impl EventHandler for Recorder {
    fn handle<'a>(
        &'a self,
        _c: &'a mut sqlx::PgConnection,
        e: &'a jobledger_consumers::JobEvent,
    ) -> jobledger_consumers::consumer::HandlerFuture<'a> {
        Box::pin(async move {
            self.0.lock().await.push((e.epoch, e.token, e.version));
            Ok(jobledger_consumers::Handled::Applied)
        })
    }
}

/// Runs `consumer` with `handler` until its counters satisfy `done`, then
/// stops it and waits for it to return.
pub async fn consume_until<H: EventHandler>(
    consumer: &FencedConsumer,
    handler: &H,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) {
    let counters = consumer.counters();
    let stop = tokio_util::sync::CancellationToken::new();
    let run = async { consumer.run(handler, stop.clone()).await.unwrap() };
    let check = async {
        super::eventually(what, || {
            let ok = done(&counters.snapshot());
            async move { ok }
        })
        .await;
        stop.cancel();
    };
    tokio::join!(run, check);
}

/// A new topic (created through a relay session of a fresh ledger database,
/// which the caller keeps alive) and a plain producer for hand-made messages.
pub async fn topic_and_producer() -> (String, FutureProducer, super::TestDb) {
    let topic = topic();
    let admin_db = super::fresh().await;
    jobledger::relay::Relay::new(admin_db.ledger.clone(), relay_cfg(&topic))
        .ensure_topic()
        .await
        .unwrap();
    let p: FutureProducer = rdkafka::config::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    (topic, p, admin_db)
}

/// A relay running until the token is cancelled, and its counters.
pub fn spawn_relay(
    db: &TestDb,
    cfg: RelayConfig,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<()>,
    Arc<jobledger::relay::RelayCounters>,
) {
    let relay = Relay::new(db.ledger.clone(), cfg);
    let counters = relay.counters();
    let stop = CancellationToken::new();
    let s = stop.clone();
    (
        stop,
        tokio::spawn(async move { relay.run(s).await.unwrap() }),
        counters,
    )
}

/// The messages of the topic: (key, version, job_id) in arrival order per
/// partition, read with a plain consumer until every event of the ledger
/// arrived at least once (duplicates are not counted toward it).
pub async fn read_ledger_from_topic(db: &TestDb, topic: &str) -> Vec<(String, i64, String)> {
    let want: std::collections::HashSet<(String, i64)> =
        sqlx::query_as::<_, (Uuid, i64)>("SELECT job_id, version FROM jobledger.events")
            .fetch_all(db.ledger.pool())
            .await
            .unwrap()
            .into_iter()
            .map(|(j, v)| (j.to_string(), v))
            .collect();
    let mut seen = std::collections::HashSet::new();
    let mut out = vec![];
    for m in read_topic_while(topic, |msgs| {
        seen.extend(msgs.iter().map(|(_, v, j)| (j.clone(), *v)));
        !want.is_subset(&seen)
    })
    .await
    {
        out.push(m);
    }
    out
}

/// Every message of the topic, read with a plain consumer while `more`
/// (given the messages read so far) says so; 60 s at most per message.
pub async fn read_topic_while(
    topic: &str,
    mut more: impl FnMut(&[(String, i64, String)]) -> bool,
) -> Vec<(String, i64, String)> {
    let c: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", format!("raw-{}", Uuid::new_v4().simple()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    c.subscribe(&[topic]).unwrap();
    let mut out = vec![];
    while more(&out) {
        // A consumer that subscribed before the relay made the topic gets
        // errors until it exists: those wait, within the same deadline.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let m = loop {
            match tokio::time::timeout_at(deadline, c.recv())
                .await
                .expect("messages arrive")
            {
                Ok(m) => break m,
                Err(e) => tracing::debug!("consumer: {e}; waiting"),
            }
        };
        let version = m
            .headers()
            .unwrap()
            .iter()
            .find(|h| h.key == "version")
            .unwrap()
            .value
            .unwrap();
        let body: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
        out.push((
            String::from_utf8(m.key().unwrap().to_vec()).unwrap(),
            std::str::from_utf8(version).unwrap().parse().unwrap(),
            body["job_id"].as_str().unwrap().to_string(),
        ));
    }
    out
}

/// Per job: first occurrences of versions are 1, 2, 3, ... (duplicates allowed).
pub fn assert_in_order(msgs: &[(String, i64, String)]) -> HashMap<String, i64> {
    let mut seen: HashMap<String, i64> = HashMap::new();
    for (_, v, job) in msgs {
        let last = seen.entry(job.clone()).or_insert(0);
        if *v <= *last {
            continue;
        }
        assert_eq!(*v, *last + 1, "job {job} jumped from v{last} to v{v}");
        *last = *v;
    }
    seen
}

/// Each stream's last version on the topic is its version in the ledger
/// (every job's, and the log's own stream of checkpoints).
pub async fn assert_last_versions_match(db: &TestDb, last: &HashMap<String, i64>) {
    let ledger: HashMap<String, i64> = sqlx::query_as::<_, (Uuid, i64)>(
        "SELECT job_id, version FROM jobledger.jobs UNION ALL \
         SELECT job_id, max(version) FROM jobledger.events WHERE job_id = '00000000-0000-0000-0000-000000000000' \
         GROUP BY job_id",
    )
            .fetch_all(db.ledger.pool())
            .await
            .unwrap()
            .into_iter()
            .map(|(j, v)| (j.to_string(), v))
            .collect();
    assert_eq!(
        last, &ledger,
        "each job's last version on the topic is the ledger's"
    );
}

pub async fn event_count(db: &TestDb) -> usize {
    db.count("SELECT count(*) FROM jobledger.events").await as usize
}
