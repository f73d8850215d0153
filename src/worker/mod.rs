//! The worker runtime: register async handlers per job kind; the runtime
//! claims in batches (woken by LISTEN/NOTIFY, polling as the fallback),
//! runs handlers under a concurrency limit, keeps their leases alive with
//! batched fenced heartbeats, writes their outcomes through the fence
//! (completions batched), sweeps expired leases (one active sweeper), and
//! shuts down gracefully.

mod background;
mod committer;
pub mod exec;
mod exec_procs;
mod handler;
pub mod metrics;
mod pace;
mod runtime;
mod scheduler;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use handler::{BoxFuture, HandlerFn, HandlerOutcome, JobContext, Stop, StopReason};
pub use runtime::Hooks;

use crate::domain::Policy;
use crate::ledger::{Ledger, LedgerError, LedgerResult};

/// `host:pid:boot`: specific enough that two processes on one host, or a
/// restarted process, never renew each other's leases.
pub fn process_holder_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let boot = uuid::Uuid::new_v4().simple().to_string();
        format!("{host}:{}:{}", std::process::id(), &boot[..8])
    })
}

/// Counters of one worker, readable while it runs.
#[derive(Default, Debug)]
pub struct Counters {
    pub claimed: AtomicU64,
    pub takeovers: AtomicU64,
    pub succeeded: AtomicU64,
    pub retried: AtomicU64,
    pub dead: AtomicU64,
    pub cancelled: AtomicU64,
    pub submitted: AtomicU64,
    pub snoozed: AtomicU64,
    pub released: AtomicU64,
    /// Outcomes that wrote nothing because a newer token owns the job.
    pub lost_leases: AtomicU64,
    pub errors: AtomicU64,
    /// Sweeps this worker ran as the active sweeper.
    pub sweeps: AtomicU64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WorkerReport {
    pub claimed: u64,
    pub takeovers: u64,
    pub succeeded: u64,
    pub retried: u64,
    pub dead: u64,
    pub cancelled: u64,
    pub submitted: u64,
    pub snoozed: u64,
    pub released: u64,
    pub lost_leases: u64,
    pub errors: u64,
    pub sweeps: u64,
}

impl Counters {
    pub fn report(&self) -> WorkerReport {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        WorkerReport {
            claimed: g(&self.claimed),
            takeovers: g(&self.takeovers),
            succeeded: g(&self.succeeded),
            retried: g(&self.retried),
            dead: g(&self.dead),
            cancelled: g(&self.cancelled),
            submitted: g(&self.submitted),
            snoozed: g(&self.snoozed),
            released: g(&self.released),
            lost_leases: g(&self.lost_leases),
            errors: g(&self.errors),
            sweeps: g(&self.sweeps),
        }
    }
}

pub(crate) struct Config {
    pub holder: String,
    pub queues: Vec<String>,
    pub handlers: HashMap<String, HandlerFn>,
    pub fallback: Option<HandlerFn>,
    pub policies: HashMap<String, Policy>,
    pub concurrency: usize,
    pub prefetch: pace::Prefetch,
    pub lease: Duration,
    pub heartbeat: Duration,
    pub poll: Duration,
    pub drain_timeout: Duration,
    pub sweep_every: Option<Duration>,
    pub schedule_every: Option<Duration>,
    pub complete_batch: usize,
    pub hooks: Hooks,
}

pub struct WorkerBuilder {
    ledger: Ledger,
    name: String,
    cfg: Config,
}

impl WorkerBuilder {
    /// A name for this worker within the process (appears in its holder id).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }
    pub fn queue(mut self, queue: &str) -> Self {
        self.cfg.queues.push(queue.to_string());
        self
    }
    /// The handler of one job kind.
    pub fn handler<F, Fut>(mut self, kind: &str, f: F) -> Self
    where
        F: Fn(JobContext) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = HandlerOutcome> + Send + 'static,
    {
        let f: HandlerFn = Arc::new(move |ctx| Box::pin(f(ctx)));
        self.cfg.handlers.insert(kind.to_string(), f);
        self
    }
    pub fn handler_fn(mut self, kind: &str, f: HandlerFn) -> Self {
        self.cfg.handlers.insert(kind.to_string(), f);
        self
    }
    /// One handler for every kind without a handler of its own.
    pub fn any_kind(mut self, f: HandlerFn) -> Self {
        self.cfg.fallback = Some(f);
        self
    }
    /// The policy new jobs of `kind` get (registered in the database at start).
    pub fn policy(mut self, kind: &str, policy: Policy) -> Self {
        self.cfg.policies.insert(kind.to_string(), policy);
        self
    }
    /// Handlers running at once.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.cfg.concurrency = n.max(1);
        self
    }
    /// Jobs claimed ahead of a free slot (their leases are kept alive and
    /// given back at shutdown if they never start), fixed at `n`. 0 claims
    /// only for free slots. Without it the worker follows its handlers'
    /// pace: as many as its slots start within 50 ms at their recent run
    /// time, at least the concurrency and at most 256 (`worker::pace`).
    pub fn prefetch(mut self, n: usize) -> Self {
        self.cfg.prefetch = pace::Prefetch::Fixed(n);
        self
    }
    pub fn lease(mut self, d: Duration) -> Self {
        self.cfg.lease = d;
        self
    }
    pub fn heartbeat_every(mut self, d: Duration) -> Self {
        self.cfg.heartbeat = d;
        self
    }
    pub fn poll_every(mut self, d: Duration) -> Self {
        self.cfg.poll = d;
        self
    }
    /// How long running handlers may take to finish after shutdown begins.
    pub fn drain_timeout(mut self, d: Duration) -> Self {
        self.cfg.drain_timeout = d;
        self
    }
    /// Sweep interval; `None` runs no sweeper in this worker.
    pub fn sweeper(mut self, every: Option<Duration>) -> Self {
        self.cfg.sweep_every = every;
        self
    }
    /// Scheduler tick; `None` runs no scheduler in this worker (one worker
    /// process at a time holds the scheduler lease and fires schedules).
    pub fn scheduler(mut self, every: Option<Duration>) -> Self {
        self.cfg.schedule_every = every;
        self
    }
    pub fn complete_batch(mut self, n: usize) -> Self {
        self.cfg.complete_batch = n.max(1);
        self
    }
    /// Test hooks between steps.
    pub fn hooks(mut self, hooks: Hooks) -> Self {
        self.cfg.hooks = hooks;
        self
    }

