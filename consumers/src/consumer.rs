//! `FencedConsumer`: one database transaction per message (fence + the
//! handler's effect), then the offset is stored.

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use serde_json::{json, Value};
use sqlx::{PgConnection, PgPool};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use crate::decode::{decode, JobEvent};
use crate::fence;

pub type HandlerFuture<'a> = Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + 'a>>;

/// The consumer's effect, run in the same transaction as the fence.
pub trait EventHandler: Send + Sync {
    fn handle<'a>(&'a self, conn: &'a mut PgConnection, event: &'a JobEvent) -> HandlerFuture<'a>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    Duplicate,
    Stale,
    DeadLettered,
}

#[derive(Default, Debug)]
pub struct ConsumerCounters {
    pub applied: AtomicU64,
    pub duplicates: AtomicU64,
    pub stale: AtomicU64,
    pub dead_lettered: AtomicU64,
}

impl ConsumerCounters {
    pub fn snapshot(&self) -> Value {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        json!({ "applied": g(&self.applied), "duplicates": g(&self.duplicates), "stale": g(&self.stale),
                "dead_lettered": g(&self.dead_lettered) })
    }
}

#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    pub brokers: String,
    pub group: String,
    pub topic: String,
}

pub struct FencedConsumer {
    consumer: StreamConsumer,
    pool: PgPool,
    cfg: ConsumerConfig,
    counters: Arc<ConsumerCounters>,
}

impl FencedConsumer {
    /// Joins `cfg.group` on `cfg.topic`; installs the consumer's tables.
    pub async fn new(
        cfg: ConsumerConfig,
        pool: PgPool,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        crate::schema::install(&pool).await?;
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &cfg.brokers)
            .set("group.id", &cfg.group)
            .set("enable.auto.commit", "true")
            // Offsets are stored by hand, only after the database commit.
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "10000")
            // Low latency: do not let the broker park fetches for long
            // (tansu answers a parked fetch only when it times out).
            .set("fetch.wait.max.ms", "10")
            .create()?;
        consumer.subscribe(&[&cfg.topic])?;
        Ok(FencedConsumer {
            consumer,
            pool,
            cfg,
            counters: Arc::new(ConsumerCounters::default()),
        })
    }

    pub fn counters(&self) -> Arc<ConsumerCounters> {
        self.counters.clone()
    }

    /// Consumes until `shutdown`, then commits the stored offsets.
    pub async fn run<H: EventHandler>(
        &self,
        handler: &H,
        shutdown: CancellationToken,
    ) -> Result<(), sqlx::Error> {
        loop {
            let msg = tokio::select! {
                _ = shutdown.cancelled() => break,
                m = self.consumer.recv() => m,
            };
            match msg {
                Ok(m) => {
                    self.process(&m, handler, &shutdown).await?;
                }
                Err(e) => {
                    tracing::warn!("consumer: {e}; retrying");
                    tokio::select! { _ = shutdown.cancelled() => break, _ = tokio::time::sleep(Duration::from_millis(500)) => {} }
                }
            }
        }
        if let Err(e) = self.consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::info!("consumer: final offset commit: {e}");
        }
        Ok(())
    }

    /// One message: fence and effect in one transaction, then the offset.
    /// A database error is retried (the message is fine; the database is
    /// not); it never skips the message.
    pub async fn process<H: EventHandler>(
        &self,
        m: &BorrowedMessage<'_>,
        handler: &H,
        shutdown: &CancellationToken,
    ) -> Result<Outcome, sqlx::Error> {
        let mut delay = Duration::from_millis(100);
        loop {
            match self.try_process(m, handler).await {
                Ok(o) => {
                    if let Err(e) = self.consumer.store_offset_from_message(m) {
                        tracing::warn!("consumer: storing offset: {e}");
                    }
                    return Ok(o);
                }
                Err(e) if shutdown.is_cancelled() => return Err(e),
                Err(e) => {
                    tracing::warn!("consumer: database error ({e}); retrying the same message in {delay:?}");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    async fn try_process<H: EventHandler>(
        &self,
        m: &BorrowedMessage<'_>,
        handler: &H,
    ) -> Result<Outcome, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let outcome = match decode(m) {
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
            Ok(ev) => {
                let gen = (ev.epoch, ev.token, ev.version);
                if fence::raise(&mut tx, &self.cfg.group, &ev.key, gen, ev.job_id()).await? {
                    handler.handle(&mut tx, &ev).await?;
                    Outcome::Applied
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
        let c = &self.counters;
        let (counter, name) = match outcome {
            Outcome::Applied => (&c.applied, "applied"),
            Outcome::Duplicate => (&c.duplicates, "duplicate"),
            Outcome::Stale => (&c.stale, "stale"),
            Outcome::DeadLettered => (&c.dead_lettered, "dead_lettered"),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("jobledger_consumer_messages_total", "outcome" => name).increment(1);
        Ok(outcome)
    }
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
