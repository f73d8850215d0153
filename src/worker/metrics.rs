//! Metric names (Prometheus through the `metrics` crate) and the exporter.

use std::net::SocketAddr;

pub const CLAIMED: &str = "jobledger_claimed_total";
pub const TAKEOVERS: &str = "jobledger_takeovers_total";
pub const STALE_WRITES: &str = "jobledger_stale_writes_rejected_total";
pub const LOST_LEASES: &str = "jobledger_lost_leases_total";
pub const HANDLER_RUNS: &str = "jobledger_handler_runs_total";
pub const OUTCOMES: &str = "jobledger_outcomes_total";
pub const JOBS: &str = "jobledger_jobs";
pub const OLDEST_OPEN: &str = "jobledger_oldest_pending_age_seconds";
pub const CLAIM_SECONDS: &str = "jobledger_claim_seconds";
pub const COMPLETE_SECONDS: &str = "jobledger_complete_seconds";
pub const SWEPT: &str = "jobledger_swept_total";

/// Serves `/metrics` on `addr` (keep it on loopback unless you mean it).
pub fn serve_prometheus(addr: SocketAddr) -> Result<(), String> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| format!("metrics endpoint on {addr}: {e}"))
}
