//! The Python example consumer (examples/python-consumer, confluent-kafka)
//! against the real broker: it applies every event the relay published,
//! keeps the highest (epoch, token, version) per key, rejects an older
//! message sent after a newer one as stale and a resent one as a duplicate,
//! and ends with every job in the state the ledger has.

mod common;

use common::kafka::{brokers, produce, relay_cfg, topic};
use common::{eventually, fresh, new_job};
use jobledger::reader::LogReader;
use jobledger::relay::message::message;
use jobledger::relay::Relay;
use rdkafka::producer::FutureProducer;
use serde_json::{json, Value};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn the_python_consumer_fences_by_key() {
    let db = fresh().await;
    for i in 0..12 {
        db.ledger
            .enqueue(new_job("q", Some(&format!("order-{i}")), json!({ "i": i })))
            .await
            .unwrap();
    }
    let leases = db
        .ledger
        .claim("q", "w", Duration::from_secs(30), 12)
        .await
        .unwrap();
    for (i, l) in leases.into_iter().enumerate() {
        if i % 3 != 0 {
            assert!(l.complete(Some(json!({ "i": i }))).await.unwrap().committed());
        }
    }
    let total = db.count("SELECT count(*) FROM jobledger.events").await;

    let topic = topic();
    let cfg = relay_cfg(&topic);
    let reader_name = cfg.reader.clone();
    let relay = Relay::new(db.ledger.clone(), cfg);
    relay.ensure_topic().await.unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let running = tokio::spawn(async move { relay.run(s).await.unwrap() });
    let reader = LogReader::open(db.ledger.pool().clone(), &reader_name)
        .await
        .unwrap();
    eventually("the relay published the whole log", || async {
        let cp = reader.checkpoint().await.unwrap();
        reader.lag(cp).await.unwrap().events == 0
    })
    .await;
    stop.cancel();
    running.await.unwrap();

    // After the relay: an older message of a job (its claim, below its
    // completion) and a resend of a job's latest message.
    let job: uuid::Uuid =
        sqlx::query_scalar("SELECT job_id FROM jobledger.jobs WHERE state = 'succeeded' LIMIT 1")
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    let rows = jobledger::store::events::job_events(db.ledger.pool(), job)
        .await
        .unwrap();
    let p: FutureProducer = rdkafka::config::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let j = db.job(job).await;
    for row in [&rows[1], rows.last().unwrap()] {
        let ev = jobledger::reader::LogEvent {
            position: row.position,
            row: row.clone(),
            raw_data: None,
        };
        let m = message(&ev, &j.queue, j.job_key.as_deref(), None);
        let headers: Vec<(&str, &str)> = m.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        produce(&p, &topic, &m.key, &headers, &m.body).await;
    }

    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/python-consumer/consumer.py"
    );
    let python = concat!(env!("CARGO_MANIFEST_DIR"), "/target/pytools/bin/python");
    let out = tokio::process::Command::new(python)
        .args([script, "--brokers", &brokers(), "--topic", &topic])
        .args(["--group", &format!("py-{}", uuid::Uuid::new_v4().simple())])
        .args(["--max-messages", &(total + 2).to_string(), "--idle-seconds", "30"])
        .output()
        .await
        .expect("the venv's python (scripts/py-tools) runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["messages"], json!(total + 2), "{report}");
    assert_eq!(report["applied"], json!(total), "{report}");
    assert_eq!(report["stale"], json!(1), "{report}");
    assert_eq!(report["duplicate"], json!(1), "{report}");
    assert_eq!(report["undecodable"], json!(0), "{report}");
    for (id, state, _) in db.ledger.states_in("q").await.unwrap() {
        let key = format!("q/{}", db.job(id).await.job_key.unwrap());
        assert_eq!(report["states"][&key]["state"], json!(state), "{key}: {report}");
    }
}
