//! `jobledger chaos-worker`: one worker process of a chaos run. The
//! orchestrator kills and freezes these at random; everything they did must
//! still add up afterwards.

use anyhow::Result;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

use super::provider::{Client, RefundReply};
use super::QUEUE;
use crate::tools::output::{self, line};
use jobledger::domain::NextAction;
use jobledger::ledger::Ledger;
use jobledger::worker::{HandlerOutcome, JobContext, Worker};

/// Slack between the lease end the database set and the deadline the
/// provider enforces: room for clock skew between the two in a real setup.
const DEADLINE_MARGIN_MS: i64 = 250;

/// The careful refund handler: reconcile (ask the provider by `job_key`)
/// whenever an earlier call may have executed, that is after a takeover and
/// on every retry (a transient answer may have been a lost response); pass
/// the lease end as the call's deadline.
///
/// `careless` skips the reconciliation: the checker must then find double
/// executions (what `chaos --careless` demonstrates).
async fn refund(ctx: JobContext, client: Arc<Client>, careless: bool) -> HandlerOutcome {
    let key = ctx.job_key().unwrap_or_default().to_string();
    if !careless && (ctx.next_action() == NextAction::Reconcile || ctx.attempt() > 1) {
        match client.lookup(&key).await {
            Some(Some(id)) => return HandlerOutcome::success(json!({ "refund_id": id, "reconciled": true })),
            Some(None) => {}
            None => return HandlerOutcome::transient("provider_unreachable"),
        }
    }
    let deadline = match ctx.step("calling_provider").await {
        Ok(Some(until)) => until.timestamp_millis() - DEADLINE_MARGIN_MS,
        Ok(None) => return HandlerOutcome::LeaseLost,
        Err(stop) => return stop.into(),
    };
    let refuse = ctx.payload()["refuse"] == json!(true);
    let job_id = ctx.job().job_id.to_string();
    match client
        .refund(&key, &job_id, ctx.epoch(), ctx.token(), deadline, refuse)
        .await
    {
        RefundReply::Ok(id) => HandlerOutcome::success(json!({ "refund_id": id })),
        RefundReply::Transient => HandlerOutcome::transient("provider_busy"),
        RefundReply::Permanent(code) => HandlerOutcome::permanent(&code),
        // Nothing executed; if a successor owns the job the fence refuses this.
        RefundReply::Expired => HandlerOutcome::transient("deadline_passed"),
        // It may have executed: the next attempt reconciles first.
        RefundReply::Unknown => HandlerOutcome::transient("provider_no_answer"),
    }
}

pub async fn run(
    ledger: Ledger,
    provider: &str,
    name: &str,
    lease: Duration,
    concurrency: usize,
    careless: bool,
) -> Result<i32> {
    let client = Arc::new(Client {
        addr: provider.to_string(),
        timeout: Duration::from_secs(5),
    });
    let worker = Worker::builder(ledger)
        .name(name)
        .queue(QUEUE)
        .concurrency(concurrency)
        .lease(lease)
        .heartbeat_every(lease / 4)
        .poll_every(Duration::from_millis(100))
        .drain_timeout(Duration::from_secs(3))
        .sweeper(Some(Duration::from_millis(500)))
        .handler("refund", move |ctx| refund(ctx, client.clone(), careless))
        .build()?;
    let stop = tokio_util::sync::CancellationToken::new();
    jobledger::worker::cancel_on_signals(stop.clone());
    eprintln!(
        "chaos-worker {} started (pid {})",
        worker.holder(),
        std::process::id()
    );
    let report = worker.run(stop).await?;
    line(&serde_json::to_value(report)?);
    Ok(output::OK)
}
