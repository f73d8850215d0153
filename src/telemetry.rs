//! Traces that follow a job (issue 16): OpenTelemetry through
//! `tracing-opentelemetry` and the OTLP exporter, off unless an endpoint is
//! given (docs/tracing.md).
//!
//! The job's trace is the trace of the span that enqueued it: its W3C
//! `traceparent` is kept in the `enqueued` event (under the hash) and on the
//! job's row. The claim, the handler, every fenced write, the relay's
//! publish and a `FencedConsumer`'s apply are spans of that trace.
//!
//! Sequential work (an enqueue, a handler, one write) is a `tracing` span.
//! Work done for many jobs at once (a claim, a batch of completions, a
//! relay batch) is one `ItemSpan` per job, built with OpenTelemetry's own API
//! so each starts and ends when the shared statement did and has its own
//! job's parent.
//!
//! Off means off: without an endpoint no layer is installed, `enabled()` is
//! false, and every helper here returns at its first line.

use opentelemetry::trace::{Span as _, SpanBuilder, Tracer as _, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use uuid::Uuid;

pub use jobledger_consumers::trace::{
    adopt, context_of, current, traceparent_of, traceparent_of_span, TRACEPARENT,
};

/// The instrumentation scope of every span jobledger makes.
pub const SCOPE: &str = "jobledger";

static ON: AtomicBool = AtomicBool::new(false);

/// Whether this process exports traces. `Otlp::install` sets it; a program
/// embedding the library with its own OpenTelemetry pipeline sets it with
/// `set_enabled` (and registers its provider as the global one).
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

pub fn set_enabled(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

tokio::task_local! {
    /// Per job, the span a batched write runs under (`Spans::around`).
    static WRITES: HashMap<Uuid, String>;
}

/// The current span's `traceparent`, when this process traces.
pub fn here() -> Option<String> {
    if !enabled() {
        return None;
    }
    current()
}

/// The one rule for where work on a job hangs in its trace: under the
/// current span when that span is in the job's trace (a handler, a request
/// that continued the job's span), else under the job's own trace context
/// (a sweep, a remote worker's request in a trace of its own, a batch of
/// several jobs' writes), else under whatever span is current.
pub(crate) fn parent_for(job_trace: Option<&str>) -> Option<String> {
    let here = here();
    match (here, job_trace) {
        (Some(h), Some(j)) if h.get(3..35) == j.get(3..35) => Some(h),
        (_, Some(j)) if enabled() => Some(j.to_string()),
        (h, _) => h,
    }
}

/// Places `span` (not yet entered) in a job's trace by `parent_for`: the
/// span of a single write or of work the ledger does for the job itself.
pub(crate) fn place_for_job(span: &tracing::Span, job_trace: Option<&str>) {
    adopt(span, parent_for(job_trace).as_deref());
}

/// The trace context an event of a job written now is stamped with: its
/// job's span in a batched write (`Spans::around`), else `parent_for`.
pub(crate) fn write_trace(job_id: Uuid, job_trace: Option<&str>) -> Option<String> {
    if !enabled() {
        return None;
    }
    WRITES
        .try_with(|m| m.get(&job_id).cloned())
        .ok()
        .flatten()
        .or_else(|| parent_for(job_trace))
}

/// The tracer of the per-job spans, taken from the global provider once
/// (`Otlp::install` registers it before tracing is turned on).
fn tracer() -> &'static opentelemetry::global::BoxedTracer {
    static TRACER: std::sync::OnceLock<opentelemetry::global::BoxedTracer> = std::sync::OnceLock::new();
    TRACER.get_or_init(|| opentelemetry::global::tracer(SCOPE))
}

/// One job's span in work done for many jobs at once, with its own
/// `traceparent` (formatted once). Nothing when tracing is off; ends when
/// dropped (or at `end_at`).
pub struct ItemSpan(Option<(opentelemetry::global::BoxedSpan, String)>);

impl ItemSpan {
    /// No span (tracing off, or nothing to continue).
    pub fn none() -> Self {
        ItemSpan(None)
    }

    /// A span from `start` under `parent` (a `traceparent`; a new trace
    /// when it names none).
    pub fn start_at(
        name: &'static str,
        parent: Option<&str>,
        start: SystemTime,
        attrs: Vec<KeyValue>,
    ) -> Self {
        if !enabled() {
            return ItemSpan(None);
        }
        let builder = SpanBuilder::from_name(name)
            .with_start_time(start)
            .with_attributes(attrs);
        let cx = parent.and_then(context_of).unwrap_or_default();
        let span = tracer().build_with_context(builder, &cx);
        match traceparent_of_span(span.span_context()) {
            Some(tp) => ItemSpan(Some((span, tp))),
            None => ItemSpan(None),
        }
    }

    pub fn start(name: &'static str, parent: Option<&str>, attrs: Vec<KeyValue>) -> Self {
        Self::start_at(name, parent, SystemTime::now(), attrs)
    }

    /// The span's own `traceparent`: what its children name as parent.
    pub fn traceparent(&self) -> Option<&str> {
        self.0.as_ref().map(|(_, tp)| tp.as_str())
    }

    pub fn end_at(mut self, end: SystemTime) {
        if let Some((mut s, _)) = self.0.take() {
            s.end_with_timestamp(end);
        }
    }
}

/// One `ItemSpan` per job, for work done for many jobs in one statement.
#[derive(Default)]
pub(crate) struct Spans(HashMap<Uuid, ItemSpan>);

impl Spans {
    /// From `start`, each under its job's `parent`; nothing when off.
    pub(crate) fn start(
        name: &'static str,
        start: SystemTime,
        jobs: impl IntoIterator<Item = (Uuid, Option<String>, Vec<KeyValue>)>,
    ) -> Self {
        if !enabled() {
            return Spans::default();
        }
        Spans(
            jobs.into_iter()
                .map(|(id, parent, attrs)| (id, ItemSpan::start_at(name, parent.as_deref(), start, attrs)))
                .collect(),
        )
    }

    pub(crate) fn trace(&self, job_id: Uuid) -> Option<String> {
        self.0
            .get(&job_id)
            .and_then(ItemSpan::traceparent)
            .map(str::to_owned)
    }

    /// Runs `f` with each job's writes stamped with its own span: one
    /// statement writes many jobs' events, and each names its own job's.
    pub(crate) async fn around<F: std::future::Future>(&self, f: F) -> F::Output {
        if self.0.is_empty() {
            return f.await;
        }
        let traces = self
            .0
            .iter()
            .filter_map(|(id, s)| Some((*id, s.traceparent()?.to_owned())))
            .collect();
        WRITES.scope(traces, f).await
    }

    pub(crate) fn end(self) {
        let now = SystemTime::now();
        for s in self.0.into_values() {
            s.end_at(now);
        }
    }
}

/// The attributes every per-job span carries.
pub(crate) fn job_attrs(job_id: Uuid, epoch: i64, token: i64) -> Vec<KeyValue> {
    vec![
        KeyValue::new("job_id", job_id.to_string()),
        KeyValue::new("epoch", epoch),
        KeyValue::new("token", token),
    ]
}

/// The SDK's defaults (a queue of 2,048 spans, exported every 5 s) drop
/// spans past about 400 a second, and one worker makes three per job at
/// thousands of jobs a second. A queue of 65,536 exported every second
/// keeps them; `OTEL_BSP_*` still decide when set.
fn batch_config() -> opentelemetry_sdk::trace::BatchConfig {
    let mut b = BatchConfigBuilder::default();
    if std::env::var_os("OTEL_BSP_MAX_QUEUE_SIZE").is_none() {
        b = b.with_max_queue_size(65_536);
    }
    if std::env::var_os("OTEL_BSP_MAX_EXPORT_BATCH_SIZE").is_none() {
        b = b.with_max_export_batch_size(2_048);
    }
    if std::env::var_os("OTEL_BSP_SCHEDULE_DELAY").is_none() {
        b = b.with_scheduled_delay(Duration::from_secs(1));
    }
    b.build()
}

static PROVIDER: std::sync::OnceLock<SdkTracerProvider> = std::sync::OnceLock::new();

/// Exports what the installed pipeline holds now (the bench checks its
/// counts after a round). Blocking.
pub fn flush() {
    if let Some(p) = PROVIDER.get() {
        let _ = p.force_flush();
    }
}

/// The OTLP pipeline of the binary: a batch processor exporting over gRPC.
pub struct Otlp {
    provider: SdkTracerProvider,
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP exporter: {0}")]
    Exporter(String),
}

impl Otlp {
    /// Builds the pipeline for `endpoint` (e.g. `http://127.0.0.1:4317`),
    /// registers it as the global provider and turns tracing on. The
    /// exporter's gRPC client lives on a runtime of its own
    /// (`export_runtime`), not on the caller's.
    pub fn install(endpoint: &str) -> Result<Otlp, TelemetryError> {
        use opentelemetry_otlp::WithExportConfig;
        let rt = export_runtime().map_err(|e| TelemetryError::Exporter(e.to_string()))?;
        // Built inside it: the channel spawns its connection task there.
        let exporter = {
            let _on = rt.enter();
            opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(Duration::from_secs(5))
                .build()
                .map_err(|e| TelemetryError::Exporter(e.to_string()))?
        };
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| SCOPE.into()))
            .build();
        let exporter = OnRuntime {
            inner: Arc::new(exporter),
            rt,
        };
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch_config())
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        opentelemetry::global::set_tracer_provider(provider.clone());
        let _ = PROVIDER.set(provider.clone());
        set_enabled(true);
        Ok(Otlp { provider })
    }

    /// The `tracing` layer that turns spans into OpenTelemetry spans.
    pub fn layer<S>(
        &self,
    ) -> tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        // A span is named by what it does and carries the job's id, token
        // and queue. The layer's defaults would add, to every span, its
        // source file and line, thread, target and busy/idle times, and
        // make the OpenTelemetry context current on every poll of a traced
        // future: a third of what tracing cost W3 in this process, for
        // attributes nobody reads a job's trace for (docs/tracing.md).
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer(SCOPE))
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_context_activation(false)
    }

    /// Exports what is still buffered and stops. Blocks until the export
    /// runtime has sent it: call it off an async runtime's worker threads
    /// (`spawn_blocking`).
    pub fn shutdown(&self) {
        set_enabled(false);
        if let Err(e) = self.provider.shutdown() {
            eprintln!("warning: traces not all exported: {e}");
        }
    }
}

