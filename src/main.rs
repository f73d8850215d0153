//! The `jobledger` binary: JSON lines on stdout, messages on stderr.
#![forbid(unsafe_code)]

mod cli;
mod serve;
mod tools;

use clap::Parser;
use tracing_subscriber::filter::{DynFilterFn, FilterExt, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// mimalloc: the offline audit allocates on its parsing thread and frees on
/// the auditing one, which glibc's malloc serialised on an arena lock
/// (docs/benchmarks.md, issue 14).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let args = cli::args::Cli::parse();
    let endpoint = args.otlp_endpoint.as_deref().filter(|e| !e.is_empty());
    // The traces bench measures its own pipeline, whatever the environment says.
    let endpoint = endpoint.filter(|_| !tools::bench_traces::wanted(&args.command));
    let otlp = match endpoint {
        None if tools::bench_traces::wanted(&args.command) => match tools::bench_traces::pipeline() {
            Ok(o) => Some(o),
            Err(e) => {
                eprintln!("error: bench --only traces: {e:#}");
                std::process::exit(cli::output::FAILURE);
            }
        },
        None => None,
        // A tracing setting never stops the work (an `https://` endpoint
        // needs TLS, which this build lacks): say why, and run untraced.
        Some(endpoint) => match jobledger::telemetry::Otlp::install(endpoint) {
            Ok(o) => Some(o),
            Err(e) => {
                eprintln!("warning: OTLP endpoint {endpoint} (--otlp-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT): {e}; traces are off");
                None
            }
        },
    };
    init_logs(otlp.as_ref());
    let code = match cli::run::run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            cli::output::error_code(&e)
        }
    };
    if let Some(o) = otlp {
        // Exports what is buffered; blocking.
        let _ = tokio::task::spawn_blocking(move || o.shutdown()).await;
    }
    std::process::exit(code);
}

/// Messages on stderr as RUST_LOG says (warnings by default). With traces
/// on, jobledger's own spans also go to OpenTelemetry, whatever RUST_LOG
/// says: each layer has its own filter, so the log's level never hides a
/// span and a library's chatter never becomes one.
fn init_logs(otlp: Option<&jobledger::telemetry::Otlp>) {
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")));
    let spans = otlp.map(|o| {
        let ours = Targets::new()
            .with_target("jobledger", LevelFilter::INFO)
            .with_target("jobledger_consumers", LevelFilter::INFO);
        // `telemetry::enabled()` also switches the layer (shutdown, and the
        // bench's rounds off and on). Asked per span: a plain `filter_fn` is
        // cached per call site, and the first answer would hold for good.
        let switch = DynFilterFn::new(|_, _| jobledger::telemetry::enabled())
            .with_callsite_filter(|_| tracing::subscriber::Interest::sometimes());
        o.layer().with_filter(ours.and(switch))
    });
    tracing_subscriber::registry().with(logs).with(spans).init();
}
