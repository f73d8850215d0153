//! Every message the relay produces validates against the published JSON
//! Schema (docs/schema/message.schema.json for the body, headers.schema.json
//! for the headers): the version-1 fixture log (every edge of 2026-12-02),
//! today's version-2 events on top of it, a workflow, and a signed
//! checkpoint, relayed to the real broker (tansu) and read back raw.

mod common;

use common::kafka::{brokers, relay_cfg, topic};
use common::{fresh, new_job, within};
use jobledger::audit::checkpointer::{CheckpointConfig, Checkpointer};
use jobledger::relay::Relay;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use tokio_util::sync::CancellationToken;

fn schema(name: &str) -> jsonschema::Validator {
    let text = std::fs::read_to_string(format!("{}/docs/schema/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    jsonschema::options()
        .should_validate_formats(true)
        .build(&serde_json::from_str(&text).unwrap())
        .unwrap()
}

#[tokio::test]
async fn every_relayed_message_validates_against_the_published_schema() {
    let (body_schema, header_schema) = (schema("message.schema.json"), schema("headers.schema.json"));
    // The schema is not vacuous: a body missing its hash, or an observation
    // of schema 2 in the schema-1 shape, is refused.
    assert!(!body_schema.is_valid(&json!({ "schema": 1 })));

    let db = fresh().await;
    common::fixture::load(&db).await;
    // Today's events on top: an observation (schema 2's shape), new jobs,
    // a workflow step, and a signed checkpoint of the log.
    let job: uuid::Uuid =
        sqlx::query_scalar("SELECT job_id FROM jobledger.jobs WHERE state = 'succeeded' LIMIT 1")
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    let r = db
        .ledger
        .observe(job, None, "late", json!({ "n": 1 }), "webhook")
        .await
        .unwrap();
    assert!(r.committed());
    db.ledger
        .enqueue(new_job("q", Some("k/1%"), json!({ "new": true })))
        .await
        .unwrap();
    traced_enqueue(&db).await;
    assert!(db
        .claim_one("w")
        .await
        .complete(Some(json!({ "ok": 1 })))
        .await
        .unwrap()
        .committed());
    let dir = std::env::temp_dir().join(format!("jl-schema-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    jobledger::audit::keys::keygen(&dir.join("key")).unwrap();
    let key = jobledger::audit::keys::signing_key(&dir.join("key")).unwrap();
    Checkpointer::new(db.ledger.clone(), key, CheckpointConfig::default())
        .checkpoint_now()
        .await
        .unwrap();
    let total: i64 = db.count("SELECT count(*) FROM jobledger.events").await;

    let topic = topic();
    let relay = Relay::new(db.ledger.clone(), relay_cfg(&topic));
    relay.ensure_topic().await.unwrap();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let running = tokio::spawn(async move { relay.run(s).await.unwrap() });
    let c: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", format!("schema-{}", uuid::Uuid::new_v4().simple()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    c.subscribe(&[&topic]).unwrap();
    let got = within("every event relayed", async {
        let mut got: HashMap<i64, (Value, Value)> = HashMap::new();
        while (got.len() as i64) < total {
            let Ok(m) = c.recv().await else { continue };
            let headers: serde_json::Map<String, Value> = m
                .headers()
                .unwrap()
                .iter()
                .map(|h| {
                    (
                        h.key.to_string(),
                        Value::String(String::from_utf8(h.value.unwrap().to_vec()).unwrap()),
                    )
                })
                .collect();
            let body: Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
            got.insert(body["position"].as_i64().unwrap(), (Value::Object(headers), body));
        }
        got
    })
    .await;
    stop.cancel();
    running.await.unwrap();
    let traced = got
        .values()
        .filter(|(h, b)| h.get("traceparent").is_some() && b["data"].get("traceparent").is_some());
    assert_eq!(
        traced.count(),
        1,
        "the traced enqueue's message carries its trace"
    );

    let mut kinds = BTreeSet::new();
    for (position, (headers, body)) in &got {
        let errors: Vec<String> = body_schema
            .iter_errors(body)
            .map(|e| format!("{e} at {}", e.instance_path))
            .collect();
        assert!(errors.is_empty(), "position {position}: {errors:?}\n{body}");
        let errors: Vec<String> = header_schema
            .iter_errors(headers)
            .map(|e| e.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "position {position} headers: {errors:?}\n{headers}"
        );
        kinds.insert((
            body["type"].as_str().unwrap().to_string(),
            body["schema"].as_i64().unwrap(),
        ));
    }
    for want in [
        ("observed", 1),
        ("observed", 2),
        ("checkpoint", 2),
        ("step_finished", 1),
        ("enqueued", 2),
    ] {
        assert!(
            kinds.contains(&(want.0.to_string(), want.1)),
            "no {want:?} among {kinds:?}"
        );
    }
    // And the schema tells the shapes apart: a schema-2 observation in the
    // schema-1 shape does not validate.
    let (_, (_, v1)) = got
        .iter()
        .find(|(_, (_, b))| b["type"] == "observed" && b["schema"] == 1)
        .unwrap();
    let mut relabelled = v1.clone();
    relabelled["schema"] = json!(2);
    assert!(!body_schema.is_valid(&relabelled));
}

/// A job enqueued with tracing on: its `enqueued` event carries the
/// `traceparent`, and the relay sends the event's span as a header (here
/// passed through: the relay of this test does not trace).
async fn traced_enqueue(db: &common::TestDb) {
    use opentelemetry::trace::TracerProvider as _;
    use tracing::Instrument;
    use tracing_subscriber::layer::SubscriberExt;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    // This test's runtime has one thread: the default holds for the enqueue.
    let _default = tracing::subscriber::set_default(subscriber);
    jobledger::telemetry::set_enabled(true);
    let e = db
        .ledger
        .enqueue(new_job("q", None, json!({ "traced": true })))
        .instrument(tracing::info_span!("caller"))
        .await
        .unwrap();
    jobledger::telemetry::set_enabled(false);
    assert!(e.job.traceparent.is_some(), "the enqueue was traced");
}
