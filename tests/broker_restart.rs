//! A broker restart mid-stream loses nothing: tansu on its durable sqlite
//! storage is killed while the relay runs and more events are written, then
//! restarted on the same storage; the relay resumes from its database
//! checkpoint and every event reaches a consumer.

mod common;

use common::{eventually, fresh};
use jobledger::relay::{Relay, RelayConfig};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::Message;
use serde_json::json;
use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn tansu() -> String {
    let home = std::env::var("HOME").unwrap_or_default();
    let installed = format!("{home}/.cargo/bin/tansu");
    if std::path::Path::new(&installed).exists() {
        installed
    } else {
        "tansu".into()
    }
}

fn start_broker(dir: &std::path::Path, port: u16) -> Child {
    Command::new(tansu())
        .current_dir(dir)
        .args(["broker", "--listener-url", &format!("tcp://127.0.0.1:{port}")])
        .args(["--advertised-listener-url", &format!("tcp://127.0.0.1:{port}")])
        .args(["--storage-engine", "sqlite://tansu.db"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("tansu is installed by scripts/kafka-up")
}

async fn answers(port: u16) -> bool {
    tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()
}

#[tokio::test]
async fn broker_restart_mid_stream_loses_nothing() {
    let dir = std::env::temp_dir().join(format!("jl-tansu-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let brokers = format!("127.0.0.1:{port}");
    let mut broker = start_broker(&dir, port);
    eventually("the durable broker answers", || answers(port)).await;

    let db = fresh().await;
    for i in 0..5 {
        db.enqueue(Some(&format!("before-{i}")), json!({ "i": i })).await;
    }
    let topic = format!("restart-{}", Uuid::new_v4().simple());
    let mut cfg = RelayConfig::new(&brokers, &topic);
    cfg.partitions = 1;
    cfg.poll = Duration::from_millis(50);
    cfg.message_timeout = Duration::from_secs(3);
    let relay = Relay::new(db.ledger.clone(), cfg);
    let counters = relay.counters();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let run = tokio::spawn(async move { relay.run(s).await.unwrap() });
    eventually("the first events are published", || async {
        counters.published.load(Ordering::Relaxed) >= 5
    })
    .await;

    broker.kill().unwrap();
    broker.wait().unwrap();
    for i in 0..5 {
        db.enqueue(Some(&format!("during-{i}")), json!({ "i": i })).await;
    }
    let failures_before = counters.failures.load(Ordering::Relaxed);
    eventually("the relay notices the broker is gone", || async {
        counters.failures.load(Ordering::Relaxed) > failures_before
    })
    .await;
    assert_eq!(
        counters.published.load(Ordering::Relaxed),
        5,
        "nothing counted while the broker is away"
    );

    let mut broker = start_broker(&dir, port);
    eventually("the broker is back", || answers(port)).await;
    eventually("the relay resumed and published the rest", || async {
        counters.published.load(Ordering::Relaxed) >= 10
    })
    .await;
    stop.cancel();
    run.await.unwrap();

    // Everything, from before the restart and after, is in the topic.
    let c: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("restart-{}", Uuid::new_v4().simple()))
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", "10")
        .create()
        .unwrap();
    c.subscribe(&[&topic]).unwrap();
    let mut keys = HashSet::new();
    while keys.len() < 10 {
        let m = tokio::time::timeout(Duration::from_secs(120), c.recv())
            .await
            .expect("messages arrive")
            .unwrap();
        keys.insert(String::from_utf8(m.key().unwrap().to_vec()).unwrap());
    }
    assert!(
        keys.contains("q/before-0") && keys.contains("q/during-4"),
        "{keys:?}"
    );
    broker.kill().unwrap();
    let _ = broker.wait();
    let _ = std::fs::remove_dir_all(dir);
}
