//! The ledger service: what a Rust service calls. Every write goes through
//! `engine`, which runs the pure state machine under the job's row lock.

mod admission;
mod combine;
mod context;
mod engine;
mod enqueue;
mod error;
mod follow;
mod lease;
pub mod narrative;
mod ops;
pub mod queues;
pub mod schedules;
pub mod search;
pub mod timeline;
pub mod tokens;
mod validate;
mod verdicts;
mod verify;
mod workflow;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::str::FromStr;
use std::time::Duration;

pub use engine::WriteResult;
pub use enqueue::Enqueued;
pub use error::{LedgerError, LedgerResult};
pub use lease::Lease;
pub use ops::{Found, HistoryEntry, LogEntry, Overview};
pub use validate::{Limits, MAX_JSON_DEPTH};
pub use verify::{Problem, VerifyReport};
pub use workflow::{Created as WorkflowCreated, StepView, WorkflowView};

use crate::store::schema;

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/jobledger";

#[derive(Clone, Debug)]
pub struct Ledger {
    pool: PgPool,
    limits: Limits,
    hooks: LedgerHooks,
    /// Per limited queue, the key the last limited claim's walk over keys
    /// ended at: the next walk starts after it (ledger::admission).
    key_cursors: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>,
    /// The last enqueue context read, for single enqueues (ledger::context).
    context: context::ContextCache,
    /// Single enqueues waiting to share a statement (ledger::combine).
    combiner: std::sync::Arc<combine::Combiner>,
}

/// Test hooks: gates between the steps of a write, so tests can force an
/// interleaving without sleeps. A shared single enqueue runs them on its
/// shared task (ledger::combine): a hook must not make a single enqueue
/// without a key through its own ledger, which would queue behind it.
#[derive(Clone, Default)]
#[allow(clippy::type_complexity)]
pub struct LedgerHooks {
    /// Runs after an enqueue drew its epochs, before it inserts the jobs.
    pub after_epochs: Option<std::sync::Arc<dyn Fn() -> crate::worker::BoxFuture<()> + Send + Sync>>,
    /// Runs after a single enqueue's insert committed, before the wake-up
    /// it sends after the commit (ledger::context).
    pub before_wake: Option<std::sync::Arc<dyn Fn() -> crate::worker::BoxFuture<()> + Send + Sync>>,
}

impl std::fmt::Debug for LedgerHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerHooks")
            .field("after_epochs", &self.after_epochs.is_some())
            .field("before_wake", &self.before_wake.is_some())
            .finish()
    }
}

impl Ledger {
    pub fn new(pool: PgPool) -> Self {
        Ledger {
            context: context::ContextCache::for_pool(pool.clone()),
            pool,
            limits: Limits::default(),
            hooks: LedgerHooks::default(),
            key_cursors: Default::default(),
            combiner: Default::default(),
        }
    }

    /// Test hooks between the steps of a write.
    pub fn with_hooks(mut self, hooks: LedgerHooks) -> Self {
        self.hooks = hooks;
        // A shared insert runs with its starter's hooks: hooked calls share
        // with hooked clones only.
        self.combiner = Default::default();
        self
    }

    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Connects a pool. Fails fast (a few seconds) when nothing answers, so a
    /// CLI call against a dead database says so instead of hanging.
    pub async fn connect(url: &str, max_connections: u32) -> LedgerResult<Self> {
        let opts = connect_options(url)?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(opts)
            .await?;
        Ok(Ledger::new(pool))
    }

    /// Creates the database if missing, then connects and applies migrations.
    pub async fn connect_and_migrate(url: &str, max_connections: u32) -> LedgerResult<Self> {
        schema::create_database_if_missing(&connect_options(url)?).await?;
        let ledger = Ledger::connect(url, max_connections).await?;
        ledger.migrate().await?;
        Ok(ledger)
    }

    pub async fn migrate(&self) -> LedgerResult<()> {
        schema::migrate(&self.pool).await?;
        Ok(())
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// For tests: moves the clock reading single enqueues remember
    /// (ledger::context) by `by`, as a stepped or drifting clock would.
    #[doc(hidden)]
    pub fn shift_remembered_clock(&self, by: chrono::TimeDelta) {
        self.context.shift(by);
    }

    /// For tests: remembered enqueue contexts are used for `d` (instead of
    /// 500 ms), so a test takes the remembered path however slow it runs.
    #[doc(hidden)]
    pub fn remember_context_for(mut self, d: Duration) -> Self {
        self.context = self.context.fresh_for_testing(d);
        self.combiner = Default::default();
        self
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }
}

pub fn connect_options(url: &str) -> LedgerResult<PgConnectOptions> {
    PgConnectOptions::from_str(url).map_err(|e| LedgerError::BadInput(format!("database url: {e}")))
}
