//! Issue 11, downstream: a workflow's parent and step events go through the
//! same relay to the real broker (tansu); every step's messages carry their
//! parent's id and their step name in the headers and the body, so a
//! consumer can rebuild the tree.

mod common;

use common::kafka::{brokers, relay_cfg, topic};
use common::{fresh, within};
use jobledger::domain::workflow::{DependencyPolicy, StepSpec, WorkflowSpec};
use jobledger::relay::Relay;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn step(name: &str, after: &[&str]) -> StepSpec {
    StepSpec {
        name: name.into(),
        queue: None,
        kind: name.into(),
        key: None,
        payload: json!({}),
        after: after.iter().map(|s| s.to_string()).collect(),
        on_dependency_failure: DependencyPolicy::Cancel,
        priority: 0,
        policy: None,
    }
}

#[tokio::test]
async fn step_messages_carry_their_parent_and_step_name() {
    let db = fresh().await;
    let spec = WorkflowSpec {
        queue: "q".into(),
        name: "publish_note".into(),
        key: Some("relayed".into()),
        payload: json!(null),
        steps: vec![step("render", &[]), step("review", &["render"])],
        finally: None,
    };
    let created = db.ledger.workflow(&spec).await.unwrap();
    let parent = created.parent.job.job_id;
    let render = db.claim_one("w").await;
    assert!(render.complete(None).await.unwrap().committed());
    let events: HashSet<(String, i64)> =
        sqlx::query_as::<_, (Uuid, i64)>("SELECT job_id, version FROM jobledger.events")
            .fetch_all(db.ledger.pool())
            .await
            .unwrap()
            .into_iter()
            .map(|(j, v)| (j.to_string(), v))
            .collect();

    let topic = topic();
    let relay = Relay::new(db.ledger.clone(), relay_cfg(&topic));
    // The topic exists before the consumer asks for it.
    relay.ensure_topic().await.unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let running = tokio::spawn(async move { relay.run(s).await.unwrap() });
    let c: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", format!("raw-{}", Uuid::new_v4().simple()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    c.subscribe(&[&topic]).unwrap();
    // (job, version) -> (headers, body)
    let got = within("the relayed events", async {
        let mut got: HashMap<(String, i64), (HashMap<String, String>, Value)> = HashMap::new();
        while !events.iter().all(|k| got.contains_key(k)) {
            // A fresh topic's metadata may lag behind its creation: the
            // consumer reports that as an error and goes on.
            let Ok(m) = c.recv().await else {
                continue;
            };
            let headers: HashMap<String, String> = m
                .headers()
                .unwrap()
                .iter()
                .map(|h| {
                    (
                        h.key.to_string(),
                        String::from_utf8(h.value.unwrap().to_vec()).unwrap(),
                    )
                })
                .collect();
            let body: Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
            let key = (
                body["job_id"].as_str().unwrap().to_string(),
                body["version"].as_i64().unwrap(),
            );
            got.insert(key, (headers, body));
        }
        got
    })
    .await;
    stop.cancel();
    running.await.unwrap();

    for (name, e) in &created.steps {
        let id = e.job.job_id.to_string();
        let mine: Vec<_> = got.iter().filter(|((j, _), _)| *j == id).collect();
        assert!(!mine.is_empty(), "{name}'s events were relayed");
        for (_, (h, b)) in mine {
            assert_eq!(h.get("workflow"), Some(&parent.to_string()), "{name}: header");
            assert_eq!(h.get("step"), Some(name), "{name}: header");
            assert_eq!(b["workflow"], json!(parent.to_string()), "{name}: body");
            assert_eq!(b["step"], json!(name), "{name}: body");
        }
    }
    let parent_msgs: Vec<_> = got
        .iter()
        .filter(|((j, _), _)| *j == parent.to_string())
        .collect();
    assert!(parent_msgs.iter().any(|(_, (_, b))| b["type"] == "step_finished"));
    assert!(
        parent_msgs.iter().all(|(_, (h, _))| !h.contains_key("step")),
        "the parent is no step"
    );
}

