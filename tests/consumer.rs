//! The fenced consumer against the real broker (tansu, via scripts/kafka-up):
//! docs/scenarios.md scenario 13 (older generations after newer ones), poison
//! messages, and resuming inside a record batch.

mod common;

use common::fresh;
use common::kafka::{
    body, brokers, consume_until, consumer_db, fenced, gen_headers, produce, relay_cfg, topic,
    topic_and_producer, Recorder,
};
use jobledger::relay::Relay;
use jobledger_consumers::{ConsumerConfig, FencedConsumer};
use rdkafka::config::ClientConfig;
use rdkafka::producer::FutureProducer;
use serde_json::json;
use uuid::Uuid;

/// Scenario 13 and poison messages: an older (epoch, token) after a newer
/// one is rejected and counted (a reused job_key's old lifecycle included);
/// undecodable messages land in the dead-letter table and never stop it.
#[tokio::test]
async fn consumer_fencing_and_dead_letters() {
    let (topic, p, _admin_db) = topic_and_producer().await;
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
    consume_until(&consumer, &rec, "all nine handled", |s| {
        ["applied", "duplicates", "stale", "dead_lettered"]
            .iter()
            .map(|k| s[k].as_u64().unwrap())
            .sum::<u64>()
            >= 9
    })
    .await;
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
    consume_until(&consumer, &rec, "offsets 5..9 applied", |s| {
        s["applied"].as_u64() == Some(5)
    })
    .await;
    let versions: Vec<i64> = rec.0.lock().await.iter().map(|(_, _, v)| *v).collect();
    assert_eq!(
        versions,
        vec![6, 7, 8, 9, 10],
        "the rest of the batch, once each, in order"
    );
    assert_eq!(c.snapshot()["redelivered"], json!(0));
}

/// A handler with a rule about the data: it refuses version 3 (a CHECK
/// constraint in its own table) and its database is unreachable once, for
/// version 2 (a transient failure).
struct Picky {
    failed_once: std::sync::atomic::AtomicBool,
}

impl jobledger_consumers::EventHandler for Picky {
    fn handle<'a>(
        &'a self,
        conn: &'a mut sqlx::PgConnection,
        e: &'a jobledger_consumers::JobEvent,
    ) -> jobledger_consumers::consumer::HandlerFuture<'a> {
        Box::pin(async move {
            if e.version == 2 && !self.failed_once.swap(true, std::sync::atomic::Ordering::SeqCst) {
                return Err(jobledger_consumers::HandlerError::Db(sqlx::Error::PoolTimedOut));
            }
            sqlx::query("INSERT INTO picky (job_id, version) VALUES ($1, $2)")
                .bind(e.job_id)
                .bind(e.version)
                .execute(&mut *conn)
                .await?;
            Ok(jobledger_consumers::Handled::Applied)
        })
    }
}