    pub fn build(mut self) -> LedgerResult<Worker> {
        if self.cfg.queues.is_empty() {
            return Err(LedgerError::BadInput("a worker needs at least one queue".into()));
        }
        // The same bounds every claim checks: refuse now, not at each poll.
        self.ledger.limits().lease(self.cfg.lease)?;
        if self.cfg.heartbeat >= self.cfg.lease {
            return Err(LedgerError::BadInput(
                "the heartbeat interval must be shorter than the lease".into(),
            ));
        }
        self.cfg.holder = format!("{}:{}", process_holder_id(), self.name);
        Ok(Worker {
            ledger: self.ledger,
            cfg: Arc::new(self.cfg),
            counters: Arc::new(Counters::default()),
        })
    }
}

#[derive(Clone)]
pub struct Worker {
    ledger: Ledger,
    cfg: Arc<Config>,
    counters: Arc<Counters>,
}

impl Worker {
    pub fn builder(ledger: Ledger) -> WorkerBuilder {
        WorkerBuilder {
            ledger,
            name: "worker".into(),
            cfg: Config {
                holder: String::new(),
                queues: vec![],
                handlers: HashMap::new(),
                fallback: None,
                policies: HashMap::new(),
                concurrency: 16,
                prefetch: pace::Prefetch::Auto,
                lease: Duration::from_secs(30),
                heartbeat: Duration::from_secs(10),
                poll: Duration::from_millis(500),
                drain_timeout: Duration::from_secs(30),
                sweep_every: Some(Duration::from_secs(1)),
                schedule_every: Some(Duration::from_secs(1)),
                complete_batch: 256,
                hooks: Hooks::default(),
            },
        }
    }

    /// The holder id written on this worker's leases.
    pub fn holder(&self) -> &str {
        &self.cfg.holder
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Runs until `shutdown` is cancelled, then drains. Cancelling twice, or
    /// after the worker stopped, is harmless.
    pub async fn run(&self, shutdown: tokio_util::sync::CancellationToken) -> LedgerResult<WorkerReport> {
        runtime::run(
            self.ledger.clone(),
            self.cfg.clone(),
            self.counters.clone(),
            shutdown,
        )
        .await
    }
}

/// Cancels `token` on SIGINT or SIGTERM (a second signal is harmless).
pub fn cancel_on_signals(token: tokio_util::sync::CancellationToken) {
    tokio::spawn(async move {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("cannot install SIGTERM handler: {e}");
                return;
            }
        };
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("shutdown signal received; draining");
            token.cancel();
        }
    });
}
