//! The command line contract (see README "CLI").

use clap::{Args, Parser, Subcommand};
use uuid::Uuid;

pub use crate::cli::admin_args::{QueueCmd, TokenCmd, Who};
use crate::cli::parse;
use jobledger::domain::{ErrorClass, ExpiryPolicy, ReceiptPolicy, ReceiptStatus};

#[derive(Parser, Debug)]
#[command(
    name = "jobledger",
    version,
    about = "An event-sourced ledger for background jobs"
)]
pub struct Cli {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL", default_value = jobledger::ledger::DEFAULT_DATABASE_URL, global = true)]
    pub database_url: String,
    /// Largest accepted payload/result/observation, canonical JSON bytes.
    #[arg(long, env = "JOBLEDGER_MAX_PAYLOAD", default_value_t = 1024 * 1024, global = true)]
    pub max_payload_bytes: usize,
    /// Export traces over OTLP/gRPC to this collector (e.g.
    /// http://127.0.0.1:4317); without it nothing is traced.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", global = true)]
    pub otlp_endpoint: Option<String>,
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum WorkflowCmd {
    /// Creates a workflow from its spec: inline JSON, @FILE or @- (stdin).
    Create { spec: String },
    /// The parent and each step's state, with what a waiting step waits for.
    Show { parent: Uuid },
    /// Cancels every open step (waiting ones first) and records it on the parent.
    Cancel {
        parent: Uuid,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Lets a step held by its `hold` policy run after all.
    ReleaseHold {
        job: Uuid,
        #[arg(long)]
        operator: String,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Args, Debug, Clone)]
pub struct FenceArgs {
    /// Job id.
    pub job: Uuid,
    #[arg(long)]
    pub epoch: i64,
    #[arg(long)]
    pub token: i64,
    /// Who is writing (recorded as the event's actor).
    #[arg(long, default_value = "cli")]
    pub worker: String,
}

/// Per-job policy. Without any of these flags the job gets the policy a
/// worker registered for its (queue, kind), or the defaults; with any of
/// them, the flags given plus the defaults for the rest.
#[derive(Args, Debug, Clone, Default)]
pub struct PolicyArgs {
    /// Attempts within a run [default: 5].
    #[arg(long)]
    pub max_attempts: Option<i32>,
    /// [default: 1s]
    #[arg(long, value_parser = parse::duration)]
    pub backoff_base: Option<std::time::Duration>,
    /// [default: 5m]
    #[arg(long, value_parser = parse::duration)]
    pub backoff_cap: Option<std::time::Duration>,
    /// [default: reconcile]
    #[arg(long, value_parser = parse::expiry_policy)]
    pub on_lease_expiry: Option<ExpiryPolicy>,
    /// [default: 1h]
    #[arg(long, value_parser = parse::duration)]
    pub receipt_timeout: Option<std::time::Duration>,
    /// [default: dead]
    #[arg(long, value_parser = parse::receipt_policy)]
    pub on_receipt_timeout: Option<ReceiptPolicy>,
}

impl PolicyArgs {
    pub fn to_policy(&self) -> Option<jobledger::domain::Policy> {
        let ms = |d: std::time::Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let given = self.max_attempts.is_some()
            || self.backoff_base.is_some()
            || self.backoff_cap.is_some()
            || self.on_lease_expiry.is_some()
            || self.receipt_timeout.is_some()
            || self.on_receipt_timeout.is_some();
        let d = jobledger::domain::Policy::default();
        given.then(|| jobledger::domain::Policy {
            max_attempts: self.max_attempts.unwrap_or(d.max_attempts),
            backoff_base_ms: self.backoff_base.map(ms).unwrap_or(d.backoff_base_ms),
            backoff_cap_ms: self.backoff_cap.map(ms).unwrap_or(d.backoff_cap_ms),
            on_lease_expiry: self.on_lease_expiry.unwrap_or(d.on_lease_expiry),
            receipt_timeout_ms: self.receipt_timeout.map(ms).unwrap_or(d.receipt_timeout_ms),
            on_receipt_timeout: self.on_receipt_timeout.unwrap_or(d.on_receipt_timeout),
        })
    }
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Create the database if missing and apply migrations.
    Migrate,
    /// Enqueue a job (idempotent on --key within the queue).
    Enqueue {
        #[arg(long)]
        queue: String,
        #[arg(long)]
        kind: String,
        #[arg(long)]
        key: Option<String>,
        /// JSON, @FILE or @- (stdin).
        #[arg(long, default_value = "{}")]
        payload: String,
        #[arg(long, value_parser = parse::duration, conflicts_with = "run_at", allow_hyphen_values = true)]
        delay: Option<std::time::Duration>,
        #[arg(long, value_parser = parse::time)]
        run_at: Option<chrono::DateTime<chrono::Utc>>,
        /// Lower runs first.
        #[arg(long, default_value_t = 0)]
        priority: i16,
        #[command(flatten)]
        policy: PolicyArgs,
        /// Jobs of the queue with the same key share a concurrency limit's slots.
        #[arg(long)]
        concurrency_key: Option<String>,
        /// With --key: how long the key names this job; after it, a finished
        /// job gives way to a new lifecycle (docs/admission.md).
        #[arg(long, value_parser = parse::duration, requires = "key")]
        unique_for: Option<std::time::Duration>,
    },
    /// Claim due jobs (and take over expired leases under the reconcile policy).
    Claim {
        #[arg(long)]
        queue: String,
        #[arg(long)]
        worker: String,
        #[arg(long, value_parser = parse::lease, default_value = "30s")]
        lease: std::time::Duration,
        #[arg(long, default_value_t = 1)]
        limit: i64,
    },
    /// Extend the lease.
    Heartbeat {
        #[command(flatten)]
        fence: FenceArgs,
        #[arg(long, value_parser = parse::lease, default_value = "30s")]
        lease: std::time::Duration,
    },
    /// Record step progress (a step boundary).
    Progress {
        #[command(flatten)]
        fence: FenceArgs,
        #[arg(long)]
        step: String,
        #[arg(long, value_parser = parse::lease)]
        lease: Option<std::time::Duration>,
    },
    /// Complete with an optional result.
    Complete {
        #[command(flatten)]
        fence: FenceArgs,
        /// JSON, @FILE or @- (stdin).
        #[arg(long)]
        result: Option<String>,
    },
    /// Report a failure.
    Fail {
        #[command(flatten)]
        fence: FenceArgs,
        #[arg(long, value_parser = parse::error_class)]
        class: ErrorClass,
        #[arg(long)]
        code: String,
        #[arg(long)]
        message: Option<String>,
    },
    /// Submitted outside: wait for a receipt.
    Submit {
        #[command(flatten)]
        fence: FenceArgs,
        #[arg(long)]
        receipt: String,
    },
    /// Confirm a requested cancel at a step boundary.
    ConfirmCancel {
        #[command(flatten)]
        fence: FenceArgs,
    },
    /// Resolve a receipt.
    Receipt {
        job: Uuid,
        #[arg(long)]
        receipt: String,
        #[arg(long, value_parser = parse::receipt_status)]
        status: ReceiptStatus,
    },
    /// Record an observation (any worker, deduplicated by key).
    Observe {
        job: Uuid,
        #[arg(long)]
        key: String,
        /// JSON, @FILE or @- (stdin).
        #[arg(long, default_value = "{}")]
        data: String,
        #[arg(long, requires = "token")]
        epoch: Option<i64>,
        #[arg(long, requires = "epoch")]
        token: Option<i64>,
        #[arg(long, default_value = "cli")]
        worker: String,
    },
    /// Cancel a job (harmless to repeat).
    Cancel {
        job: Uuid,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Operator replay of a dead job, or of a batch by reason code and time range.
    Replay {
        #[arg(required_unless_present = "reason_code", conflicts_with_all = ["reason_code", "since", "until"])]
        job: Option<Uuid>,
        #[arg(long, requires_all = ["since", "until"])]
        reason_code: Option<String>,
        #[arg(long, value_parser = parse::time)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        #[arg(long, value_parser = parse::time)]
        until: Option<chrono::DateTime<chrono::Utc>>,
        #[arg(long)]
        operator: String,
        #[arg(long)]
        reason: String,
    },
    /// An operator's verdict on a dead job or one awaiting a receipt, after
    /// checking the outside world by hand: fenced on the version looked at.
    Resolve {
        job: Uuid,
        /// `succeeded` or `cancelled`.
        #[arg(long = "as", value_parser = ["succeeded", "cancelled"])]
        verdict: String,
        #[arg(long)]
        reason: String,
        /// What was checked, as JSON (`@file` reads a file).
        #[arg(long)]
        evidence: String,
        /// The job's version as the operator saw it (`show` prints it).
        #[arg(long)]
        version: i64,
        #[arg(long)]
        operator: String,
    },
    /// Appends a correction beside the event at log position POSITION (the
    /// event stays; the job's state does not change).
    Annotate {
        job: Uuid,
        #[arg(long)]
        corrects: i64,
        #[arg(long)]
        reason: String,
        #[arg(long)]
        operator: String,
    },
    /// One pass of lease-expiry policies and receipt deadlines.
    Sweep,
    /// Purge terminal jobs older than DUR (tombstones kept, events kept).
    Purge {
        #[arg(long, value_parser = parse::duration)]
        older_than: std::time::Duration,
    },
    /// Show a job's current state (text on a terminal, else JSON).
    Show {
        job: Uuid,
        #[command(flatten)]
        format: super::human::Format,
    },
    /// A job's timeline from the log (text on a terminal, else JSON lines).
    History {
        job: Uuid,
        #[command(flatten)]
        format: super::human::Format,
        /// The story in plain words, with each event's delivery state (as
        /// the console's job page tells it).
        #[arg(long, conflicts_with = "json")]
        story: bool,
    },
    /// The HTTP API (`/v1`, bearer tokens; docs/http.md) until SIGTERM.
    Serve {
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        /// How long open requests may finish after SIGTERM.
        #[arg(long, value_parser = parse::duration, default_value = "10s")]
        drain_timeout: std::time::Duration,
    },
    /// Bearer tokens of the HTTP API: `create --role R --name N` (prints the
    /// token once), `revoke --name N`, `list`.
    Token {
        #[command(subcommand)]
        action: TokenCmd,
    },
    /// Queue controls: `pause Q`, `resume Q` (recorded with who and why;
    /// a paused queue is not claimed, running jobs go on), `list`,
    /// `history Q`.
    Queue {
        #[command(subcommand)]
        action: QueueCmd,
    },
    /// Periodic schedules: `create NAME --cron EXPR --queue Q --kind K`,
    /// `list`, `pause`, `resume`, `delete`, `history` (docs/admission.md).
    Schedule {
        #[command(subcommand)]
        action: crate::cli::schedules::ScheduleCmd,
    },
    /// Workflows: `create @spec.json` (a JSON DAG of steps), `show PARENT`,
    /// `cancel PARENT`, `release-hold STEP` (docs/state-machine.md).
    Workflow {
        #[command(subcommand)]
        action: WorkflowCmd,
    },
    /// Async read models: `list`/`status` them, `run` them until caught up,
    /// `rebuild NAME` from position 0 (progress bar with ETA), or `query NAME`.
    Projections {
        #[arg(value_parser = ["list", "status", "run", "rebuild", "query"])]
        action: String,
        /// The projection to rebuild or query.
        name: Option<String>,
        /// query: one job's rows.
        #[arg(long)]
        job: Option<Uuid>,
        /// query: wait until the projection has applied the event at this
        /// position (every write prints its position), else answer pending.
        #[arg(long)]
        min_position: Option<i64>,
        #[arg(long, value_parser = parse::duration, default_value = "5s")]
        timeout: std::time::Duration,
    },
    /// Stream the log's events between two positions, in position order.
    ReplayLog {
        #[arg(long, default_value_t = 1)]
        from: i64,
        #[arg(long, default_value_t = i64::MAX)]
        to: i64,
        #[arg(long)]
        job: Option<Uuid>,
        #[arg(long)]
        json: bool,
    },
    /// Recompute hashes and replay the log against the projection; with
    /// --audit-log, also check a consumer's audit copy against the chain.
    Verify {
        job: Option<Uuid>,
        /// Database URL of an audit-log consumer to check.
        #[arg(long)]
        audit_log: Option<String>,
        /// Also rebuild `jobs_rebuilt` from the log and compare it with the
        /// inline projection.
        #[arg(long)]
        rebuilt: bool,
        /// Also check every signed checkpoint's signature with this public key.
        #[arg(long)]
        pubkey: Option<std::path::PathBuf>,
        /// A signed head you hold from outside the database; the log must have it.
        #[arg(long)]
        head: Vec<std::path::PathBuf>,
    },
    /// Writes an ed25519 key pair for signed checkpoints (docs/audit.md).
    Keygen(super::audit::KeygenArgs),
    /// Brings the log's Merkle tree up to date and signs its head now.
    Checkpoint(super::audit::CheckpointArgs),
    /// Keeps the tree and signs heads every N events or T seconds, until SIGTERM.
    Checkpointer(super::audit::CheckpointArgs),
    /// Writes a segment of the log as compressed NDJSON with a manifest.
    Export(super::audit::ExportArgs),
    /// Proves a job's events included under the latest signed head, or one head consistent with another.
    Prove(super::audit::ProveArgs),
    /// Checks exported segments, or a proof, with no database.
    Audit(super::audit::AuditArgs),
    /// Publish every event of the log to Kafka (the outbox relay).
    Relay {
        #[arg(long, default_value = "127.0.0.1:9092")]
        brokers: String,
        #[arg(long, default_value = "jobledger.events")]
        topic: String,
        /// Partitions when the relay creates the topic.
        #[arg(long, default_value_t = 8)]
        partitions: i32,
        #[arg(long, default_value_t = 5000)]
        batch: i64,
        #[arg(long)]
        metrics_addr: Option<std::net::SocketAddr>,
        /// The relay lease: how long a relay that died holds up its successor.
        #[arg(long, value_parser = parse::lease, default_value = "15s")]
        lease: std::time::Duration,
        /// How long the producer keeps retrying a message before the relay
        /// rebuilds it and resumes from the checkpoint.
        #[arg(long, value_parser = parse::lease, default_value = "10s")]
        message_timeout: std::time::Duration,
    },
    /// Run a shipped fenced consumer: status-mirror or audit-log.
    Consume {
        #[arg(value_parser = ["status-mirror", "audit-log"])]
        which: String,
        #[arg(long, default_value = "127.0.0.1:9092")]
        brokers: String,
        #[arg(long, default_value = "jobledger.events")]
        topic: String,
        /// Consumer group [default: jobledger-<which>].
        #[arg(long)]
        group: Option<String>,
        /// The consumer's own database.
        #[arg(
            long,
            env = "CONSUMER_DATABASE_URL",
            default_value = "postgres://postgres@127.0.0.1:5432/jobledger_consumer"
        )]
        consumer_database_url: String,
    },
    /// Counts of jobs by state, and the log readers' lag.
    Stats {
        #[command(flatten)]
        format: super::human::Format,
    },
    /// Run a worker that executes a shell command per job (payload on stdin,
    /// JOBLEDGER_* environment variables; exit 0 success with stdout as the
    /// result, 75 transient, anything else permanent).
    Worker {
        #[arg(long, required = true)]
        queue: Vec<String>,
        #[arg(long)]
        exec: String,
        /// Job kinds this worker runs [default: every kind].
        #[arg(long)]
        kind: Vec<String>,
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Jobs claimed ahead of a free slot [default: by the handlers' pace,
        /// from the concurrency up to 256].
        #[arg(long)]
        prefetch: Option<usize>,
        #[arg(long, value_parser = parse::lease, default_value = "30s")]
        lease: std::time::Duration,
        #[arg(long, value_parser = parse::lease, default_value = "10s")]
        heartbeat: std::time::Duration,
        #[arg(long, value_parser = parse::lease, default_value = "1s")]
        poll: std::time::Duration,
        #[arg(long, value_parser = parse::duration, default_value = "30s")]
        drain_timeout: std::time::Duration,
        /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9464).
        #[arg(long)]
        metrics_addr: Option<std::net::SocketAddr>,
        #[arg(long, default_value = "exec")]
        name: String,
        /// Do not run the sweeper in this process.
        #[arg(long)]
        no_sweeper: bool,
        /// Do not run the scheduler (periodic schedules) in this process.
        #[arg(long)]
        no_scheduler: bool,
    },
    /// Throughput and latency figures (JSON lines), in a throwaway database.
    Bench {
        /// Run only these workloads: w1, w2, w3, latency, relay, e2e, lag, rebuild, workflows, serve, limits, w3-history, audit; and traces (only when named).
        #[arg(long)]
        only: Vec<String>,
        #[arg(long, default_value_t = 10_000)]
        w1_jobs: usize,
        #[arg(long, default_value_t = 100_000)]
        w2_jobs: usize,
        /// Clients enqueueing W2's batches at once (`scripts/peers` uses 1,
        /// as the peers' batch enqueue is measured).
        #[arg(long, default_value_t = 4)]
        w2_clients: usize,
        #[arg(long, default_value_t = 50_000)]
        w3_jobs: usize,
        #[arg(long, default_value_t = 1_000_000)]
        history_events: usize,
        #[arg(long, default_value_t = 200)]
        latency_samples: usize,
        /// Worker prefetch in W3 [default: the worker's own, which follows the handlers' pace].
        #[arg(long)]
        prefetch: Option<usize>,
        /// Broker for the relay and end-to-end workloads.
        #[arg(long, default_value = "127.0.0.1:9092")]
        brokers: String,
    },
    /// The main job end to end: enqueue, work, stall, take over, reconcile.
    /// Randomised run under faults, then an invariant checker (docs/reliability.md).
    Chaos(crate::tools::chaos::ChaosArgs),
    /// One worker process of a chaos run (started by `chaos`).
    #[command(hide = true)]
    ChaosWorker {
        #[arg(long)]
        provider: String,
        #[arg(long)]
        name: String,
        #[arg(long, value_parser = parse::lease, default_value = "2s")]
        lease: std::time::Duration,
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        #[arg(long)]
        careless: bool,
    },
    Demo {
        #[arg(long, default_value_t = 300)]
        jobs: usize,
        #[arg(long, default_value_t = 4)]
        workers: usize,
        /// Kafka broker for the relay and the status-mirror consumer; when none
        /// answers there, librdkafka's in-process mock cluster stands in.
        #[arg(long, default_value = "127.0.0.1:9092")]
        brokers: String,
    },
}
