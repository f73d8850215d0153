//! The outbox relay: publishes every event of the log to Kafka, per job in
//! order, with an idempotent producer; advances its checkpoint only after the
//! broker acknowledged the whole batch, under a fenced lease so a zombie
//! relay can never move the checkpoint.

mod feed;
pub mod message;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use sqlx::postgres::PgListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use crate::ledger::{Ledger, LedgerError};
use crate::reader::{LogReader, ReaderLease};
use crate::telemetry::{self, ItemSpan};
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

fn producer(cfg: &RelayConfig) -> Result<FutureProducer, KafkaError> {
    ClientConfig::new()
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
        let topic = NewTopic::new(&self.cfg.topic, self.cfg.partitions, TopicReplication::Fixed(1));
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
        let producer = producer(&self.cfg)?;
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
        // The feed reads and encodes batches on its own task, so the next
        // one is prepared on the other core while this loop hands one to the
        // producer and waits for its acknowledgements. It only reads: the
        // checkpoint moves here, after every acknowledgement, and the feed
        // ends with the session (a failed session starts again from the
        // database checkpoint).
        let (tx, mut batches) = tokio::sync::mpsc::channel(1);
        let feed = feed::Feed {
            ledger: self.ledger.clone(),
            reader: reader.clone(),
            batch: self.cfg.batch,
            poll: self.cfg.poll,
            listener,
        };
        let _stop_feed = feed::AbortOnDrop(tokio::spawn(feed.run(from, tx, shutdown.clone())).abort_handle());
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
                // The feed ended without a word: it panicked. The session
                // fails and starts again, as it did when reading was inline.
                return Err(RelayError::Delivery("the relay's log feed stopped".into()));
            };
            let (current, messages) = next?;
            let pending = self.send(&producer, &current.events, messages).await?;
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

    /// Hands the batch's messages to the producer (in order); returns their
    /// deliveries. Each gets its publish span here, when it is published.
    async fn send(
        &self,
        producer: &FutureProducer,
        events: &[crate::reader::LogEvent],
        messages: Vec<message::Message>,
    ) -> Result<Vec<Pending>, RelayError> {
        let mut pending = Vec::with_capacity(events.len());
        for (e, mut m) in events.iter().zip(messages) {
            let span = publish_span(e, &m.queue);
            // The consumer's span is a child of this publish, or (relay
            // not tracing) of the write that made the event.
            if let Some(tp) = span.traceparent().or(e.row.trace.as_deref()) {
                m.headers.push((telemetry::TRACEPARENT, tp.to_owned()));
            }
            let mut headers = OwnedHeaders::new_with_capacity(m.headers.len());
            for (k, v) in &m.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: Some(v.as_bytes()),
                });
            }
            let mut record = FutureRecord::to(&self.cfg.topic)
                .key(&m.key)
                .payload(&m.body)
                .headers(headers);
            loop {
                match producer.send_result(record) {
                    Ok(f) => {
                        pending.push((e.position, f, span));
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                        record = r;
                        producer.poll(Duration::from_millis(10));
                        tokio::task::yield_now().await;
                    }
                    Err((e, _)) => return Err(e.into()),
                }
            }
        }
        Ok(pending)
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
type Pending = (i64, rdkafka::producer::DeliveryFuture, ItemSpan);

/// `jobledger.publish`, a child of the span that wrote the event; none for
/// an event written without tracing (nothing to continue).
fn publish_span(e: &crate::reader::LogEvent, queue: &str) -> ItemSpan {
    let Some(parent) = e.row.trace.as_deref().filter(|_| telemetry::enabled()) else {
        return ItemSpan::none();
    };
    let mut attrs = telemetry::job_attrs(e.row.job_id, e.row.epoch, e.row.token);
    attrs.push(opentelemetry::KeyValue::new("position", e.position));
    attrs.push(opentelemetry::KeyValue::new("type", e.row.kind.clone()));
    attrs.push(opentelemetry::KeyValue::new("queue", queue.to_string()));
    ItemSpan::start("jobledger.publish", Some(parent), attrs)
}
