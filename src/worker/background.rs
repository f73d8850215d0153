//! The worker's background tasks: the notification listener, the lease
//! keeper (batched fenced heartbeats) and the sweeper.

use sqlx::postgres::PgListener;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::handler::{Signal, StopReason};
use super::metrics as m;
use crate::domain::{JobState, Outcome};
use crate::ledger::{Lease, Ledger};
use crate::store::locks;

/// Jobs this worker is running, with the signal their handler watches.
pub(crate) type InFlight = Arc<Mutex<HashMap<Uuid, (Lease, Signal)>>>;

/// Advisory-lock key of the sweeper: one active sweeper per database.
const SWEEPER_LOCK: i64 = 0x6a6f_626c_6564_0001;

fn signal_of(inflight: &InFlight, job: Uuid) -> Option<Signal> {
    inflight
        .lock()
        .expect("inflight")
        .get(&job)
        .map(|(_, s)| s.clone())
}

/// Wakes the claim loop when a job of our queues becomes claimable, and
/// tells running handlers at once when their job's cancel is requested.
pub(crate) async fn listen(
    ledger: Ledger,
    queues: Vec<String>,
    wake: Arc<Notify>,
    inflight: InFlight,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let mut listener = match PgListener::connect_with(ledger.pool()).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("LISTEN connection failed ({e}); polling until it is back");
                tokio::select! { _ = stop.cancelled() => return, _ = tokio::time::sleep(Duration::from_secs(1)) => continue }
            }
        };
        if let Err(e) = listener
            .listen_all(["jobledger_queued", "jobledger_cancel"])
            .await
        {
            tracing::warn!("LISTEN failed ({e}); retrying");
            tokio::select! { _ = stop.cancelled() => return, _ = tokio::time::sleep(Duration::from_secs(1)) => continue }
        }
        // A notification may have been missed while (re)connecting.
        wake.notify_one();
        loop {
            // `try_recv`, not `recv`: it says when the connection dropped (a
            // database restart), which `recv` would hide by reconnecting.
            let n = tokio::select! {
                _ = stop.cancelled() => return,
                n = listener.try_recv() => n,
            };
            match n {
                Ok(None) => {
                    tracing::warn!(
                        "lost the database connection (restart?); reconnecting, and polling for what was missed"
                    );
                    wake.notify_one();
                }
                Ok(Some(n)) if n.channel() == "jobledger_queued" => {
                    if queues.iter().any(|q| q == n.payload()) {
                        wake.notify_one();
                    }
                }
                Ok(Some(n)) => {
                    if let Some(sig) = n.payload().parse().ok().and_then(|id| signal_of(&inflight, id)) {
                        sig.fire(StopReason::CancelRequested);
                    }
                }
                Err(e) => {
                    tracing::warn!("notification stream broke ({e}); reconnecting");
                    break;
                }
            }
        }
    }
}

/// Extends every running job's lease each `every`, in one transaction, each
/// fenced on its own. A refused heartbeat fires the handler's signal.
pub(crate) async fn keep_leases(
    ledger: Ledger,
    inflight: InFlight,
    lease: Duration,
    every: Duration,
    hook: Option<Arc<dyn Fn() -> super::BoxFuture<()> + Send + Sync>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! { _ = stop.cancelled() => return, _ = tick.tick() => {} }
        if let Some(h) = &hook {
            tokio::select! { _ = stop.cancelled() => return, _ = h() => {} }
        }
        let running: Vec<(Lease, Signal)> = inflight.lock().expect("inflight").values().cloned().collect();
        if running.is_empty() {
            continue;
        }
        let leases: Vec<&Lease> = running.iter().map(|(l, _)| l).collect();
        match Lease::heartbeat_many(&ledger, &leases, lease).await {
            Ok(results) => {
                for ((_, sig), r) in running.iter().zip(results) {
                    match r.outcome {
                        Outcome::Committed | Outcome::AlreadyCommitted => {}
                        _ if r
                            .job
                            .as_ref()
                            .is_some_and(|j| j.state == JobState::CancelRequested) =>
                        {
                            sig.fire(StopReason::CancelRequested)
                        }
                        _ => sig.fire(StopReason::LeaseLost),
                    }
                }
            }
            Err(e) => tracing::warn!("heartbeat batch failed ({e}); will retry before the leases expire"),
        }
    }
}

/// One active sweeper per database (session advisory lock). Also refreshes
/// the jobs-by-state and oldest-pending gauges.
pub(crate) async fn sweep(
    ledger: Ledger,
    every: Duration,
    counters: Arc<super::Counters>,
    stop: CancellationToken,
) {
    let mut leader: Option<sqlx::pool::PoolConnection<sqlx::Postgres>> = None;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! { _ = stop.cancelled() => break, _ = tick.tick() => {} }
        if leader.is_none() {
            if let Ok(mut conn) = ledger.pool().acquire().await {
                if locks::try_advisory_lock(&mut conn, SWEEPER_LOCK)
                    .await
                    .unwrap_or(false)
                {
                    tracing::info!("this worker is the active sweeper");
                    leader = Some(conn);
                }
            }
        }
        let Some(conn) = leader.as_mut() else {
            continue;
        };
        // On the lock's own session: if it died (a database restart), so did
        // the lock, and this fails instead of sweeping beside a new leader.
        match ledger.sweep_on(conn, 500).await {
            Ok(changed) => {
                counters.sweeps.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                metrics::counter!(m::SWEPT).increment(changed.len() as u64);
                refresh_gauges(&ledger).await;
            }
            Err(e) => {
                tracing::warn!("sweep failed ({e}); giving up the sweeper role until the next tick");
                if let Some(mut conn) = leader.take() {
                    let _ = locks::advisory_unlock(&mut conn, SWEEPER_LOCK).await;
                }
            }
        }
    }
    if let Some(mut conn) = leader.take() {
        let _ = locks::advisory_unlock(&mut conn, SWEEPER_LOCK).await;
    }
}

async fn refresh_gauges(ledger: &Ledger) {
    if let Ok(counts) = ledger.counts_by_state().await {
        for state in JobState::ALL {
            let n = counts
                .iter()
                .find(|(s, _)| s == state.as_str())
                .map_or(0, |(_, n)| *n);
            metrics::gauge!(m::JOBS, "state" => state.as_str()).set(n as f64);
        }
    }
    if let Ok(ages) = ledger.oldest_open_age().await {
        for (queue, age) in ages {
            metrics::gauge!(m::OLDEST_OPEN, "queue" => queue).set(age);
        }
    }
}
