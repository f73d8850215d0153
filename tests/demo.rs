//! The README's demo, end to end: against the real broker when one answers
//! at `--brokers`, and against librdkafka's in-process mock cluster (with a
//! leader move and a broker down during the relay) when none does.

mod common;

use common::{cli::jl, fresh};
use serde_json::Value;

fn demo(url: &str, brokers: &str) -> Value {
    let run = jl(
        url,
        &["demo", "--jobs", "150", "--workers", "3", "--brokers", brokers],
    );
    assert!(!run.stderr.contains("no relay and no consumer"), "{}", run.stderr);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let out = run.json();
    assert_eq!(out["ok"], true, "{out}");
    assert_eq!(out["problems"], 0, "{out}");
    assert_eq!(out["duplicate_refunds"], 0, "{out}");
    let kafka = &out["kafka"];
    assert_eq!(kafka["mirror_equal"], true, "{out}");
    assert!(
        kafka["published"].as_u64().unwrap() >= out["verified_events"].as_u64().unwrap(),
        "every event of the run went out: {out}"
    );
    out
}

#[tokio::test]
async fn with_no_broker_the_demo_relays_to_the_mock_cluster_through_its_faults() {
    let db = fresh().await;
    // A loopback port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = demo(&db.url, &format!("127.0.0.1:{port}"));
    let kafka = &out["kafka"];
    assert!(
        kafka["broker"]
            .as_str()
            .unwrap()
            .starts_with("in-process mock cluster (3 brokers"),
        "{out}"
    );
    let faults: Vec<&str> = kafka["faults"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert_eq!(faults.len(), 2, "a leader move and a broker down: {out}");
    assert!(
        faults[0].starts_with("leaders of all 4 partitions moved to broker 2"),
        "{out}"
    );
    assert!(faults[1].starts_with("broker 2 (every leader) down"), "{out}");
    assert!(!faults.iter().any(|f| f.contains("(failed")), "{out}");
}

#[tokio::test]
async fn with_a_broker_the_demo_relays_to_it() {
    let db = fresh().await;
    let brokers = common::kafka::brokers();
    let out = demo(&db.url, &brokers);
    assert_eq!(out["kafka"]["broker"], format!("Kafka at {brokers}"), "{out}");
    assert_eq!(out["kafka"]["faults"].as_array().unwrap().len(), 0, "{out}");
}

/// A broker that answers but will not make the topic (here a mock cluster
/// of the test's own, which rejects the admin API): the relay and the
/// consumer cannot run, and a demo without them does not pass.
#[tokio::test]
async fn a_demo_whose_relay_cannot_start_does_not_pass() {
    let db = fresh().await;
    let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
    let brokers = mock.bootstrap_servers();
    let url = db.url.clone();
    let run = tokio::task::spawn_blocking(move || {
        jl(
            &url,
            &["demo", "--jobs", "30", "--workers", "2", "--brokers", &brokers],
        )
    })
    .await
    .unwrap();
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(
        run.stderr.contains("no relay and no consumer: the broker at"),
        "{}",
        run.stderr
    );
    let out = run.json();
    assert_eq!(out["ok"], false, "{out}");
    assert_eq!(out["kafka"], Value::Null, "{out}");
    drop(mock);
}

#[test]
fn too_few_jobs_is_a_clear_error() {
    let run = jl(
        "postgres://postgres@127.0.0.1:5432/unused",
        &["demo", "--jobs", "10"],
    );
    assert_ne!(run.code, 0);
    assert!(
        run.stderr.contains("the demo needs --jobs 30 or more"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
}
