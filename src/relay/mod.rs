//! The outbox relay: publishes every event of the log to Kafka, per job in
//! order, with an idempotent producer; advances its checkpoint only after the
//! broker acknowledged the whole batch, under a fenced lease so a zombie
//! relay can never move the checkpoint.

mod feed;
pub mod message;
mod send;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, Producer};
use sqlx::postgres::PgListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use crate::ledger::{Ledger, LedgerError};
use crate::reader::{LogReader, ReaderLease};
use crate::telemetry::ItemSpan;
use crate::worker::BoxFuture;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("the relay lease was taken by another relay; this one stops advancing the checkpoint")]
    LeaseLost,
    #[error("delivery failed: {0}")]
    Delivery(String),
}

/// Test hooks between the relay's steps.
#[derive(Clone, Default)]
#[allow(clippy::type_complexity)]
pub struct RelayHooks {
    /// Runs after the broker acknowledged a batch, before the checkpoint moves.
    pub after_produce: Option<Arc<dyn Fn(usize) -> BoxFuture<()> + Send + Sync>>,
}

#[derive(Clone)]
pub struct RelayConfig {
    pub brokers: String,
    pub topic: String,
    pub partitions: i32,
    pub batch: i64,
    /// Reader name (one checkpoint per name).
    pub reader: String,
    pub holder: String,
    pub lease: Duration,
    pub poll: Duration,
    pub message_timeout: Duration,
    /// Create the topic through the admin API at each session's start. Off
    /// for a broker that rejects the admin API and makes topics its own way
    /// (the demo's in-process mock cluster).
    pub create_topic: bool,
    pub hooks: RelayHooks,
}

impl RelayConfig {
    pub fn new(brokers: &str, topic: &str) -> Self {
        RelayConfig {
            brokers: brokers.into(),
            topic: topic.into(),
            partitions: 8,
            batch: 5000,
            reader: format!("relay:{topic}"),
            holder: format!("{}:relay", crate::worker::process_holder_id()),
            lease: Duration::from_secs(15),
            poll: Duration::from_millis(500),
            message_timeout: Duration::from_secs(10),
            create_topic: true,
            hooks: RelayHooks::default(),
        }
    }
}

#[derive(Default, Debug)]
pub struct RelayCounters {
    pub published: AtomicU64,
    pub batches: AtomicU64,
    pub failures: AtomicU64,
    pub producers_built: AtomicU64,
}

pub struct Relay {
    ledger: Ledger,
    cfg: RelayConfig,
    counters: Arc<RelayCounters>,
}

/// The largest message the relay may send, in bytes. A message carries
/// one event, and the relay must never refuse one: an event its producer
/// refused failed its batch at every try, and the relay stopped there for
/// good (librdkafka's default of 1,000,000 is below the ledger's own 1 MiB
/// payload limit). The limits the ledger checks do not bound a body's
/// printed size: a text of control characters prints six times as long
/// (`\u0001`), a number as jsonb prints it hundreds of times
/// (`1e300`, 301 digits), and a workflow parent lists every step. So the
/// bound is generous, 64 MiB or 16 times the payload limit, within
/// librdkafka's own maximum; it only caps a message, it reserves nothing.
fn max_message_bytes(limits: &crate::ledger::Limits) -> String {
    const LIBRDKAFKA_MAX: usize = 1_000_000_000;
    limits
        .max_payload_bytes
        .saturating_mul(16)
        .clamp(64 * 1024 * 1024, LIBRDKAFKA_MAX)
        .to_string()
}

