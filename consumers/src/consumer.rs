//! `FencedConsumer`: one database transaction per message holds the fence,
//! the handler's effect and the consumer's offset, so a message is applied
//! exactly once per consumer name whatever crashes (offsets in the
//! consumer's database, partitions assigned by the consumer itself).

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};
use sqlx::{PgConnection, PgPool};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::decode::{decode, JobEvent};
use crate::fence;

pub type HandlerFuture<'a> = Pin<Box<dyn Future<Output = Result<Handled, HandlerError>> + Send + 'a>>;

/// What a handler did with an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handled {
    Applied,
    /// An unfenced handler already held this event (a redelivery).
    AlreadyRecorded,
}

/// Why a handler could not apply an event.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// The event can never be applied (bad data for this handler): it goes
    /// to the dead-letter table, and the consumer moves on.
    #[error("{0}")]
    Poison(String),
    /// A database error: retried with backoff when it is about the database
    /// (connection lost, shutting down, serialization failure, deadlock,
    /// out of resources), dead-lettered when it is about the data (a
    /// constraint, a bad value, anything else that would fail again).
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl HandlerError {
    /// Whether the same message may succeed later.
    pub fn is_transient(&self) -> bool {
        match self {
            HandlerError::Poison(_) => false,
            HandlerError::Db(e) => transient_db(e),
        }
    }
}

/// Connection trouble and the SQLSTATE classes that are about the server,
/// not the statement: 08 connection, 40 rollback (serialization, deadlock),
/// 53 insufficient resources, 55P03 lock not available, 57 operator
/// intervention (shutdown, cancel), 58 system error — and 42 (permission
/// denied, table missing, bad SQL): the same for every message, so it is an
/// operator's or a deploy's mistake (a revoked grant, a migration halfway),
/// never one message's fault. Dead-lettering it would pass every offset
/// and empty the stream into the dead-letter table; retrying halts the
/// consumer loudly until someone fixes it, and loses nothing.
pub fn transient_db(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => d.code().is_some_and(|c| {
            c == "55P03"
                || ["08", "40", "42", "53", "57", "58"]
                    .iter()
                    .any(|p| c.starts_with(p))
        }),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// The consumer's effect, run in the same transaction as the fence.
pub trait EventHandler: Send + Sync {
    fn handle<'a>(&'a self, conn: &'a mut PgConnection, event: &'a JobEvent) -> HandlerFuture<'a>;

    /// Whether the per-key staleness fence gates this handler (the default:
    /// a read model of the latest state must never go back). A handler that
    /// records every event by (job_id, version), such as an audit copy, says
    /// false: it gets every event, in any order, and deduplicates itself;
    /// a fence would turn any reordering into a permanent hole.
    fn fenced(&self) -> bool {
        true
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    Duplicate,
    Stale,
    DeadLettered,
    /// This offset was applied before (redelivered after a crash): skipped.
    Redelivered,
}

#[derive(Default, Debug)]
pub struct ConsumerCounters {
    pub applied: AtomicU64,
    pub duplicates: AtomicU64,
    pub stale: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub redelivered: AtomicU64,
}

impl ConsumerCounters {
    pub fn snapshot(&self) -> Value {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        json!({ "applied": g(&self.applied), "duplicates": g(&self.duplicates), "stale": g(&self.stale),
                "dead_lettered": g(&self.dead_lettered), "redelivered": g(&self.redelivered) })
    }
}

#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    pub brokers: String,
    /// The consumer's name: its fences and offsets are kept under it. Run
    /// one process per name (a second one is harmless, each message still
    /// applies once, but it does the work twice).
    pub group: String,
    pub topic: String,
}

pub struct FencedConsumer {
    consumer: StreamConsumer,
    pool: PgPool,
    cfg: ConsumerConfig,
    counters: Arc<ConsumerCounters>,
    /// Per partition: the next offset to apply and whether the partition
    /// was already rewound to its beginning once.
    positions: std::sync::Mutex<HashMap<i32, (i64, bool)>>,
}

/// How far before its stored offset a partition is (re)read. tansu 0.6
/// answers a fetch from an offset inside a record batch with the *next*
/// batch, silently skipping the rest of the batch; starting at least one
/// batch earlier (librdkafka puts at most 10,000 messages in one) and
/// skipping what was applied in memory avoids that. Kafka itself would not
/// need it; it costs one re-read of up to this many messages per start.
const REWIND: i64 = 10_000;

