//! Tools around jobledger, kept apart from its front doors: the demo, the
//! bench, the chaos run, and the fake refund provider they and the tests
//! drive. The CLI dispatches `demo`, `bench` and `chaos` here; the library
//! knows nothing of them (the tests include the fake provider's file).

pub mod bench;
pub mod bench_audit;
pub mod bench_kafka;
pub mod bench_limits;
pub mod bench_serve;
pub mod bench_traces;
pub mod bench_workflows;
pub mod chaos;
pub mod demo;
pub mod fake_provider;
pub mod mock_broker;
pub mod otlp_sink;
pub mod output;
pub mod private_pg;
