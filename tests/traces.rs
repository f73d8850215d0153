//! Traces that follow a job (issue 16), through the real binary, the real
//! broker (tansu) and an in-process OTLP receiver (a tonic server built from
//! the OTLP protobuf crate): one job's enqueue, claim, handler, completion,
//! relay publish and consumer apply are spans of one trace, each with the
//! right parent, across four processes.

mod common;

use common::kafka::{brokers, topic};
use common::otlp::*;
use common::{eventually, fresh};
use opentelemetry_proto::tonic::trace::v1::Span;
use std::process::{Command, Stdio};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_jobs_spans_form_one_trace_across_the_processes() {
    let db = fresh().await;
    let (endpoint, got) = receiver().await;
    let topic = topic();
    let dir = std::env::temp_dir().join(format!("jl-trace-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let seen = dir.join("traceparent");

    // 1. Enqueue from a script that is itself in a trace.
    let job_id = enqueue_in_callers_trace(&db.url, &endpoint);

    // 2. A worker runs it with a command that keeps what it was handed,
    // long enough to heartbeat.
    let script = format!(
        "printf %s \"$TRACEPARENT\" > {}; sleep 1; echo '{{}}'",
        seen.display()
    );
    let worker = jobledger(&db.url, &endpoint, &worker_args(&script))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    eventually("the job succeeds", || async {
        db.state_of(job_id).await == jobledger::domain::JobState::Succeeded
    })
    .await;
    stop(worker);
    // Every event of the job names the span that wrote it, heartbeats too.
    let events = db
        .count(&format!(
            "SELECT count(*) FROM jobledger.events WHERE job_id = '{job_id}'"
        ))
        .await as usize;
    let untraced = db
        .count(&format!(
            "SELECT count(*) FROM jobledger.events WHERE job_id = '{job_id}' AND trace IS NULL"
        ))
        .await;
    assert_eq!(untraced, 0, "every event of the job is traced");

    // 3. The relay publishes the job's events; 4. the status mirror applies them.
    let relay = jobledger(
        &db.url,
        &endpoint,
        &[
            "relay",
            "--brokers",
            &brokers(),
            "--topic",
            &topic,
            "--partitions",
            "1",
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::inherit())
    .spawn()
    .unwrap();
    let mirror_db = format!("{}/jlt_{}", common::server_url(), Uuid::new_v4().simple());
    let mirror = jobledger(
        &db.url,
        &endpoint,
        &[
            "consume",
            "status-mirror",
            "--brokers",
            &brokers(),
            "--topic",
            &topic,
            "--consumer-database-url",
            &mirror_db,
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::inherit())
    .spawn()
    .unwrap();
    eventually("the consumer applies every event", || async {
        got.named("jobledger.consume").len() >= events
    })
    .await;
    stop(relay);
    stop(mirror);

    let one = |name: &str| -> Span {
        let v = got.named(name);
        assert_eq!(
            v.len(),
            1,
            "one {name} span: {:?}",
            got.spans().iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        v.into_iter().next().unwrap()
    };
    let cli = one("jobledger enqueue");
    let enqueue = one("jobledger.enqueue");
    let claim = one("jobledger.claim");
    let handle = one("jobledger.handle");
    let complete = one("jobledger.complete");
    let publishes = got.named("jobledger.publish");
    let consumes = got.named("jobledger.consume");

    // Every span of the job is in the caller's trace.
    for s in [&cli, &enqueue, &claim, &handle, &complete]
        .into_iter()
        .chain(&publishes)
        .chain(&consumes)
    {
        assert_eq!(
            hex(&s.trace_id),
            CALLER_TRACE,
            "{} is in the caller's trace",
            s.name
        );
    }
    // The chain of parents, process to process.
    assert_eq!(
        hex(&cli.parent_span_id),
        CALLER_SPAN,
        "the CLI continues TRACEPARENT"
    );
    assert_eq!(enqueue.parent_span_id, cli.span_id);
    assert_eq!(
        claim.parent_span_id, enqueue.span_id,
        "the claim continues the enqueue"
    );
    assert_eq!(
        handle.parent_span_id, claim.span_id,
        "the handler runs under its claim"
    );
    assert_eq!(
        complete.parent_span_id, handle.span_id,
        "the batched completion is its handler's child"
    );
    assert_eq!(
        attr(&claim, "job_id").as_deref(),
        Some(job_id.to_string().as_str())
    );
    assert_eq!(attr(&claim, "token").as_deref(), Some("1"));
    // The worker's batched heartbeats are spans of the job, under its claim.
    let heartbeats = got.named("jobledger.heartbeat");
    // (A heartbeat racing the completion is a span whose write was refused.)
    assert!(
        events > 3 && heartbeats.len() >= events - 3,
        "{events} events, {} heartbeats",
        heartbeats.len()
    );
    for h in &heartbeats {
        assert_eq!(
            h.parent_span_id, claim.span_id,
            "a heartbeat continues its lease's claim"
        );
    }
    assert_eq!(
        publishes.len(),
        events,
        "every event is published in the job's trace"
    );

    // Each event's publish is a child of the span that wrote the event.
    let publish_of = |ty: &str| -> Span {
        let v: Vec<_> = publishes
            .iter()
            .filter(|s| attr(s, "type").as_deref() == Some(ty))
            .cloned()
            .collect();
        assert_eq!(v.len(), 1, "one publish of {ty}");
        v.into_iter().next().unwrap()
    };
    assert_eq!(publish_of("enqueued").parent_span_id, enqueue.span_id);
    assert_eq!(publish_of("claimed").parent_span_id, claim.span_id);
    assert_eq!(publish_of("succeeded").parent_span_id, complete.span_id);
    // Each consumer apply is a child of one publish, and every publish has one.
    let mut parents: Vec<_> = consumes.iter().map(|c| c.parent_span_id.clone()).collect();
    let mut published: Vec<_> = publishes.iter().map(|p| p.span_id.clone()).collect();
    parents.sort();
    published.sort();
    assert_eq!(
        parents, published,
        "each consumer span continues the publish of its message"
    );

    // The command was handed the handler's span.
    assert_eq!(std::fs::read_to_string(&seen).unwrap(), traceparent(&handle));
    // The job keeps its trace: in its `enqueued` event (under the hash) and
    // on its row, both naming the enqueue span.
    let job = db.job(job_id).await;
    assert_eq!(job.traceparent.as_deref(), Some(traceparent(&enqueue).as_str()));
    let (data,): (serde_json::Value,) =
        sqlx::query_as("SELECT data FROM jobledger.events WHERE job_id = $1 AND version = 1")
            .bind(job_id)
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(data["traceparent"].as_str(), Some(traceparent(&enqueue).as_str()));
    db.assert_verified().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// `POST` with a JSON body, a bearer token and a `traceparent` header.
async fn post_traced(
    s: &common::serve::Server,
    path: &str,
    token: &str,
    tp: &str,
    body: serde_json::Value,
) -> serde_json::Value {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", s.base))
        .bearer_auth(token)
        .header("traceparent", tp)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{path}: {}", resp.status());
    resp.json().await.unwrap()
}

/// Over HTTP: an enqueue continues its caller's trace; a remote worker's
/// claim hands out the claim span (in the job's trace, whatever trace the
/// worker's own request was in), and a write sent under it continues it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_api_continues_and_hands_out_the_jobs_trace() {
    let db = fresh().await;
    let (endpoint, got) = receiver().await;
    let token = db
        .ledger
        .create_token("svc", jobledger::ledger::tokens::Role::Worker)
        .await
        .unwrap();
    let s = common::serve::Server::start_with(&db.url, &["--otlp-endpoint", &endpoint]);
    let caller = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let body = serde_json::json!({ "queue": "q", "kind": "k", "payload": {} });
    let job = post_traced(&s, "/v1/jobs", &token, &caller, body.clone()).await;
    let job_id: Uuid = job["job_id"].as_str().unwrap().parse().unwrap();
    // A second job, from another service's trace.
    let other = post_traced(
        &s,
        "/v1/jobs",
        &token,
        &format!("00-{OTHER_TRACE}-{CALLER_SPAN}-01"),
        body,
    )
    .await;
    let other_id: Uuid = other["job_id"].as_str().unwrap().parse().unwrap();

    // Two traceparent headers are no trace context (W3C): a new trace.
    let both = reqwest::Client::new()
        .post(format!("{}/v1/jobs", s.base))
        .bearer_auth(&token)
        .header("traceparent", &caller)
        .header("traceparent", format!("00-{OTHER_TRACE}-{CALLER_SPAN}-01"))
        .json(&serde_json::json!({ "queue": "elsewhere", "kind": "k", "payload": {} }))
        .send()
        .await
        .unwrap();
    assert_eq!(both.status(), 201);
    let tp = job_traceparent(db.ledger.pool(), "elsewhere").await;
    assert!(!tp.contains(CALLER_TRACE) && !tp.contains(OTHER_TRACE), "{tp}");

    // The worker's request is in a trace of its own.
    let theirs = "00-11111111111111111111111111111111-2222222222222222-01";
    let claim = serde_json::json!({ "worker": "py", "lease_ms": 60_000, "limit": 2 });
    let leases = post_traced(&s, "/v1/queues/q/claim", &token, theirs, claim).await;
    let of = |id: Uuid| {
        leases["leases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["job_id"] == id.to_string())
            .cloned()
            .unwrap()
    };
    let (lease, other_lease) = (&of(job_id), &of(other_id));
    let handed = lease["traceparent"]
        .as_str()
        .expect("the grant names its claim span")
        .to_string();
    assert!(
        handed.starts_with(&format!("00-{CALLER_TRACE}-")),
        "the job's trace: {handed}"
    );
    // Both leases heartbeated and completed in one batch each, sent under
    // the first job's span: each job's writes stay in its own trace.
    let items = serde_json::json!([
        { "job_id": job_id, "epoch": lease["epoch"], "token": lease["token"] },
        { "job_id": other_id, "epoch": other_lease["epoch"], "token": other_lease["token"] },
    ]);
    let beat = serde_json::json!({ "worker": "py", "lease_ms": 60_000, "items": items });
    let out = post_traced(&s, "/v1/leases/heartbeat", &token, &handed, beat).await;
    assert_eq!(out["answers"][1]["outcome"], "committed", "{out}");
    let done = serde_json::json!({ "worker": "py", "items": items });
    let out = post_traced(&s, "/v1/leases/complete", &token, &handed, done).await;
    assert_eq!(out["answers"][0]["outcome"], "committed", "{out}");
    assert_eq!(out["answers"][1]["outcome"], "committed", "{out}");
    let traces: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT type, trace FROM jobledger.events WHERE job_id = $1 AND type IN ('lease_extended', 'succeeded')",
    )
    .bind(other_id)
    .fetch_all(db.ledger.pool())
    .await
    .unwrap();
    assert_eq!(traces.len(), 2);
    for (ty, t) in traces {
        let t = t.unwrap_or_else(|| panic!("{ty} is traced"));
        assert!(
            t.starts_with(&format!("00-{OTHER_TRACE}-")),
            "{ty} stays in its own job's trace: {t}"
        );
    }
    let succeeded: (Option<String>,) =
        sqlx::query_as("SELECT trace FROM jobledger.events WHERE job_id = $1 AND type = 'succeeded'")
            .bind(job_id)
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    assert_eq!(s.stop(), 0);

    let spans = got.spans();
    let by_id = |id: &[u8]| spans.iter().find(|s| s.span_id == id).cloned();
    let request = got
        .named("POST /v1/jobs")
        .into_iter()
        .find(|r| hex(&r.trace_id) == CALLER_TRACE)
        .expect("the enqueue request is a span");
    assert_eq!(
        hex(&request.parent_span_id),
        CALLER_SPAN,
        "it continues the caller's traceparent"
    );
    let enqueue = got
        .named("jobledger.enqueue")
        .into_iter()
        .find(|e| e.parent_span_id == request.span_id)
        .expect("the enqueue is the request's child");
    let claim = got
        .named("jobledger.claim")
        .into_iter()
        .find(|c| hex(&c.trace_id) == CALLER_TRACE)
        .unwrap();
    assert_eq!(
        claim.parent_span_id, enqueue.span_id,
        "the claim is in the job's trace"
    );
    assert_eq!(traceparent(&claim), handed);
    // The completion's request continues the handed-out span, and the
    // `succeeded` event names a span under that request.
    let complete_req = got.named("POST /v1/leases/complete").pop().unwrap();
    assert_eq!(complete_req.parent_span_id, claim.span_id);
    let written = succeeded.0.expect("the event names the span that wrote it");
    let writer = spans
        .iter()
        .find(|s| traceparent(s) == written)
        .unwrap_or_else(|| panic!("{written} is a span the receiver got"));
    let mut up = writer.clone();
    while up.span_id != complete_req.span_id {
        up = by_id(&up.parent_span_id).unwrap_or_else(|| panic!("{} leads up to the request", writer.name));
    }
}

/// Off means off: without an endpoint nothing is stored or passed on, not
/// even a TRACEPARENT the worker itself was started with; and with tracing
/// on, a malformed TRACEPARENT starts a new trace instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_stores_nothing_and_a_bad_traceparent_starts_a_new_trace() {
    let db = fresh().await;
    let dir = std::env::temp_dir().join(format!("jl-trace-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let seen = dir.join("traceparent");
    let caller = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let run = |args: &[&str], tp: &str| {
        Command::new(env!("CARGO_BIN_EXE_jobledger"))
            .args(args)
            .env("DATABASE_URL", &db.url)
            .env("TRACEPARENT", tp)
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let out = run(
        &["enqueue", "--queue", "q", "--kind", "k", "--payload", "{}"],
        &caller,
    );
    assert!(out.status.success());
    let script = format!(
        "printf %s \"${{TRACEPARENT-unset}}\" > {}; echo '{{}}'",
        seen.display()
    );
    let mut worker = Command::new(env!("CARGO_BIN_EXE_jobledger"))
        .args(worker_args(&script))
        .env("DATABASE_URL", &db.url)
        .env("TRACEPARENT", &caller)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    eventually("the job succeeds", || async { db.open_jobs().await == 0 }).await;
    let _ = worker.kill();
    let _ = worker.wait();
    assert_eq!(std::fs::read_to_string(&seen).unwrap(), "unset");
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events WHERE trace IS NOT NULL")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs WHERE traceparent IS NOT NULL")
            .await,
        0
    );
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.events WHERE data ? 'traceparent'")
            .await,
        0
    );

    // On, with a TRACEPARENT that is not one: a new trace, exit 0.
    let (endpoint, _got) = receiver().await;
    let out = run(
        &[
            "enqueue",
            "--queue",
            "q2",
            "--kind",
            "k",
            "--payload",
            "{}",
            "--otlp-endpoint",
            &endpoint,
        ],
        "00-not-a-trace",
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tp = job_traceparent(db.ledger.pool(), "q2").await;
    assert!(
        jobledger::telemetry::context_of(&tp).is_some() && !tp.contains(CALLER_TRACE),
        "{tp}"
    );
    db.assert_verified().await;
    let _ = std::fs::remove_dir_all(dir);
}