enum Position {
    /// Not yet reached (re-read after a rewind): skip without a database trip.
    Behind,
    Next,
    /// Past the next offset: the broker skipped messages.
    Gap(i64),
}

impl FencedConsumer {
    /// Installs the consumer's tables and prepares a Kafka client; `run`
    /// assigns the partitions once the topic exists.
    pub async fn new(
        cfg: ConsumerConfig,
        pool: PgPool,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        crate::schema::install(&pool).await?;
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &cfg.brokers)
            // No group membership is used (no subscribe, no commits): the
            // id only names the client to the broker.
            .set("group.id", &cfg.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            // Low latency: do not let the broker park fetches for long
            // (tansu answers a parked fetch only when it times out).
            .set("fetch.wait.max.ms", "10")
            .create()?;
        Ok(FencedConsumer {
            consumer,
            pool,
            cfg,
            counters: Arc::new(ConsumerCounters::default()),
            positions: std::sync::Mutex::new(HashMap::new()),
        })
    }

    pub fn counters(&self) -> Arc<ConsumerCounters> {
        self.counters.clone()
    }

    /// Assigns every partition of the topic, each from the offset stored in
    /// the consumer's database (or the beginning). Waits (with backoff) for
    /// the topic to exist and the broker to answer. Answers the partition
    /// count, or `None` on shutdown.
    pub async fn assign(&self, shutdown: &CancellationToken) -> Result<Option<usize>, sqlx::Error> {
        let mut delay = Duration::from_millis(200);
        loop {
            match self.try_assign().await {
                Ok(n) if n > 0 => return Ok(Some(n)),
                Ok(_) => tracing::info!(
                    "consumer: topic {} has no partitions yet; waiting",
                    self.cfg.topic
                ),
                Err(AssignError::Db(e)) => {
                    tracing::warn!("consumer: reading offsets: {e}; retrying in {delay:?}")
                }
                Err(AssignError::Kafka(e)) => tracing::warn!("consumer: broker: {e}; retrying in {delay:?}"),
            }
            tokio::select! { _ = shutdown.cancelled() => return Ok(None), _ = tokio::time::sleep(delay) => {} }
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    async fn try_assign(&self) -> Result<usize, AssignError> {
        let stored: std::collections::HashMap<i32, i64> =
            crate::fence::offsets(&self.pool, &self.cfg.group, &self.cfg.topic)
                .await
                .map_err(AssignError::Db)?
                .into_iter()
                .collect();
        let meta = self
            .consumer
            .fetch_metadata(Some(&self.cfg.topic), Duration::from_secs(5))
            .map_err(AssignError::Kafka)?;
        let mut tpl = TopicPartitionList::new();
        let mut positions = HashMap::new();
        for t in meta.topics().iter().filter(|t| t.error().is_none()) {
            for p in t.partitions() {
                let next = stored.get(&p.id()).copied().unwrap_or(0);
                let from = if next > REWIND {
                    Offset::Offset(next - REWIND)
                } else {
                    Offset::Beginning
                };
                tpl.add_partition_offset(&self.cfg.topic, p.id(), from)
                    .map_err(AssignError::Kafka)?;
                positions.insert(p.id(), (next, next <= REWIND));
            }
        }
        *self.positions.lock().expect("positions") = positions;
        let n = tpl.count();
        if n > 0 {
            self.consumer.assign(&tpl).map_err(AssignError::Kafka)?;
        }
        Ok(n)
    }

    /// Consumes until `shutdown`.
    pub async fn run<H: EventHandler>(
        &self,
        handler: &H,
        shutdown: CancellationToken,
    ) -> Result<(), sqlx::Error> {
        if self.assign(&shutdown).await?.is_none() {
            return Ok(());
        }
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => break,
                m = self.consumer.recv() => m,
            };
            match msg {
                Ok(m) => match self.position(m.partition(), m.offset()) {
                    Position::Behind => {}
                    Position::Next => {
                        self.process(&m, handler, &shutdown).await?;
                        self.passed(m.partition(), m.offset());
                    }
                    Position::Gap(next) => self.rewind(m.partition(), next, m.offset()),
                },
                Err(e) => {
                    tracing::warn!("consumer: {e}; retrying");
                    tokio::select! { _ = shutdown.cancelled() => break, _ = tokio::time::sleep(Duration::from_millis(500)) => {} }
                }
            }
        }
        Ok(())
    }

