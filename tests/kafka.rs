//! The relay and the shipped consumers against the real broker (tansu, via
//! scripts/kafka-up): docs/scenarios.md scenario 12, out-of-order commits, a relay
//! killed between produce and checkpoint, a zombie relay, the status mirror
//! and the audit log. The consumer's own fencing is in tests/consumer.rs.

mod common;

use common::kafka::{brokers, consume_until, consumer_db, fenced, relay_cfg, topic};
use common::{eventually, fresh, new_job, within, TestDb};
use jobledger::reader::LogReader;
use jobledger::relay::{Relay, RelayConfig, RelayHooks};
use jobledger::worker::BoxFuture;
use jobledger_consumers::shipped::{AuditLog, StatusMirror};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

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

/// The messages of the topic: (key, version, job_id) in arrival order per
/// partition, read with a plain consumer until every event of the ledger
/// arrived at least once (duplicates are not counted toward it).
async fn read_ledger_from_topic(db: &TestDb, topic: &str) -> Vec<(String, i64, String)> {
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
async fn read_topic_while(
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

/// Each stream's last version on the topic is its version in the ledger
/// (every job's, and the log's own stream of checkpoints).
async fn assert_last_versions_match(db: &TestDb, last: &HashMap<String, i64>) {
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
    let msgs = read_ledger_from_topic(&db, &topic).await;
    let last = assert_in_order(&msgs);
    assert_eq!(last.len(), 21);
    assert_last_versions_match(&db, &last).await;
    assert!(counters.published.load(std::sync::atomic::Ordering::Relaxed) as usize >= msgs.len() - 1);
    assert!(
        msgs.iter().any(|(k, _, _)| k == "q/slow-key"),
        "keyed by queue and job_key"
    );
    assert!(
        msgs.iter().any(|(k, _, job)| k == job),
        "keyed by job_id when there is no key"
    );
    stop.cancel();
    within("the relay stops", relay).await.unwrap();
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
    // The first batch is usually all 10; a transaction of another test's
    // database that the horizon could not attribute may cut it short for
    // one read, so the test counts what it holds instead of assuming it.
    let sent = common::within("the relay's first batch is acknowledged", acked_rx.recv())
        .await
        .unwrap() as u64;
    assert!((1..=10).contains(&sent), "{sent}");
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
        s["applied"].as_u64().unwrap() + s["duplicates"].as_u64().unwrap() >= 10 + sent
    })
    .await;
    let s = c.snapshot();
    assert_eq!(
        (s["applied"].as_u64(), s["duplicates"].as_u64()),
        (Some(10), Some(sent)),
        "{s}"
    );
    let copied: i64 = sqlx::query_scalar("SELECT count(*) FROM jobledger_consumer.audit_log")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(copied, 10, "no double effects");
    cstop.cancel();
    within("the consumer stops", run).await.unwrap();
    stop.cancel();
    within("the relay stops", relay).await.unwrap();
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
    // Every event on the topic (a count of publications would count
    // duplicates too), the last version of each job the ledger's.
    let msgs = read_ledger_from_topic(&db, &topic).await;
    assert_last_versions_match(&db, &assert_in_order(&msgs)).await;
    assert!(counters.published.load(std::sync::atomic::Ordering::Relaxed) >= total);
    let pool = consumer_db().await;
    let consumer = fenced(&topic, pool.clone()).await;
    consume_until(&consumer, &StatusMirror, "mirrored", |s| {
        s["applied"].as_u64().unwrap() >= total
    })
    .await;
    let mirror = jobledger_consumers::shipped::mirror_rows(&pool).await.unwrap();
    let ledger: Vec<(Uuid, String, i64)> =
        sqlx::query_as("SELECT job_id, state, version FROM jobledger.jobs ORDER BY job_id")
            .fetch_all(db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(mirror, ledger);
    stop.cancel();
    within("the relay stops", relay).await.unwrap();
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
    // A signed checkpoint: the log's own event is copied like any other
    // (the copy holds the operator to it; it once was dropped).
    jobledger::audit::checkpointer::Checkpointer::new(
        db.ledger.clone(),
        ed25519_dalek::SigningKey::from_bytes(&[5u8; 32]),
        Default::default(),
    )
    .checkpoint_now()
    .await
    .unwrap();
    let (stop, relay, counters) = spawn_relay(&db, relay_cfg(&topic));
    let total = event_count(&db).await as u64;
    // Every event on the topic (a count of publications would count
    // duplicates too), the last version of each job the ledger's.
    let msgs = read_ledger_from_topic(&db, &topic).await;
    assert_last_versions_match(&db, &assert_in_order(&msgs)).await;
    assert!(counters.published.load(std::sync::atomic::Ordering::Relaxed) >= total);
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
    consume_until(&consumer, &AuditLog, "copied", |s| {
        s["applied"].as_u64().unwrap() >= total
    })
    .await;
    stop.cancel();
    within("the relay stops", relay).await.unwrap();

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

/// Issue 9 item 7: keys are unique per queue only, so two live jobs of two
/// queues may share a `job_key`. Their messages carry different keys
/// (`<queue>/<job_key>`), so they never share a consumer's fence: both jobs'
/// events are applied, none is rejected as stale, and the mirror equals the
/// ledger.
#[tokio::test]
async fn two_queues_sharing_a_job_key_do_not_share_a_fence() {
    let db = fresh().await;
    let topic = topic();
    let first = db
        .ledger
        .enqueue(new_job("a/b", Some("order-7"), json!({})))
        .await
        .unwrap()
        .job;
    let second = db
        .ledger
        .enqueue(new_job("a", Some("b/order-7"), json!({})))
        .await
        .unwrap()
        .job;
    let third = db
        .ledger
        .enqueue(new_job("c", Some("order-7"), json!({})))
        .await
        .unwrap()
        .job;
    // The later-enqueued jobs have the higher epochs; finishing the first
    // one last gives its events the lower epoch after the others' (the case
    // a shared fence would reject).
    for q in ["c", "a", "a/b"] {
        let l = db
            .ledger
            .claim(q, "w", Duration::from_secs(30), 1)
            .await
            .unwrap()
            .pop()
            .unwrap();
        l.complete(None).await.unwrap();
    }
    assert!(first.epoch < second.epoch && second.epoch < third.epoch);
    let (stop, relay, counters) = spawn_relay(&db, relay_cfg(&topic));
    let total = event_count(&db).await as u64;
    let msgs = read_ledger_from_topic(&db, &topic).await;
    assert_last_versions_match(&db, &assert_in_order(&msgs)).await;
    assert!(counters.published.load(std::sync::atomic::Ordering::Relaxed) >= total);
    let keys: std::collections::BTreeSet<&str> = msgs.iter().map(|(k, _, _)| k.as_str()).collect();
    assert_eq!(
        keys.into_iter().collect::<Vec<_>>(),
        vec!["a%2Fb/order-7", "a/b/order-7", "c/order-7"],
        "queue-qualified keys, the queue's '/' escaped"
    );
    let pool = consumer_db().await;
    let consumer = fenced(&topic, pool.clone()).await;
    consume_until(&consumer, &StatusMirror, "mirrored", |s| {
        s["applied"].as_u64().unwrap() + s["stale"].as_u64().unwrap() >= total
    })
    .await;
    assert_eq!(consumer.counters().snapshot()["stale"], json!(0));
    let mirror = jobledger_consumers::shipped::mirror_rows(&pool).await.unwrap();
    assert_eq!(mirror.len(), 3);
    assert!(
        mirror.iter().all(|(_, state, v)| state == "succeeded" && *v == 3),
        "{mirror:?}"
    );
    stop.cancel();
    within("the relay stops", relay).await.unwrap();
}

/// Issue 9 item 4: the audit copy is not behind the staleness fence. A
/// job's events delivered v1, v3, v2 and v3 again are all recorded once and
/// verify clean; a copy missing a version its job has later ones of is
/// reported as a gap.
#[tokio::test]
async fn the_audit_copy_records_every_version_in_any_order() {
    use jobledger::relay::message::message;
    let db = fresh().await;
    let topic = topic();
    let job = db.enqueue(Some("audit"), json!({})).await;
    let l = db.claim_one("w").await;
    l.complete(Some(json!({"ok": true}))).await.unwrap();
    let gappy = db.enqueue(Some("gappy"), json!({})).await;
    db.ledger.cancel(gappy.job_id, None).await.unwrap();
    Relay::new(db.ledger.clone(), relay_cfg(&topic))
        .ensure_topic()
        .await
        .unwrap();
    let reader = LogReader::open(db.ledger.pool().clone(), "all").await.unwrap();
    let batch = reader.read(Default::default(), 100).await.unwrap();
    let ev = |id: Uuid, v: i64| {
        batch
            .events
            .iter()
            .find(|e| e.job_id() == id && e.version() == v)
            .unwrap()
    };
    let p: rdkafka::producer::FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let order = [
        (job.job_id, 1),
        (job.job_id, 3),
        (job.job_id, 2),
        (job.job_id, 3),
        (gappy.job_id, 2),
    ];
    for (id, v) in order {
        let e = ev(id, v);
        let m = message(
            e,
            "q",
            Some(if id == job.job_id { "audit" } else { "gappy" }),
            None,
        );
        let headers: Vec<(&str, &str)> = m.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        common::kafka::produce(&p, &topic, &m.key, &headers, &m.body).await;
    }
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
    consume_until(&consumer, &AuditLog, "copied", |s| {
        s["applied"].as_u64().unwrap() + s["duplicates"].as_u64().unwrap() >= 5
    })
    .await;
    let s = consumer.counters().snapshot();
    assert_eq!(
        (
            s["applied"].as_u64(),
            s["duplicates"].as_u64(),
            s["stale"].as_u64()
        ),
        (Some(4), Some(1), Some(0)),
        "{s}"
    );
    let versions: Vec<i64> = sqlx::query_scalar(
        "SELECT version FROM jobledger_consumer.audit_log WHERE job_id = $1 ORDER BY version",
    )
    .bind(job.job_id)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(versions, vec![1, 2, 3]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_jobledger"))
        .args(["verify", "--audit-log", &url])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "gappy's v1 is missing: {stdout}");
    let problems: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l.get("problem").is_some())
        .collect();
    assert_eq!(problems.len(), 1, "{stdout}");
    assert_eq!(problems[0]["problem"]["job_id"], json!(gappy.job_id));
    assert_eq!(problems[0]["problem"]["version"], json!(1));
    assert!(
        problems[0]["problem"]["detail"]
            .as_str()
            .unwrap()
            .starts_with("gap"),
        "{stdout}"
    );
    assert!(stdout.contains("\"gaps\":1"), "{stdout}");
}
