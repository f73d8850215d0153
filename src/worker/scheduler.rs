//! The scheduler as a worker's background task: whichever worker process
//! holds the scheduler lease fires the schedules' due slots every tick;
//! the others keep trying for the lease. Every firing re-checks the lease
//! inside its own transaction (`Ledger::fire_due`), so a scheduler that
//! stalled past its lease fires nothing once another has taken over.

use std::time::Duration;
use tokio_util::sync::CancellationToken;

use crate::ledger::Ledger;

pub(crate) async fn schedule(ledger: Ledger, every: Duration, holder: String, stop: CancellationToken) {
    // Long enough to ride out a slow tick, short enough that a dead
    // scheduler's successor takes over within seconds.
    let lease = (every * 10).max(Duration::from_secs(5));
    let mut token: Option<i64> = None;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! { _ = stop.cancelled() => break, _ = tick.tick() => {} }
        let held = match token {
            Some(t) => ledger
                .renew_scheduler_lease(t, lease)
                .await
                .unwrap_or(false)
                .then_some(t),
            None => ledger
                .acquire_scheduler_lease(&holder, lease)
                .await
                .unwrap_or(None),
        };
        if held.is_some() && token.is_none() {
            tracing::info!(holder = %holder, "this worker is the active scheduler");
        }
        token = held;
        let Some(t) = token else { continue };
        match ledger.fire_due(t, chrono::Duration::zero()).await {
            Ok(f) if f.fenced_out => token = None,
            Ok(f) => {
                for (name, slot, job) in &f.fired {
                    tracing::info!(schedule = %name, slot = %slot, job_id = %job, "fired");
                }
            }
            Err(e) => tracing::warn!("scheduler step failed ({e})"),
        }
    }
}