    fn position(&self, partition: i32, offset: i64) -> Position {
        let positions = self.positions.lock().expect("positions");
        match positions.get(&partition) {
            Some((next, _)) if offset < *next => Position::Behind,
            Some((next, false)) if offset > *next => Position::Gap(*next),
            _ => Position::Next,
        }
    }

    fn passed(&self, partition: i32, offset: i64) {
        let mut positions = self.positions.lock().expect("positions");
        let e = positions.entry(partition).or_insert((0, true));
        e.0 = e.0.max(offset + 1);
    }

    /// The broker skipped from `next` to `got`: read the partition again
    /// from its beginning, once (what was applied is skipped in memory). If
    /// the offsets are missing even then, they are a real gap and the
    /// consumer goes on past them.
    fn rewind(&self, partition: i32, next: i64, got: i64) {
        tracing::warn!(
            partition,
            next,
            got,
            "consumer: the broker skipped offsets; re-reading the partition from its beginning"
        );
        self.positions
            .lock()
            .expect("positions")
            .insert(partition, (next, true));
        if let Err(e) = self.consumer.seek(
            &self.cfg.topic,
            partition,
            Offset::Beginning,
            Duration::from_secs(10),
        ) {
            tracing::warn!(partition, "consumer: seek failed ({e}); reassigning");
            self.positions
                .lock()
                .expect("positions")
                .insert(partition, (next, false));
        }
    }

    /// One message: offset, fence and effect in one transaction. A
    /// transient database error is retried (the message is fine; the
    /// database is not); it never skips the message. A message the handler
    /// can never apply is dead-lettered with its error, and the consumer
    /// goes on.
    pub async fn process<H: EventHandler>(
        &self,
        m: &BorrowedMessage<'_>,
        handler: &H,
        shutdown: &CancellationToken,
    ) -> Result<Outcome, sqlx::Error> {
        // The job's trace goes on here: the relay's publish span is this
        // span's parent, and the handler runs inside it.
        let parent = crate::decode::header(m, crate::trace::TRACEPARENT)
            .ok()
            .and_then(|p| crate::trace::context_of(&p));
        // A message of an untraced job has no trace to continue: a root
        // trace per message would bury the jobs' own (so: debug).
        let span = match &parent {
            Some(_) => tracing::info_span!(
                "consume",
                otel.name = "jobledger.consume",
                group = %self.cfg.group,
                partition = m.partition(),
                offset = m.offset()
            ),
            None => {
                tracing::debug_span!("consume", group = %self.cfg.group, partition = m.partition(), offset = m.offset())
            }
        };
        if let Some(cx) = parent {
            // Parsed once, above; fails only for a disabled span.
            let _ = tracing_opentelemetry::OpenTelemetrySpanExt::set_parent(&span, cx);
        }
        self.process_retrying(m, handler, shutdown).instrument(span).await
    }

