//! The relay's sender: encodes each batch the feed read and hands its
//! messages to the producer, on a task of its own, so batch n+1 is on its
//! way to the broker while the session's loop waits for batch n's
//! acknowledgements. It never moves the checkpoint.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::time::Duration;
use tokio::sync::mpsc;

use super::feed::Read;
use super::{message, Pending, RelayError};
use crate::reader::{Batch, LogEvent};
use crate::telemetry::{self, ItemSpan};

/// A batch handed to the producer, and its messages' deliveries in order.
pub(super) type Sent = (Batch, Vec<Pending>);

pub(super) struct Sender {
    pub producer: FutureProducer,
    pub topic: String,
}

impl Sender {
    /// Sends each batch the feed hands in, in order, and hands it on with
    /// its deliveries. Ends with the first error (handed on) or when either
    /// side goes away: the session's loop then sees the end and, unless it
    /// is stopping, fails and starts again from the database checkpoint.
    pub async fn run(
        self,
        mut reads: mpsc::Receiver<Result<Read, RelayError>>,
        out: mpsc::Sender<Result<Sent, RelayError>>,
    ) {
        while let Some(read) = reads.recv().await {
            let sent = match read {
                Ok(r) => self.send(&r).await.map(|pending| (r.batch, pending)),
                Err(e) => Err(e),
            };
            let failed = sent.is_err();
            if out.send(sent).await.is_err() || failed {
                return;
            }
        }
    }

    /// Encodes the batch's messages and hands them to the producer (in
    /// order); returns their deliveries. Each gets its publish span here,
    /// when it is published.
    async fn send(&self, read: &Read) -> Result<Vec<Pending>, RelayError> {
        let mut pending = Vec::with_capacity(read.batch.events.len());
        for (e, k) in read.batch.events.iter().zip(&read.keys) {
            let queue = k.as_ref().map_or("", |k| k.queue.as_str());
            let tie = k
                .as_ref()
                .and_then(|k| k.parent.as_deref().zip(k.step.as_deref()));
            let mut m = message::message(e, queue, k.as_ref().and_then(|k| k.job_key.as_deref()), tie);
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
            let mut record = FutureRecord::to(&self.topic)
                .key(&m.key)
                .payload(&m.body)
                .headers(headers);
            loop {
                match self.producer.send_result(record) {
                    Ok(f) => {
                        pending.push((e.position, f, span));
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                        record = r;
                        self.producer.poll(Duration::from_millis(10));
                        tokio::task::yield_now().await;
                    }
                    Err((e, _)) => return Err(e.into()),
                }
            }
        }
        Ok(pending)
    }
}

/// `jobledger.publish`, a child of the span that wrote the event; none for
/// an event written without tracing (nothing to continue).
fn publish_span(e: &LogEvent, queue: &str) -> ItemSpan {
    let Some(parent) = e.row.trace.as_deref().filter(|_| telemetry::enabled()) else {
        return ItemSpan::none();
    };
    let mut attrs = telemetry::job_attrs(e.row.job_id, e.row.epoch, e.row.token);
    attrs.push(opentelemetry::KeyValue::new("position", e.position));
    attrs.push(opentelemetry::KeyValue::new("type", e.row.kind.clone()));
    attrs.push(opentelemetry::KeyValue::new("queue", queue.to_string()));
    ItemSpan::start("jobledger.publish", Some(parent), attrs)
}