/// A one-thread runtime on an OS thread of its own ("otlp-export") that
/// runs every export: encoding a batch and sending it over gRPC. On the
/// jobs' runtime an export of thousands of spans held a worker thread for
/// its whole encoding, delaying the claims and completions queued behind
/// it; here the OS shares the cores between it and them. One per process,
/// started by the first `Otlp::install` and kept for the process's life
/// (an install that then fails leaves it idle).
fn export_runtime() -> std::io::Result<tokio::runtime::Handle> {
    // Held while the thread starts, so two first installs start one.
    static RT: std::sync::Mutex<Option<tokio::runtime::Handle>> = std::sync::Mutex::new(None);
    let mut rt = RT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(h) = rt.as_ref() {
        return Ok(h.clone());
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("otlp-export".into())
        .spawn(
            move || match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => {
                    let _ = tx.send(Ok(rt.handle().clone()));
                    rt.block_on(std::future::pending::<()>());
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            },
        )?;
    let h = rx.recv().map_err(std::io::Error::other)??;
    *rt = Some(h.clone());
    Ok(h)
}

/// The stable batch processor exports from its own OS thread, where the
/// tonic client finds no Tokio reactor (a known panic of the 0.28+ SDKs).
/// Each export is run as a task on the export runtime, which built the
/// exporter.
#[derive(Debug)]
struct OnRuntime<E> {
    inner: Arc<E>,
    rt: tokio::runtime::Handle,
}

impl<E: SpanExporter + 'static> SpanExporter for OnRuntime<E> {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let inner = self.inner.clone();
        let task = self.rt.spawn(async move { inner.export(batch).await });
        async move {
            task.await
                .unwrap_or_else(|e| Err(OTelSdkError::InternalFailure(e.to_string())))
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let _on = self.rt.enter();
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        let _on = self.rt.enter();
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        // Called once while the provider is built, before any export holds
        // a clone of the exporter.
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_means_nothing_is_made() {
        set_enabled(false);
        let s = ItemSpan::start(
            "x",
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            vec![],
        );
        assert!(s.traceparent().is_none());
        assert!(write_trace(
            Uuid::nil(),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        )
        .is_none());
    }
}