    async fn process_retrying<H: EventHandler>(
        &self,
        m: &BorrowedMessage<'_>,
        handler: &H,
        shutdown: &CancellationToken,
    ) -> Result<Outcome, sqlx::Error> {
        let mut delay = Duration::from_millis(100);
        loop {
            let err = match self.try_process(m, handler).await {
                Ok(o) => return Ok(o),
                Err(e) => e,
            };
            if !err.is_transient() {
                tracing::warn!(
                    partition = m.partition(),
                    offset = m.offset(),
                    "consumer: the handler cannot apply this message ({err}); dead-lettering it"
                );
                match self.dead_letter(m, &format!("handler: {err}")).await {
                    Ok(o) => return Ok(o),
                    Err(e) if shutdown.is_cancelled() => return Err(e),
                    Err(e) => tracing::warn!("consumer: dead-lettering failed ({e}); retrying"),
                }
            } else if shutdown.is_cancelled() {
                return Err(match err {
                    HandlerError::Db(e) => e,
                    HandlerError::Poison(p) => sqlx::Error::Protocol(p),
                });
            } else {
                tracing::warn!("consumer: database error ({err}); retrying the same message in {delay:?}");
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    /// Passes the offset and keeps the message in the dead-letter table, in
    /// one transaction (nothing of the failed attempt is kept).
    async fn dead_letter(&self, m: &BorrowedMessage<'_>, error: &str) -> Result<Outcome, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let passed =
            crate::fence::pass_offset(&mut tx, &self.cfg.group, m.topic(), m.partition(), m.offset()).await?;
        let outcome = if passed {
            fence::dead_letter(
                &mut tx,
                &self.cfg.group,
                m.topic(),
                m.partition(),
                m.offset(),
                m.key(),
                m.payload(),
                &headers_json(m),
                error,
            )
            .await?;
            Outcome::DeadLettered
        } else {
            Outcome::Redelivered
        };
        tx.commit().await?;
        self.count(outcome);
        Ok(outcome)
    }

    async fn try_process<H: EventHandler>(
        &self,
        m: &BorrowedMessage<'_>,
        handler: &H,
    ) -> Result<Outcome, HandlerError> {
        let mut tx = self.pool.begin().await?;
        let passed =
            crate::fence::pass_offset(&mut tx, &self.cfg.group, m.topic(), m.partition(), m.offset()).await?;
        let outcome = match decode(m) {
            _ if !passed => {
                tracing::info!(
                    partition = m.partition(),
                    offset = m.offset(),
                    "consumer: offset already applied; skipping the redelivery"
                );
                Outcome::Redelivered
            }
            Err(e) => {
                let headers = headers_json(m);
                fence::dead_letter(
                    &mut tx,
                    &self.cfg.group,
                    m.topic(),
                    m.partition(),
                    m.offset(),
                    m.key(),
                    m.payload(),
                    &headers,
                    &e.to_string(),
                )
                .await?;
                tracing::warn!(
                    partition = m.partition(),
                    offset = m.offset(),
                    "consumer: dead-lettered: {e}"
                );
                Outcome::DeadLettered
            }
            Ok(ev) if !handler.fenced() => match handler.handle(&mut tx, &ev).await? {
                Handled::Applied => Outcome::Applied,
                Handled::AlreadyRecorded => Outcome::Duplicate,
            },
            Ok(ev) => {
                let gen = (ev.epoch, ev.token, ev.version);
                if fence::raise(&mut tx, &self.cfg.group, &ev.key, gen, Some(ev.job_id)).await? {
                    match handler.handle(&mut tx, &ev).await? {
                        Handled::Applied => Outcome::Applied,
                        Handled::AlreadyRecorded => Outcome::Duplicate,
                    }
                } else {
                    let held = fence::current(&mut tx, &self.cfg.group, &ev.key).await?;
                    if held == Some(gen) {
                        Outcome::Duplicate
                    } else {
                        tracing::info!(key = %ev.key, "consumer: stale event {gen:?} rejected; applied generation is {held:?}");
                        Outcome::Stale
                    }
                }
            }
        };
        tx.commit().await?;
        self.count(outcome);
        Ok(outcome)
    }

    fn count(&self, outcome: Outcome) {
        let c = &self.counters;
        let (counter, name) = match outcome {
            Outcome::Applied => (&c.applied, "applied"),
            Outcome::Duplicate => (&c.duplicates, "duplicate"),
            Outcome::Stale => (&c.stale, "stale"),
            Outcome::DeadLettered => (&c.dead_lettered, "dead_lettered"),
            Outcome::Redelivered => (&c.redelivered, "redelivered"),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("jobledger_consumer_messages_total", "outcome" => name).increment(1);
    }
}

#[derive(Debug)]
enum AssignError {
    Db(sqlx::Error),
    Kafka(rdkafka::error::KafkaError),
}

fn headers_json(m: &BorrowedMessage<'_>) -> Value {
    let mut out = serde_json::Map::new();
    if let Some(hs) = m.headers() {
        for h in hs.iter() {
            let v = h
                .value
                .map(|v| Value::String(String::from_utf8_lossy(v).into_owned()))
                .unwrap_or(Value::Null);
            out.insert(h.key.to_string(), v);
        }
    }
    Value::Object(out)
}
