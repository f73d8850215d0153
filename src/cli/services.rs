//! The CLI's long-running services: relay, worker, consumers, projections.

use anyhow::Result;
use serde_json::json;
use std::time::Duration;

use super::args::{Cli, Cmd};
use super::output::{self, line};
use super::run::redact;
use jobledger::ledger::Ledger;

/// Runs until stopped (SIGTERM / Ctrl-C) or done.
pub async fn run(ledger: Ledger, cli: &Cli) -> Result<i32> {
    match &cli.command {
        Cmd::Relay {
            brokers,
            topic,
            partitions,
            batch,
            metrics_addr,
            lease,
            message_timeout,
        } => {
            if let Some(addr) = metrics_addr {
                jobledger::worker::metrics::serve_prometheus(*addr).map_err(anyhow::Error::msg)?;
            }
            let mut cfg = jobledger::relay::RelayConfig::new(brokers, topic);
            cfg.partitions = *partitions;
            cfg.batch = *batch;
            cfg.lease = *lease;
            cfg.message_timeout = *message_timeout;
            let relay = jobledger::relay::Relay::new(ledger.clone(), cfg);
            let stop = tokio_util::sync::CancellationToken::new();
            jobledger::worker::cancel_on_signals(stop.clone());
            eprintln!("relay: {} -> {brokers} topic {topic}", redact(&cli.database_url));
            relay.run(stop).await?;
            let c = relay.counters();
            line(&json!({ "published": c.published.load(std::sync::atomic::Ordering::Relaxed) }));
            Ok(output::OK)
        }
        Cmd::Consume {
            which,
            brokers,
            topic,
            group,
            consumer_database_url,
        } => super::consume::run(which, brokers, topic, group.as_deref(), consumer_database_url).await,
        Cmd::Worker { .. } => worker(ledger, cli).await,
        Cmd::Serve {
            listen,
            drain_timeout,
        } => {
            let stop = tokio_util::sync::CancellationToken::new();
            jobledger::worker::cancel_on_signals(stop.clone());
            crate::serve::serve(ledger, *listen, cli.max_payload_bytes, stop, *drain_timeout).await?;
            Ok(output::OK)
        }
        Cmd::Projections {
            action,
            name,
            job,
            min_position,
            timeout,
        } if action == "query" => {
            super::projections::query(&ledger, name.as_deref(), *job, *min_position, *timeout).await
        }
        Cmd::Projections { action, name, .. } => {
            super::projections::run(&ledger, action, name.as_deref()).await
        }
        _ => unreachable!("dispatched by `run`"),
    }
}

/// `worker --exec`: runs a command per job until stopped.
async fn worker(ledger: Ledger, cli: &Cli) -> Result<i32> {
    match &cli.command {
        Cmd::Worker {
            queue,
            exec,
            kind,
            concurrency,
            prefetch,
            lease,
            heartbeat,
            poll,
            drain_timeout,
            metrics_addr,
            name,
            no_sweeper,
            no_scheduler,
        } => {
            if let Some(addr) = metrics_addr {
                jobledger::worker::metrics::serve_prometheus(*addr).map_err(anyhow::Error::msg)?;
            }
            let handler = jobledger::worker::exec::exec_handler(exec);
            let mut b = jobledger::worker::Worker::builder(ledger.clone())
                .name(name)
                .concurrency(*concurrency)
                .lease(*lease)
                .heartbeat_every(*heartbeat)
                .poll_every(*poll)
                .drain_timeout(*drain_timeout)
                .sweeper((!no_sweeper).then_some(Duration::from_secs(1)))
                .scheduler((!no_scheduler).then_some(Duration::from_secs(1)));
            if let Some(n) = prefetch {
                b = b.prefetch(*n);
            }
            for q in queue {
                b = b.queue(q);
            }
            b = if kind.is_empty() {
                b.any_kind(handler)
            } else {
                kind.iter().fold(b, |b, k| b.handler_fn(k, handler.clone()))
            };
            let worker = b.build()?;
            let stop = tokio_util::sync::CancellationToken::new();
            jobledger::worker::cancel_on_signals(stop.clone());
            eprintln!(
                "worker {} on {}: running `{exec}`",
                worker.holder(),
                queue.join(",")
            );
            let report = worker.run(stop).await?;
            line(&serde_json::to_value(report)?);
            Ok(output::OK)
        }
        _ => unreachable!("dispatched by `run`"),
    }
}
