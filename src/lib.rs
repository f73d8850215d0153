//! jobledger: an event-sourced ledger for background jobs with fenced leases.
#![forbid(unsafe_code)]

pub mod audit;
pub mod domain;
pub mod ledger;
pub mod reader;
pub mod rebuilt;
pub mod relay;
pub mod store;
pub mod telemetry;
pub mod wire_schema;
pub mod worker;
