//! Kafka test support shared by the relay and consumer tests.

use jobledger::relay::RelayConfig;
use jobledger_consumers::{ConsumerConfig, EventHandler, FencedConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;
use std::time::Duration;
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
