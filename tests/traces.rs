//! Traces that follow a job (issue 16), through the real binary, the real
//! broker (tansu) and an in-process OTLP receiver (a tonic server built from
//! the OTLP protobuf crate): one job's enqueue, claim, handler, completion,
//! relay publish and consumer apply are spans of one trace, each with the
//! right parent, across four processes.

mod common;

use common::kafka::{brokers, topic};
use common::{eventually, fresh};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use uuid::Uuid;

/// What the receiver was sent, every span of every process.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = self.0.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            for ss in rs.scope_spans {
                got.extend(ss.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Received {
    fn spans(&self) -> Vec<Span> {
        self.0.lock().unwrap().clone()
    }
    fn named(&self, name: &str) -> Vec<Span> {
        self.spans().into_iter().filter(|s| s.name == name).collect()
    }
}

/// An OTLP/gRPC receiver on a loopback port: its endpoint, and what it got.
async fn receiver() -> (String, Received) {
    let incoming = tonic::transport::server::TcpIncoming::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = incoming.local_addr().unwrap();
    let got = Received::default();
    let svc = TraceServiceServer::new(got.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(incoming),
    );
    (format!("http://{addr}"), got)
}

fn hex(b: &[u8]) -> String {
    hex::encode(b)
}

fn attr(s: &Span, key: &str) -> Option<String> {
    s.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(v) => Some(v.clone()),
            AnyValue::IntValue(v) => Some(v.to_string()),
            _ => None,
        })
}

fn traceparent(s: &Span) -> String {
    format!("00-{}-{}-01", hex(&s.trace_id), hex(&s.span_id))
}