/// Issue 9 item 3: a message whose body passes the header checks but has no
/// usable job_id, and a message the handler's own rules refuse, are
/// dead-lettered (with their raw bytes and the reason); a transient failure
/// is retried; everything after them is applied and the consumer goes on.
#[tokio::test]
async fn poison_messages_are_dead_lettered_and_the_rest_is_applied() {
    let (topic, p, _admin_db) = topic_and_producer().await;
    let job = Uuid::now_v7().to_string();
    let without_id = {
        let mut b: serde_json::Value = serde_json::from_slice(&body(&job, 5, 1, 2, "leased")).unwrap();
        b.as_object_mut().unwrap().remove("job_id");
        serde_json::to_vec(&b).unwrap()
    };
    type Raw<'a> = (Vec<(&'a str, &'a str)>, Vec<u8>);
    let msgs: Vec<Raw> = vec![
        (gen_headers("5", "0", "1"), body(&job, 5, 0, 1, "queued")),
        (gen_headers("5", "1", "2"), without_id),
        (gen_headers("5", "1", "2"), body("not-a-uuid", 5, 1, 2, "leased")),
        (gen_headers("5", "1", "2"), body(&job, 5, 1, 2, "leased")),
        (gen_headers("5", "1", "3"), body(&job, 5, 1, 3, "leased")),
        (gen_headers("5", "1", "4"), body(&job, 5, 1, 4, "succeeded")),
    ];
    for (h, b) in &msgs {
        produce(&p, &topic, "refund-1", h, b).await;
    }
    let pool = consumer_db().await;
    sqlx::query("CREATE TABLE picky (job_id uuid NOT NULL, version bigint NOT NULL CHECK (version <> 3))")
        .execute(&pool)
        .await
        .unwrap();
    let consumer = fenced(&topic, pool.clone()).await;
    let handler = Picky {
        failed_once: Default::default(),
    };
    consume_until(&consumer, &handler, "all six handled", |s| {
        s["applied"].as_u64().unwrap() + s["dead_lettered"].as_u64().unwrap() >= 6
    })
    .await;
    assert_eq!(
        consumer.counters().snapshot(),
        json!({"applied": 3, "duplicates": 0, "stale": 0, "dead_lettered": 3, "redelivered": 0})
    );
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM picky ORDER BY version")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        applied,
        vec![1, 2, 4],
        "the transient failure was retried, the rest applied"
    );
    let dead: Vec<(i64, String, Option<Vec<u8>>)> = sqlx::query_as(
        "SELECT \"offset\", error, payload FROM jobledger_consumer.dead_letters ORDER BY \"offset\"",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(dead.len(), 3, "{dead:?}");
    assert!(
        dead[0].1.contains("job_id") && dead[1].1.contains("job_id"),
        "{dead:?}"
    );
    assert!(
        dead[2].1.starts_with("handler:") && dead[2].1.contains("check"),
        "{dead:?}"
    );
    assert_eq!(dead[2].2.as_deref(), Some(&msgs[4].1[..]), "raw bytes kept");
    // The refused version 3 never raised the fence: version 4 applied after it.
    let fence: (i64,) = sqlx::query_as("SELECT version FROM jobledger_consumer.fences")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(fence.0, 4);
}

/// Writes an effect row, then fails transiently the first time it is
/// called (the database went away mid-transaction).
struct FlakyEffect(std::sync::atomic::AtomicUsize);
impl jobledger_consumers::EventHandler for FlakyEffect {
    fn handle<'a>(
        &'a self,
        c: &'a mut sqlx::PgConnection,
        e: &'a jobledger_consumers::JobEvent,
    ) -> jobledger_consumers::consumer::HandlerFuture<'a> {
        Box::pin(async move {
            sqlx::query("INSERT INTO effects (job_id, version) VALUES ($1, $2)")
                .bind(e.job_id)
                .bind(e.version)
                .execute(&mut *c)
                .await?;
            if self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                let lost = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset");
                return Err(sqlx::Error::Io(lost).into());
            }
            Ok(jobledger_consumers::Handled::Applied)
        })
    }
}

/// Issue 10 item 4: a handler's transient error rolls its transaction back
/// (the effect, the fence and the offset together) and the same message is
/// retried: each effect once, nothing dead-lettered, nothing skipped.
#[tokio::test]
async fn a_transient_handler_error_rolls_back_and_retries() {
    let (topic, p, _admin_db) = topic_and_producer().await;
    let job = Uuid::now_v7().to_string();
    produce(
        &p,
        &topic,
        "q/flaky",
        &gen_headers("3", "1", "1"),
        &body(&job, 3, 1, 1, "leased"),
    )
    .await;
    produce(
        &p,
        &topic,
        "q/flaky",
        &gen_headers("3", "1", "2"),
        &body(&job, 3, 1, 2, "succeeded"),
    )
    .await;
    let pool = consumer_db().await;
    sqlx::query("CREATE TABLE effects (job_id uuid, version bigint)")
        .execute(&pool)
        .await
        .unwrap();
    let consumer = fenced(&topic, pool.clone()).await;
    let handler = FlakyEffect(Default::default());
    consume_until(&consumer, &handler, "both applied", |s| {
        s["applied"].as_u64().unwrap() >= 2
    })
    .await;
    let s = consumer.counters().snapshot();
    assert_eq!(
        (
            s["applied"].as_u64(),
            s["dead_lettered"].as_u64(),
            s["duplicates"].as_u64()
        ),
        (Some(2), Some(0), Some(0)),
        "{s}"
    );
    assert_eq!(
        handler.0.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "the first message ran twice"
    );
    let effects: Vec<(i64, i64)> =
        sqlx::query_as("SELECT version, count(*) FROM effects GROUP BY version ORDER BY version")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        effects,
        vec![(1, 1), (2, 1)],
        "the failed attempt's effect was rolled back"
    );
}
