//! Fenced Kafka consumers of jobledger events.
//!
//! A `FencedConsumer` keeps, per consumer group and message key, the highest
//! `(epoch, token, version)` it applied, in the consumer's own PostgreSQL and
//! in the same transaction as the consumer's effect. An older event is
//! rejected as `stale`, an equal one is a `duplicate`; Kafka offsets are
//! stored only after the database commit. Messages that cannot be decoded go
//! to a dead-letter table with their raw bytes; they never stop the consumer.
#![forbid(unsafe_code)]

pub mod consumer;
pub mod decode;
pub mod fence;
pub mod schema;
pub mod shipped;
pub mod trace;

pub use consumer::{
    ConsumerConfig, ConsumerCounters, EventHandler, FencedConsumer, Handled, HandlerError, Outcome,
};
pub use decode::{DecodeError, JobEvent, SCHEMA};
