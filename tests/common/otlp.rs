//! Traces in tests: an in-process OTLP/gRPC receiver (a tonic server built
//! from the OTLP protobuf crate), readers of the spans it got, and the binary
//! started with traces exported to it (tests/traces.rs, tests/traces_writes.rs).

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

/// What the receiver was sent, every span of every process.
#[derive(Clone, Default)]
pub struct Received(Arc<Mutex<Vec<Span>>>);

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
    pub fn spans(&self) -> Vec<Span> {
        self.0.lock().unwrap().clone()
    }
    pub fn named(&self, name: &str) -> Vec<Span> {
        self.spans().into_iter().filter(|s| s.name == name).collect()
    }
}

/// An OTLP/gRPC receiver on a loopback port: its endpoint, and what it got.
pub async fn receiver() -> (String, Received) {
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

pub fn hex(b: &[u8]) -> String {
    hex::encode(b)
}

pub fn attr(s: &Span, key: &str) -> Option<String> {
    s.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(v) => Some(v.clone()),
            AnyValue::IntValue(v) => Some(v.to_string()),
            _ => None,
        })
}

pub fn traceparent(s: &Span) -> String {
    format!("00-{}-{}-01", hex(&s.trace_id), hex(&s.span_id))
}

/// The binary with traces exported to `endpoint` (quickly: 50 ms batches).
pub fn jobledger(db_url: &str, endpoint: &str, args: &[&str]) -> Command {
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
pub fn worker_args(script: &str) -> Vec<&str> {
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

/// `jobledger enqueue` (queue `q`) from a script in the caller's trace
/// (`TRACEPARENT` names `CALLER_TRACE`/`CALLER_SPAN`): the job's id.
pub fn enqueue_in_callers_trace(db_url: &str, endpoint: &str) -> uuid::Uuid {
    let out = jobledger(
        db_url,
        endpoint,
        &["enqueue", "--queue", "q", "--kind", "k", "--payload", "{}"],
    )
    .env("TRACEPARENT", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let enq: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    enq["job_id"].as_str().unwrap().parse().unwrap()
}

/// SIGTERM, then the exit: a service drains and flushes its spans.
pub fn stop(mut child: Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let out = child.wait().unwrap();
    assert!(out.success(), "a service stopped by SIGTERM exits 0: {out:?}");
}

/// The caller's trace: a service that enqueues from inside its own span.
pub const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
pub const CALLER_SPAN: &str = "00f067aa0ba902b7";
/// Another service's trace.
pub const OTHER_TRACE: &str = "5ce0e9a5600d4a23a97f0c1a2b3c4d5e";

// Multi-threaded: the receiver answers while the test waits for a child.

/// The `traceparent` a span names as its parent.
pub fn traceparent_parent(s: &Span) -> String {
    format!("00-{}-{}-01", hex(&s.trace_id), hex(&s.parent_span_id))
}

/// The `traceparent` stored on the one job of `queue`; it must be there.
pub async fn job_traceparent(pool: &sqlx::PgPool, queue: &str) -> String {
    let (tp,): (Option<String>,) = sqlx::query_as("SELECT traceparent FROM jobledger.jobs WHERE queue = $1")
        .bind(queue)
        .fetch_one(pool)
        .await
        .unwrap();
    tp.expect("traced")
}
