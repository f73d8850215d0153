//! The `jobledger` binary: JSON lines on stdout, messages on stderr.
#![forbid(unsafe_code)]

mod cli;
mod serve;
mod tools;

use clap::Parser;
use tracing_subscriber::EnvFilter;

/// mimalloc: the offline audit allocates on its parsing thread and frees on
/// the auditing one, which glibc's malloc serialised on an arena lock
/// (docs/benchmarks.md, issue 14).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")))
        .init();
    let args = cli::args::Cli::parse();
    let code = match cli::run::run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            cli::output::error_code(&e)
        }
    };
    std::process::exit(code);
}