fn producer(cfg: &RelayConfig, max_bytes: &str) -> Result<FutureProducer, KafkaError> {
    ClientConfig::new()
        .set("message.max.bytes", max_bytes)
        .set("bootstrap.servers", &cfg.brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        // Java clients partition with murmur2: keys land where they expect.
        .set("partitioner", "murmur2_random")
        .set("message.timeout.ms", cfg.message_timeout.as_millis().to_string())
        .set("queue.buffering.max.messages", "500000")
        .set("linger.ms", "2")
        .create()
}

impl Relay {
    pub fn new(ledger: Ledger, cfg: RelayConfig) -> Self {
        Relay {
            ledger,
            cfg,
            counters: Arc::new(RelayCounters::default()),
        }
    }

    pub fn counters(&self) -> Arc<RelayCounters> {
        self.counters.clone()
    }

    /// Creates the topic when missing (this broker does not auto-create).
    pub async fn ensure_topic(&self) -> Result<(), RelayError> {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &self.cfg.brokers)
            .create()?;
        let max_bytes = max_message_bytes(self.ledger.limits());
        // The broker's limit must hold the relay's largest message too (a
        // topic made by hand must be given one as large).
        let topic = NewTopic::new(&self.cfg.topic, self.cfg.partitions, TopicReplication::Fixed(1))
            .set("max.message.bytes", &max_bytes);
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        for r in admin.create_topics([&topic], &opts).await? {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((t, code)) => return Err(RelayError::Delivery(format!("creating topic {t}: {code}"))),
            }
        }
        Ok(())
    }

    /// Runs until `shutdown`: survives the broker and the database going
    /// away (retrying with backoff from the database checkpoint), and yields
    /// when another relay holds the lease.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), RelayError> {
        let mut backoff = Duration::from_millis(200);
        while !shutdown.is_cancelled() {
            match self.session(&shutdown).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    self.counters.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("relay: {e}; resuming from the database checkpoint in {backoff:?}");
                    tokio::select! { _ = shutdown.cancelled() => {}, _ = tokio::time::sleep(backoff) => {} }
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
        Ok(())
    }

    async fn session(&self, shutdown: &CancellationToken) -> Result<(), RelayError> {
        if self.cfg.create_topic {
            self.ensure_topic().await?;
        }
        let producer = producer(&self.cfg, &max_message_bytes(self.ledger.limits()))?;
        self.counters.producers_built.fetch_add(1, Ordering::Relaxed);
        let reader = LogReader::open(self.ledger.pool().clone(), &self.cfg.reader).await?;
        let lease = loop {
            if let Some(l) = reader.acquire(&self.cfg.holder, self.cfg.lease).await? {
                break l;
            }
            tracing::info!("relay: another relay holds {}; waiting", self.cfg.reader);
            tokio::select! { _ = shutdown.cancelled() => return Ok(()), _ = tokio::time::sleep(self.cfg.poll) => {} }
        };
        let mut listener = PgListener::connect_with(self.ledger.pool()).await.ok();
        if let Some(l) = listener.as_mut() {
            if l.listen("jobledger_events").await.is_err() {
                listener = None;
            }
        }
        let from = reader.checkpoint().await?;
        // Three stages, each on its own task and a batch ahead of the next:
        // the feed reads the log, the sender encodes a batch and hands it
        // to the producer, and this loop waits for the broker's
        // acknowledgements and moves the checkpoint. So batch n+1 is read
        // and sent while batch n is acknowledged (waiting for n before
        // sending n+1 left the broker idle for a round trip per batch, and
        // one task for all three left a core idle). Only this loop moves
        // the checkpoint, in order, once every message up to it is
        // acknowledged. Batches sent ahead of a failure are sent again by
        // the next session, from the database checkpoint; consumers drop
        // the copies by their fence, as after any restart.
        let (to_send, reads) = tokio::sync::mpsc::channel(1);
        let (tx, mut batches) = tokio::sync::mpsc::channel(1);
        let feed = feed::Feed {
            ledger: self.ledger.clone(),
            reader: reader.clone(),
            batch: self.cfg.batch,
            poll: self.cfg.poll,
            listener,
        };
        let sender = send::Sender {
            producer: producer.clone(),
            topic: self.cfg.topic.clone(),
        };
        let _stop_feed =
            feed::AbortOnDrop(tokio::spawn(feed.run(from, to_send, shutdown.clone())).abort_handle());
        let _stop_sender = feed::AbortOnDrop(tokio::spawn(sender.run(reads, tx)).abort_handle());
        let mut renewed = Instant::now();
        while !shutdown.is_cancelled() {
            if renewed.elapsed() > self.cfg.lease / 3 {
                if !lease.renew().await? {
                    return Err(RelayError::LeaseLost);
                }
                renewed = Instant::now();
            }
            let next = tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(self.cfg.lease / 3) => continue,
                next = batches.recv() => next,
            };
            let Some(next) = next else {
                if shutdown.is_cancelled() {
                    break;
                }
                // The feed or the sender ended without a word: it panicked.
                // The session fails and starts again, as it did when
                // reading was inline.
                return Err(RelayError::Delivery("the relay's log feed stopped".into()));
            };
            let (current, pending) = next?;
            self.acks(&producer, pending).await?;
            if let Some(h) = &self.cfg.hooks.after_produce {
                h(current.events.len()).await;
            }
            self.advance(&lease, current.next).await?;
            self.counters
                .published
                .fetch_add(current.events.len() as u64, Ordering::Relaxed);
            self.counters.batches.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("jobledger_relay_published_total").increment(current.events.len() as u64);
        }
        Ok(())
    }

    async fn advance(&self, lease: &ReaderLease, to: crate::reader::Checkpoint) -> Result<(), RelayError> {
        if lease.advance(to).await? {
            Ok(())
        } else {
            Err(RelayError::LeaseLost)
        }
    }

    /// Waits until the broker acknowledged every message of a batch.
    async fn acks(&self, producer: &FutureProducer, pending: Vec<Pending>) -> Result<(), RelayError> {
        for (position, f, span) in pending {
            match f.await {
                Ok(Ok(d)) => {
                    span.end_at(std::time::SystemTime::now());
                    tracing::trace!(
                        position,
                        partition = d.partition,
                        offset = d.offset,
                        "relay: acknowledged"
                    )
                }
                Ok(Err((e, _))) => {
                    if let Some((code, reason)) = producer.client().fatal_error() {
                        return Err(RelayError::Delivery(format!(
                            "fatal producer error {code:?}: {reason}; rebuilding"
                        )));
                    }
                    return Err(e.into());
                }
                Err(_) => return Err(RelayError::Delivery("delivery cancelled".into())),
            }
        }
        Ok(())
    }
}

/// A message handed to the producer: its position, its delivery, and its
/// publish span (ended at the broker's acknowledgement).
pub(super) type Pending = (i64, rdkafka::producer::DeliveryFuture, ItemSpan);
