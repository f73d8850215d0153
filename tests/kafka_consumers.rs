//! The shipped consumers against the real broker (tansu): the status
//! mirror, the audit log and `verify --audit-log`, and the fence per job
//! stream. The relay itself is in tests/kafka.rs.

mod common;

use common::kafka::{
    assert_in_order, assert_last_versions_match, brokers, consume_until, consumer_db, event_count, fenced,
    read_ledger_from_topic, relay_cfg, spawn_relay, topic,
};
use common::reading::drain;
use common::{fresh, new_job, within};
use jobledger::reader::LogReader;
use jobledger::relay::Relay;
use jobledger_consumers::shipped::{AuditLog, StatusMirror};
use rdkafka::config::ClientConfig;
use serde_json::json;
use std::time::Duration;
use uuid::Uuid;

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
    // Read to the end: one read may come back short (tests/common/reading.rs).
    let (events, _) = drain(&reader, Default::default(), 100).await;
    let ev = |id: Uuid, v: i64| {
        events
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