/// Issue 15: the relay reads a job's queue, key and workflow tie off its
/// `enqueued` event instead of looking the job up. For a plain job, a keyed
/// one, a keyed workflow's parent and its steps (one keyed), what it reads
/// must equal what the lookup returns, whether the event's data was read
/// parsed or unparsed (`read_raw`, the relay's read); and a message made
/// from either carries the same JSON.
#[tokio::test]
async fn the_relays_keys_read_off_an_enqueued_event_equal_the_jobs_own() {
    use common::reading::{drain, drain_raw};
    use jobledger::reader::{Checkpoint, LogReader};
    use jobledger::relay::message::keys_of_enqueued;
    let db = fresh().await;
    db.enqueue(None, json!({})).await;
    db.enqueue(Some("a/b%c"), json!({})).await;
    let mut keyed = step("review", &["render"]);
    keyed.key = Some("rev-1".into());
    let spec = WorkflowSpec {
        queue: "q".into(),
        name: "publish_note".into(),
        key: Some("keyed-parent".into()),
        payload: json!(null),
        steps: vec![step("render", &[]), keyed],
        finally: None,
    };
    db.ledger.workflow(&spec).await.unwrap();
    let reader = LogReader::source(db.ledger.pool().clone());
    // Read both ways: parsed, and unparsed as the relay reads (issue 15).
    // A batch may come back short, or empty while another test's
    // transaction holds the horizon: read to the end.
    let mut both = vec![];
    for raw in [false, true] {
        let (mut events, _) = if raw {
            drain_raw(&reader, Checkpoint::default(), 100).await
        } else {
            drain(&reader, Checkpoint::default(), 100).await
        };
        // Compared event by event below: drained batches are each sorted on
        // their own and may hand a version out twice, so order them as one.
        events.sort_by_key(|e| (e.job_id(), e.version()));
        events.dedup_by_key(|e| (e.job_id(), e.version()));
        assert_eq!(
            events.iter().filter(|e| e.raw_data.is_some()).count(),
            if raw { events.len() } else { 0 },
            "read_raw leaves each event's data unparsed, read parses it"
        );
        both.push(events);
    }
    let (parsed, raw) = (&both[0], &both[1]);
    assert_eq!(parsed.len(), raw.len());
    for (p, r) in parsed.iter().zip(raw) {
        // The same message either way: the body's data is the same JSON.
        let body = |e: &jobledger::reader::LogEvent| -> serde_json::Value {
            serde_json::from_slice(&jobledger::relay::message::message(e, "q", None, None).body).unwrap()
        };
        assert_eq!(body(p), body(r), "{} v{}", p.job_id(), p.version());
        assert_eq!(body(r)["data"], p.row.data);
    }
    let firsts: Vec<_> = parsed.iter().chain(raw).filter(|e| e.version() == 1).collect();
    assert_eq!(firsts.len(), 10, "two jobs, a parent and two steps; read twice");
    for e in firsts {
        let read = keys_of_enqueued(e).expect("an enqueued event states its keys");
        let looked_up = jobledger::store::jobs::job_keys(db.ledger.pool(), &[e.job_id()])
            .await
            .unwrap();
        let got = (read.job_id, read.queue, read.job_key, read.parent, read.step);
        let want = looked_up
            .into_iter()
            .map(|k| (k.job_id, k.queue, k.job_key, k.parent, k.step))
            .collect::<Vec<_>>();
        assert_eq!(vec![got], want);
    }
    // A shape the ledger never writes is left to the lookup, never read by
    // position: data, or its workflow tie, as an array (review, helper-30).
    let e = parsed.iter().find(|e| e.version() == 1).unwrap();
    for data in [
        json!(["q2", "k2", {"parent": "P", "step": "S"}]),
        json!({"queue": "q", "job_key": "k", "workflow": ["P", "S"]}),
    ] {
        let mut forged = e.clone();
        forged.row.data = data.clone();
        assert!(keys_of_enqueued(&forged).is_none(), "{data}");
        forged.row.data = serde_json::Value::Null;
        forged.raw_data = Some(serde_json::value::RawValue::from_string(data.to_string()).unwrap());
        assert!(keys_of_enqueued(&forged).is_none(), "raw {data}");
    }
}
