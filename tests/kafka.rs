//! The relay and the fenced consumers against the real broker (tansu, via
//! scripts/kafka-up): DESIGN.md scenarios 12 and 13, out-of-order commits,
//! a relay killed between produce and checkpoint, a zombie relay, older
//! generations after newer ones, poison messages.

mod common;

use common::{eventually, fresh, new_job, TestDb};
use jobledger::reader::LogReader;
use jobledger::relay::{Relay, RelayConfig, RelayHooks};
use jobledger::worker::BoxFuture;
use jobledger_consumers::shipped::{AuditLog, StatusMirror};
use jobledger_consumers::{ConsumerConfig, EventHandler, FencedConsumer};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn brokers() -> String {
    std::env::var("JOBLEDGER_TEST_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

fn topic() -> String {
    format!("t-{}", Uuid::new_v4().simple())
}

fn relay_cfg(topic: &str) -> RelayConfig {
    let mut c = RelayConfig::new(&brokers(), topic);
    c.partitions = 3;
    c.batch = 50;
    c.poll = Duration::from_millis(50);
    c
}

fn spawn_relay(
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

/// A consumer database of its own.
async fn consumer_db() -> sqlx::PgPool {
    let url = format!("{}/jlt_{}", common::server_url(), Uuid::new_v4().simple());
    jobledger::store::schema::create_database_if_missing(&jobledger::ledger::connect_options(&url).unwrap())
        .await
        .unwrap();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap()
}

async fn fenced(topic: &str, pool: sqlx::PgPool) -> FencedConsumer {
    let cfg = ConsumerConfig {
        brokers: brokers(),
        group: format!("g-{}", Uuid::new_v4().simple()),
        topic: topic.into(),
    };
    FencedConsumer::new(cfg, pool).await.unwrap()
}

/// Every message of the topic: (key, version, job_id) in arrival order per
/// partition, read with a plain consumer until `expect` arrived.
async fn read_topic(topic: &str, expect: usize) -> Vec<(String, i64, String)> {
    let c: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", format!("raw-{}", Uuid::new_v4().simple()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    c.subscribe(&[topic]).unwrap();
    let mut out = vec![];
    while out.len() < expect {
        let m = tokio::time::timeout(Duration::from_secs(60), c.recv())
            .await
            .expect("messages arrive")
            .unwrap();
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
fn assert_in_order(msgs: &[(String, i64, String)]) -> HashMap<String, i64> {
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

async fn event_count(db: &TestDb) -> usize {
    db.count("SELECT count(*) FROM jobledger.events").await as usize
}

/// Scenario 12: writers commit out of position order while the relay runs;
/// every event reaches Kafka, in per-job order, keyed by job_key or job_id.
#[tokio::test]
async fn relay_publishes_everything_in_per_job_order() {
    let db = fresh().await;
    let topic = topic();
    let (stop, relay, counters) = spawn_relay(&db, relay_cfg(&topic));

    let mut slow = db.ledger.pool().begin().await.unwrap();
    db.ledger
        .enqueue_in(&mut slow, new_job("q", Some("slow-key"), json!({})))
        .await
        .unwrap();
    for i in 0..20 {
        let key = (i % 2 == 0).then(|| format!("k{i}"));
        db.enqueue(key.as_deref(), json!({"i": i})).await;
    }
    let leases = db
        .ledger
        .claim("q", "w", Duration::from_secs(30), 20)
        .await
        .unwrap();
    for l in &leases {
        l.complete(None).await.unwrap();
    }
    // Everything committed after `slow` waits behind it; nothing is skipped.
    slow.commit().await.unwrap();
    let total = event_count(&db).await;
    eventually("the relay published everything", || async {
        counters.published.load(std::sync::atomic::Ordering::Relaxed) as usize >= total
    })
    .await;
    let msgs = read_topic(&topic, total).await;
    let last = assert_in_order(&msgs);
    assert_eq!(last.len(), 21);
    assert!(msgs.iter().any(|(k, _, _)| k == "slow-key"), "keyed by job_key");
    assert!(
        msgs.iter().any(|(k, _, job)| k == job),
        "keyed by job_id when there is no key"
    );
    stop.cancel();
    relay.await.unwrap();
}

/// A relay killed after the broker acknowledged but before the checkpoint
/// moved: the next relay resends; the consumer counts duplicates and applies
/// nothing twice.
#[tokio::test]
async fn relay_killed_between_produce_and_checkpoint_resends_and_consumers_drop_duplicates() {
    let db = fresh().await;
    let topic = topic();
    for i in 0..10 {
        db.enqueue(Some(&format!("k{i}")), json!({"i": i})).await;
    }
    let (acked_tx, mut acked_rx) = mpsc::channel::<usize>(1);
    let mut cfg = relay_cfg(&topic);
    cfg.hooks = RelayHooks {
        after_produce: Some(Arc::new(move |n| {
            let tx = acked_tx.clone();
            Box::pin(async move {
                let _ = tx.send(n).await;
                std::future::pending::<()>().await; // the process dies here
            }) as BoxFuture<()>
        })),
    };
    let (_stop, relay, _) = spawn_relay(&db, cfg);
    let sent = acked_rx.recv().await.unwrap();
    assert_eq!(sent, 10);
    relay.abort(); // killed: its lease stays until it expires
    let _ = relay.await;
    let reader = LogReader::open(db.ledger.pool().clone(), &format!("relay:{topic}"))
        .await
        .unwrap();
    assert_eq!(
        reader.checkpoint().await.unwrap(),
        Default::default(),
        "the checkpoint never moved"
    );
    sqlx::query("UPDATE jobledger.readers SET lease_until = now() - interval '1 second'")
        .execute(db.ledger.pool())
        .await
        .unwrap();

    let (stop, relay, counters) = spawn_relay(&db, relay_cfg(&topic));
    eventually("the second relay resent", || async {
        counters.published.load(std::sync::atomic::Ordering::Relaxed) >= 10
    })
    .await;

    let pool = consumer_db().await;
    let consumer = fenced(&topic, pool.clone()).await;
    let c = consumer.counters();
    let cstop = CancellationToken::new();
    let cs = cstop.clone();
    let run = tokio::spawn(async move { consumer.run(&AuditLog, cs).await.unwrap() });
    eventually("the consumer saw both copies", || async {
        let s = c.snapshot();
        s["applied"].as_u64().unwrap() + s["duplicates"].as_u64().unwrap() >= 20
    })
    .await;
    let s = c.snapshot();
    assert_eq!(
        (s["applied"].as_u64(), s["duplicates"].as_u64()),
        (Some(10), Some(10)),
        "{s}"
    );
    let copied: i64 = sqlx::query_scalar("SELECT count(*) FROM jobledger_consumer.audit_log")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(copied, 10, "no double effects");
    cstop.cancel();
    run.await.unwrap();
    stop.cancel();
    relay.await.unwrap();
}

/// A zombie relay (its lease taken over) cannot move the checkpoint.
#[tokio::test]
async fn a_zombie_relay_cannot_move_the_checkpoint() {
    let db = fresh().await;
    db.enqueue(None, json!({})).await;
    let reader = LogReader::open(db.ledger.pool().clone(), "relay:z")
        .await
        .unwrap();
    let a = reader
        .acquire("relay-a", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    assert!(
        reader
            .acquire("relay-b", Duration::from_secs(30))
            .await
            .unwrap()
            .is_none(),
        "a's lease is live"
    );
    sqlx::query("UPDATE jobledger.readers SET lease_until = now() - interval '1 second'")
        .execute(db.ledger.pool())
        .await
        .unwrap();
    let b = reader
        .acquire("relay-b", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    assert!(b.token() > a.token());
    let batch = reader.read(Default::default(), 10).await.unwrap();
    assert!(
        !a.advance(batch.next).await.unwrap(),
        "the zombie's checkpoint write is rejected"
    );
    assert!(!a.renew().await.unwrap());
    assert!(b.advance(batch.next).await.unwrap());
    assert_eq!(reader.checkpoint().await.unwrap(), batch.next);
}

async fn produce(p: &FutureProducer, topic: &str, key: &str, headers: &[(&str, &str)], body: &[u8]) {
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

fn gen_headers<'a>(e: &'a str, t: &'a str, v: &'a str) -> Vec<(&'static str, &'a str)> {
    vec![
        ("schema", "1"),
        ("epoch", e),
        ("token", t),
        ("version", v),
        ("position", "1"),
        ("type", "x"),
    ]
}

fn body(job: &str, e: i64, t: i64, v: i64, state: &str) -> Vec<u8> {
    serde_json::to_vec(
        &json!({"job_id": job, "epoch": e, "token": t, "version": v, "to_state": state,
                               "reason": "r", "queue": "q", "job_key": "refund-1"}),
    )
    .unwrap()
}

/// Counts what the handler applied, in order.
struct Recorder(tokio::sync::Mutex<Vec<(i64, i64, i64)>>);
impl EventHandler for Recorder {
    fn handle<'a>(
        &'a self,
        _c: &'a mut sqlx::PgConnection,
        e: &'a jobledger_consumers::JobEvent,
    ) -> jobledger_consumers::consumer::HandlerFuture<'a> {
        Box::pin(async move {
            self.0.lock().await.push((e.epoch, e.token, e.version));
            Ok(())
        })
    }
}

/// Scenario 13 and poison messages: an older (epoch, token) after a newer
/// one is rejected and counted (a reused job_key's old lifecycle included);
/// undecodable messages land in the dead-letter table and never stop it.
#[tokio::test]
async fn consumer_fencing_and_dead_letters() {
    let topic = topic();
    let admin_db = fresh().await; // creates the topic through a relay session
    Relay::new(admin_db.ledger.clone(), relay_cfg(&topic))
        .ensure_topic()
        .await
        .unwrap();
    let p: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let (old, new) = (Uuid::now_v7().to_string(), Uuid::now_v7().to_string());
    type Raw<'a> = (Vec<(&'a str, &'a str)>, Vec<u8>);
    let msgs: Vec<Raw> = vec![
        (gen_headers("5", "2", "3"), body(&old, 5, 2, 3, "leased")),
        (gen_headers("5", "1", "2"), body(&old, 5, 1, 2, "leased")), // older token: stale
        (gen_headers("5", "2", "3"), body(&old, 5, 2, 3, "leased")), // same: duplicate
        (vec![("schema", "1")], b"{}".to_vec()),                     // missing headers
        (gen_headers("5", "2", "4"), b"not json".to_vec()),          // not JSON
        (
            vec![
                ("schema", "9"),
                ("epoch", "5"),
                ("token", "2"),
                ("version", "5"),
                ("position", "1"),
                ("type", "x"),
            ],
            b"{}".to_vec(),
        ),
        (gen_headers("9", "0", "1"), body(&new, 9, 0, 1, "queued")), // key reused: new epoch applies
        (gen_headers("5", "3", "6"), body(&old, 5, 3, 6, "succeeded")), // old lifecycle after new: stale
        (gen_headers("9", "1", "2"), body(&new, 9, 1, 2, "leased")),
    ];
    for (h, b) in &msgs {
        produce(&p, &topic, "refund-1", h, b).await;
    }
    let pool = consumer_db().await;
    let consumer = fenced(&topic, pool.clone()).await;
    let rec = Recorder(Default::default());
    let c = consumer.counters();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let run = async {
        consumer.run(&rec, s).await.unwrap();
    };
    let check = async {
        eventually("all nine handled", || async {
            let s = c.snapshot();
            ["applied", "duplicates", "stale", "dead_lettered"]
                .iter()
                .map(|k| s[k].as_u64().unwrap())
                .sum::<u64>()
                >= 9
        })
        .await;
        stop.cancel();
    };
    tokio::join!(run, check);
    let s = c.snapshot();
    assert_eq!(
        s,
        json!({"applied": 3, "duplicates": 1, "stale": 2, "dead_lettered": 3, "redelivered": 0})
    );
    assert_eq!(*rec.0.lock().await, vec![(5, 2, 3), (9, 0, 1), (9, 1, 2)]);
    let dead: Vec<(String, Option<Vec<u8>>)> =
        sqlx::query_as("SELECT error, payload FROM jobledger_consumer.dead_letters ORDER BY \"offset\"")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(dead.len(), 3);
    assert!(dead[0].0.contains("missing header"));
    assert!(
        dead[1].0.contains("not a JSON") && dead[1].1.as_deref() == Some(&b"not json"[..]),
        "raw bytes kept"
    );
    assert!(dead[2].0.contains("unknown schema version 9"));
}

/// The status mirror follows the ledger: after a relay run, it equals
/// `jobledger.jobs` (state and version of every job).
#[tokio::test]
async fn status_mirror_equals_the_ledger() {
    let db = fresh().await;
    let topic = topic();
    for i in 0..12 {
        db.enqueue(Some(&format!("m{i}")), json!({"i": i})).await;
    }
    for (i, l) in db
        .ledger
        .claim("q", "w", Duration::from_secs(30), 8)
        .await
        .unwrap()
        .into_iter()
        .enumerate()
    {
        if i % 2 == 0 {
            l.complete(None).await.unwrap();
        } else {
            l.fail(jobledger::domain::ErrorClass::Permanent, "nope", None)
                .await
                .unwrap();
        }
    }
    let (stop, relay, counters) = spawn_relay(&db, relay_cfg(&topic));
    let total = event_count(&db).await as u64;
    eventually("published", || async {
        counters.published.load(std::sync::atomic::Ordering::Relaxed) >= total
    })
    .await;
    let pool = consumer_db().await;
    let consumer = fenced(&topic, pool.clone()).await;
    let c = consumer.counters();
    let cstop = CancellationToken::new();
    let cs = cstop.clone();
    let run = tokio::spawn(async move { consumer.run(&StatusMirror, cs).await.unwrap() });
    eventually("mirrored", || async {
        c.snapshot()["applied"].as_u64().unwrap() >= total
    })
    .await;
    cstop.cancel();
    run.await.unwrap();
    let mirror = jobledger_consumers::shipped::mirror_rows(&pool).await.unwrap();
    let ledger: Vec<(Uuid, String, i64)> =
        sqlx::query_as("SELECT job_id, state, version FROM jobledger.jobs ORDER BY job_id")
            .fetch_all(db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(mirror, ledger);
    stop.cancel();
    relay.await.unwrap();
}

/// `jobledger verify --audit-log`: the audit copy recomputes, links and
/// equals the ledger's chain; an edited copy is found.
#[tokio::test]
async fn verify_checks_the_audit_log_against_the_chain() {
    let db = fresh().await;
    let topic = topic();
    for i in 0..4 {
        db.enqueue(Some(&format!("a{i}")), json!({ "i": i })).await;
    }
    let l = db.claim_one("w").await;
    l.complete(Some(json!({"ok": true}))).await.unwrap();
    let (stop, relay, counters) = spawn_relay(&db, relay_cfg(&topic));
    let total = event_count(&db).await as u64;
    eventually("published", || async {
        counters.published.load(std::sync::atomic::Ordering::Relaxed) >= total
    })
    .await;
    let url = format!("{}/jlt_{}", common::server_url(), Uuid::new_v4().simple());
    jobledger::store::schema::create_database_if_missing(&jobledger::ledger::connect_options(&url).unwrap())
        .await
        .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let consumer = fenced(&topic, pool.clone()).await;
    let c = consumer.counters();
    let cstop = CancellationToken::new();
    let cs = cstop.clone();
    let run = tokio::spawn(async move { consumer.run(&AuditLog, cs).await.unwrap() });
    eventually("copied", || async {
        c.snapshot()["applied"].as_u64().unwrap() >= total
    })
    .await;
    cstop.cancel();
    run.await.unwrap();
    stop.cancel();
    relay.await.unwrap();

    let verify = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_jobledger"))
            .args(["verify", "--audit-log", &url])
            .env("DATABASE_URL", &db.url)
            .output()
            .unwrap()
    };
    let ok = verify();
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    let mut conn: sqlx::PgConnection = sqlx::Connection::connect(&url).await.unwrap();
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("UPDATE jobledger_consumer.audit_log SET body = jsonb_set(body, '{actor}', '\"mallory\"') WHERE version = 2")
        .execute(&mut conn)
        .await
        .unwrap();
    let bad = verify();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stdout).contains("hash mismatch"));
}

/// A consumer that stopped in the middle of a record batch resumes with the
/// rest of that batch (tansu answers a fetch from inside a batch with the
/// next batch; the consumer reads from earlier and skips in memory), and a
/// message whose offset is already recorded is never applied twice.
#[tokio::test]
async fn a_consumer_resumes_inside_a_record_batch() {
    let topic = topic();
    let admin_db = fresh().await;
    let mut cfg = relay_cfg(&topic);
    cfg.partitions = 1;
    Relay::new(admin_db.ledger.clone(), cfg)
        .ensure_topic()
        .await
        .unwrap();
    // Ten sends in flight at once with a linger: one record batch.
    let p: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("linger.ms", "200")
        .create()
        .unwrap();
    let job = Uuid::now_v7().to_string();
    let sends: Vec<_> = (1..=10i64)
        .map(|v| {
            let (p, topic, job) = (p.clone(), topic.clone(), job.clone());
            tokio::spawn(async move {
                let (e, t, ver) = ("5".to_string(), "1".to_string(), v.to_string());
                produce(
                    &p,
                    &topic,
                    "refund-1",
                    &gen_headers(&e, &t, &ver),
                    &body(&job, 5, 1, v, "leased"),
                )
                .await;
            })
        })
        .collect();
    for s in sends {
        s.await.unwrap();
    }

    let pool = consumer_db().await;
    jobledger_consumers::schema::install(&pool).await.unwrap();
    let group = format!("g-{}", Uuid::new_v4().simple());
    sqlx::query(
        "INSERT INTO jobledger_consumer.offsets (grp, topic, partition, next_offset) VALUES ($1, $2, 0, 5)",
    )
    .bind(&group)
    .bind(&topic)
    .execute(&pool)
    .await
    .unwrap();
    let ccfg = ConsumerConfig {
        brokers: brokers(),
        group,
        topic: topic.clone(),
    };
    let consumer = FencedConsumer::new(ccfg, pool.clone()).await.unwrap();
    let rec = Recorder(Default::default());
    let c = consumer.counters();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let run = async {
        consumer.run(&rec, s).await.unwrap();
    };
    let check = async {
        eventually("offsets 5..9 applied", || async {
            c.snapshot()["applied"].as_u64() == Some(5)
        })
        .await;
        stop.cancel();
    };
    tokio::join!(run, check);
    let versions: Vec<i64> = rec.0.lock().await.iter().map(|(_, _, v)| *v).collect();
    assert_eq!(
        versions,
        vec![6, 7, 8, 9, 10],
        "the rest of the batch, once each, in order"
    );
    assert_eq!(c.snapshot()["redelivered"], json!(0));
}