/// The binary with traces exported to `endpoint` (quickly: 50 ms batches).
fn jobledger(db_url: &str, endpoint: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_jobledger"));
    c.args(args)
        .arg("--otlp-endpoint")
        .arg(endpoint)
        .env("DATABASE_URL", db_url)
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
        .env_remove("RUST_LOG")
        .env_remove("TRACEPARENT")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// `worker` on queue q running `script`: polling fast, heartbeating often.
fn worker_args(script: &str) -> Vec<&str> {
    vec![
        "worker",
        "--queue",
        "q",
        "--exec",
        script,
        "--poll",
        "50ms",
        "--heartbeat",
        "200ms",
        "--lease",
        "2s",
        "--no-sweeper",
        "--no-scheduler",
    ]
}

/// SIGTERM, then the exit: a service drains and flushes its spans.
fn stop(mut child: Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = child.wait().unwrap();
    assert!(out.success(), "a service stopped by SIGTERM exits 0: {out:?}");
}

/// The caller's trace: a service that enqueues from inside its own span.
const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";
/// Another service's trace.
const OTHER_TRACE: &str = "5ce0e9a5600d4a23a97f0c1a2b3c4d5e";

// Multi-threaded: the receiver answers while the test waits for a child.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_jobs_spans_form_one_trace_across_the_processes() {
    let db = fresh().await;
    let (endpoint, got) = receiver().await;
    let topic = topic();
    let dir = std::env::temp_dir().join(format!("jl-trace-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let seen = dir.join("traceparent");

    // 1. Enqueue from a script that is itself in a trace.
    let out = jobledger(
        &db.url,
        &endpoint,
        &["enqueue", "--queue", "q", "--kind", "k", "--payload", "{}"],
    )
    .env("TRACEPARENT", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let enq: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let job_id: Uuid = enq["job_id"].as_str().unwrap().parse().unwrap();

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
    let (tp,): (Option<String>,) =
        sqlx::query_as("SELECT traceparent FROM jobledger.jobs WHERE queue = 'elsewhere'")
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    let tp = tp.expect("traced");
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
    let (tp,): (Option<String>,) =
        sqlx::query_as("SELECT traceparent FROM jobledger.jobs WHERE queue = 'q2'")
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    let tp = tp.expect("traced");
    assert!(
        jobledger::telemetry::context_of(&tp).is_some() && !tp.contains(CALLER_TRACE),
        "{tp}"
    );
    db.assert_verified().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A tracing setting never stops the work: an endpoint this build cannot
/// export to (HTTPS: no TLS here) is a warning, and the command runs.
#[tokio::test]
async fn an_unusable_endpoint_is_a_warning_not_a_failure() {
    let db = fresh().await;
    let out = Command::new(env!("CARGO_BIN_EXE_jobledger"))
        .args(["enqueue", "--queue", "q", "--kind", "k", "--payload", "{}"])
        .env("DATABASE_URL", &db.url)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector.invalid:4317")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("traces are off"), "{stderr}");
    assert_eq!(db.open_jobs().await, 1);
}

/// A script driving a lease through the CLI keeps the job's trace: the
/// grant `claim` prints names its claim span, and a write run with it as
/// TRACEPARENT continues it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_lease_write_continues_its_traceparent() {
    let db = fresh().await;
    let (endpoint, got) = receiver().await;
    let run = |args: &[&str], tp: Option<&str>| {
        let mut c = jobledger(&db.url, &endpoint, args);
        if let Some(tp) = tp {
            c.env("TRACEPARENT", tp);
        }
        // The log's level must not change the trace's shape (debug spans
        // are enabled for the log only).
        c.env("RUST_LOG", "debug");
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let caller = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    run(
        &["enqueue", "--queue", "q", "--kind", "k", "--payload", "{}"],
        Some(&caller),
    );
    let grant = run(
        &["claim", "--queue", "q", "--worker", "sh", "--lease", "60s"],
        Some(&caller),
    );
    let handed = grant["traceparent"]
        .as_str()
        .expect("the grant names its claim span")
        .to_string();
    let (job, epoch, token) = (
        grant["job_id"].as_str().unwrap().to_string(),
        grant["epoch"].to_string(),
        grant["token"].to_string(),
    );
    // A write from a script in no trace at all still lands in the job's.
    run(
        &[
            "heartbeat",
            &job,
            "--epoch",
            &epoch,
            "--token",
            &token,
            "--worker",
            "sh",
        ],
        None,
    );
    let out = run(
        &[
            "complete", &job, "--epoch", &epoch, "--token", &token, "--worker", "sh",
        ],
        Some(&handed),
    );
    assert_eq!(out["outcome"], "committed", "{out}");
    let claim_cmd = got.named("jobledger claim").pop().expect("the command is a span");
    let claim = got.named("jobledger.claim").pop().expect("the claim span");
    assert_eq!(
        claim.parent_span_id, claim_cmd.span_id,
        "the claim is its command's child, whatever RUST_LOG says"
    );
    // Its span is the command's (a trace of the script's own); its event
    // is stamped in the job's trace.
    let (beat,): (Option<String>,) = sqlx::query_as(
        "SELECT trace FROM jobledger.events WHERE job_id = $1::uuid AND type = 'lease_extended'",
    )
    .bind(&job)
    .fetch_one(db.ledger.pool())
    .await
    .unwrap();
    assert!(
        beat.expect("traced").contains(CALLER_TRACE),
        "a write outside any trace is stamped in its job's"
    );
    let complete = got
        .named("jobledger complete")
        .pop()
        .expect("the command is a span");
    assert_eq!(traceparent_parent(&complete), handed, "it continues TRACEPARENT");
    let (written,): (Option<String>,) =
        sqlx::query_as("SELECT trace FROM jobledger.events WHERE job_id = $1::uuid AND type = 'succeeded'")
            .bind(&job)
            .fetch_one(db.ledger.pool())
            .await
            .unwrap();
    let written = written.expect("traced");
    let spans = got.spans();
    let mut up = spans
        .iter()
        .find(|s| traceparent(s) == written)
        .expect("a span the receiver got")
        .clone();
    while up.span_id != complete.span_id {
        up = spans
            .iter()
            .find(|s| s.span_id == up.parent_span_id)
            .cloned()
            .expect("the writer leads up to the command");
    }
}

/// The `traceparent` a span names as its parent.
fn traceparent_parent(s: &Span) -> String {
    format!("00-{}-{}-01", hex(&s.trace_id), hex(&s.parent_span_id))
}

/// A workflow's fan-in continues the workflow's trace, whoever ends the
/// last step (here a worker, in no span of the workflow's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflows_fan_in_joins_its_trace() {
    let db = fresh().await;
    let (endpoint, _got) = receiver().await;
    let spec = serde_json::json!({
        "queue": "q", "name": "wf",
        "steps": [{ "name": "a", "kind": "k" }, { "name": "b", "kind": "k", "after": ["a"] }],
        "finally": { "name": "fin", "kind": "k" }
    });
    let out = jobledger(&db.url, &endpoint, &["workflow", "create", &spec.to_string()])
        .env("TRACEPARENT", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let worker = jobledger(&db.url, &endpoint, &worker_args("echo '{}'"))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    eventually("the workflow ends", || async { db.open_jobs().await == 0 }).await;
    stop(worker);
    let outside = db
        .count(&format!(
            "SELECT count(*) FROM jobledger.events e JOIN jobledger.jobs j USING (job_id) \
             WHERE e.trace IS NULL OR NOT e.trace LIKE '00-{CALLER_TRACE}-%' \
                OR NOT j.traceparent LIKE '00-{CALLER_TRACE}-%'"
        ))
        .await;
    assert_eq!(
        outside, 0,
        "every job and event of the workflow, the fan-in's too, is in its trace"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM jobledger.jobs").await,
        4,
        "parent, two steps, fan-in"
    );
}

/// Only a W3C trace context can be stored as one: the relay sends
/// `events.trace` on as a header (the check holds even with the log's
/// triggers off).
#[tokio::test]
async fn only_a_trace_context_is_stored_as_one() {
    let db = fresh().await;
    let job = db.enqueue(None, serde_json::json!({})).await;
    let mut conn = db.conn().await;
    let err = sqlx::raw_sql(&format!(
        "BEGIN; SET LOCAL session_replication_role = replica; \
         INSERT INTO jobledger.events (job_id, version, type, from_state, to_state, reason, actor, epoch, token, \
           attempt, run, data, recorded_at, prev_hash, hash, trace) \
         SELECT job_id, 2, type, from_state, to_state, reason, actor, epoch, token, attempt, run, data, \
           recorded_at, hash, 'h', 'evil\r\nheader' FROM jobledger.events WHERE job_id = '{}'; COMMIT;",
        job.job_id
    ))
    .execute(&mut conn)
    .await
    .expect_err("refused");
    let code = err
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.to_string());
    assert_eq!(code.as_deref(), Some("23514"), "{err}");
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut conn).await;
    // Near misses of the shape: short ids, a dash moved, upper case, a
    // fourth group, another version, an extra character.
    for bad in [
        "00-1-1-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-701",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
        "00-4bf92f3577b34da6-3ce929d0e0e4736-00f067aa0ba902b7-01",
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-011",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
    ] {
        let err = sqlx::raw_sql(&format!(
            "BEGIN; SET LOCAL session_replication_role = replica; \
             UPDATE jobledger.jobs SET traceparent = '{bad}'; COMMIT;"
        ))
        .execute(&mut conn)
        .await
        .expect_err(bad);
        assert!(err.to_string().contains("jobs_traceparent_w3c"), "{bad}: {err}");
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut conn).await;
    }
    sqlx::raw_sql(
        "BEGIN; SET LOCAL session_replication_role = replica; \
         UPDATE jobledger.jobs SET traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'; COMMIT;",
    )
    .execute(&mut conn)
    .await
    .expect("a W3C trace context is stored");
}
