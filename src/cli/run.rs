//! Runs one CLI command against the ledger.

use anyhow::{Context, Result};
use serde_json::json;
use std::time::Duration;

use super::args::{Cli, Cmd, FenceArgs};
use super::output::{self, line, outcome_code, write_json, BadInput};
use super::parse::json_arg;
use jobledger::domain::{digest::fmt_time, Fence, NewJob};
use jobledger::ledger::{Found, Lease, Ledger, Limits, WriteResult};

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

async fn connect(cli: &Cli) -> Result<Ledger> {
    let limits = Limits {
        max_payload_bytes: cli.max_payload_bytes,
        ..Limits::default()
    };
    let ledger = Ledger::connect(&cli.database_url, 4)
        .await
        .with_context(|| format!("cannot reach the database at {}", redact(&cli.database_url)))?;
    // Applying migrations at start-up is idempotent and cheap once applied.
    // A least-privilege role (jobledger_worker, _reader) may not create the
    // migrations table: then the schema is the owner's business, not ours.
    if let Err(e) = ledger.migrate().await {
        if !e.is_permission_denied() {
            return Err(anyhow::Error::new(e).context("applying migrations (run `jobledger migrate` first?)"));
        }
        tracing::debug!("not applying migrations as this role: {e}");
    }
    Ok(ledger.with_limits(limits))
}

fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        _ => url.to_string(),
    }
}

fn lease_of(ledger: &Ledger, f: &FenceArgs) -> Lease {
    Lease::resume(ledger.clone(), f.job, f.epoch, f.token, f.worker.clone())
}

fn written(r: &WriteResult) -> i32 {
    line(&write_json(r));
    outcome_code(r.outcome)
}

fn json_input(flag: &str, raw: &str, cli: &Cli) -> Result<serde_json::Value> {
    json_arg(flag, raw, cli.max_payload_bytes).map_err(|e| BadInput(e).into())
}

pub async fn run(cli: Cli) -> Result<i32> {
    if let Cmd::Migrate = cli.command {
        let created = jobledger::store::schema::create_database_if_missing(
            &jobledger::ledger::connect_options(&cli.database_url)?,
        )
        .await
        .with_context(|| format!("cannot reach the database at {}", redact(&cli.database_url)))?;
        connect(&cli).await?;
        line(&json!({ "migrated": true, "database_created": created }));
        return Ok(output::OK);
    }
    if let Cmd::Bench {
        only,
        w1_jobs,
        w2_jobs,
        w3_jobs,
        history_events,
        latency_samples,
        prefetch,
        brokers,
    } = &cli.command
    {
        let args = crate::tools::bench::BenchArgs {
            url: cli.database_url.clone(),
            only: only.clone(),
            w1_jobs: *w1_jobs,
            w2_jobs: *w2_jobs,
            w3_jobs: *w3_jobs,
            history_events: *history_events,
            latency_samples: *latency_samples,
            prefetch: *prefetch,
            brokers: brokers.clone(),
        };
        return crate::tools::bench::run(args).await;
    }
    if let Cmd::Demo {
        jobs,
        workers,
        brokers,
    } = &cli.command
    {
        return crate::tools::demo::run(&cli.database_url, *jobs, *workers, brokers).await;
    }
    if let Cmd::Chaos(args) = &cli.command {
        return crate::tools::chaos::run(&cli.database_url, args).await;
    }
    let ledger = connect(&cli).await?;
    match &cli.command {
        Cmd::Migrate | Cmd::Demo { .. } | Cmd::Bench { .. } | Cmd::Chaos(_) => unreachable!("handled above"),
        Cmd::ChaosWorker {
            provider,
            name,
            lease,
            concurrency,
            careless,
        } => crate::tools::chaos::worker::run(ledger, provider, name, *lease, *concurrency, *careless).await,
        Cmd::Enqueue {
            queue,
            kind,
            key,
            payload,
            delay,
            run_at,
            priority,
            policy,
        } => {
            let new = NewJob {
                queue: queue.clone(),
                kind: kind.clone(),
                job_key: key.clone(),
                payload: json_input("--payload", payload, &cli)?,
                priority: *priority,
                run_at: *run_at,
                delay_ms: delay.map(ms),
                policy: policy.to_policy(),
            };
            let e = ledger.enqueue(new).await?;
            line(&json!({
                "job_id": e.job.job_id, "epoch": e.job.epoch, "token": e.job.token,
                "state": e.job.state, "created": e.created, "position": e.position,
            }));
            Ok(output::OK)
        }
        Cmd::Claim {
            queue,
            worker,
            lease,
            limit,
        } => {
            for l in ledger.claim(queue, worker, *lease, *limit).await? {
                let j = l.job().expect("claimed leases carry their job");
                line(&json!({
                    "job_id": j.job_id, "epoch": j.epoch, "token": j.token, "attempt": j.attempt,
                    "next_action": j.next_action, "queue": j.queue, "kind": j.kind, "key": j.job_key,
                    "payload": j.payload, "lease_until": j.lease_until.map(fmt_time), "step": j.step,
                }));
            }
            Ok(output::OK)
        }
        Cmd::Heartbeat { fence, lease } => Ok(written(&lease_of(&ledger, fence).heartbeat(*lease).await?)),
        Cmd::Progress { fence, step, lease } => {
            Ok(written(&lease_of(&ledger, fence).progress(step, *lease).await?))
        }
        Cmd::Complete { fence, result } => {
            let result = result
                .as_deref()
                .map(|r| json_input("--result", r, &cli))
                .transpose()?;
            Ok(written(&lease_of(&ledger, fence).complete(result).await?))
        }
        Cmd::Fail {
            fence,
            class,
            code,
            message,
        } => Ok(written(
            &lease_of(&ledger, fence)
                .fail(*class, code, message.as_deref())
                .await?,
        )),
        Cmd::Submit { fence, receipt } => Ok(written(&lease_of(&ledger, fence).submit(receipt).await?)),
        Cmd::ConfirmCancel { fence } => Ok(written(&lease_of(&ledger, fence).confirm_cancel().await?)),
        Cmd::Receipt { job, receipt, status } => Ok(written(&ledger.receipt(*job, receipt, *status).await?)),
        Cmd::Observe {
            job,
            key,
            data,
            epoch,
            token,
            worker,
        } => {
            let fence = epoch.zip(*token).map(|(epoch, token)| Fence { epoch, token });
            let data = json_input("--data", data, &cli)?;
            Ok(written(&ledger.observe(*job, fence, key, data, worker).await?))
        }
        Cmd::Cancel { job, reason } => Ok(written(&ledger.cancel(*job, reason.as_deref()).await?)),
        Cmd::Replay {
            job: Some(job),
            operator,
            reason,
            ..
        } => Ok(written(&ledger.replay(*job, operator, reason).await?)),
        Cmd::Replay {
            job: None,
            reason_code,
            since,
            until,
            operator,
            reason,
        } => {
            let (Some(code), Some(since), Some(until)) = (reason_code, since, until) else {
                return Err(BadInput("batch replay needs --reason-code, --since and --until".into()).into());
            };
            let mut worst = output::OK;
            for r in ledger
                .replay_batch(code, *since, *until, operator, reason)
                .await?
            {
                worst = worst.max(written(&r));
            }
            Ok(worst)
        }
        Cmd::Sweep => {
            let changed = ledger.sweep(500).await?;
            for r in &changed {
                line(&write_json(r));
            }
            eprintln!("sweep: {} job(s) changed", changed.len());
            Ok(output::OK)
        }
        Cmd::Purge { older_than } => {
            let n = ledger.purge(*older_than, 500).await?;
            line(&json!({ "purged": n }));
            Ok(output::OK)
        }
        Cmd::Workflow { action } => super::workflow::run(&ledger, action, cli.max_payload_bytes).await,
        Cmd::Show { job } => {
            match ledger.show(*job).await? {
                Found::Live(j) => line(&super::workflow::shown(&ledger, &j).await?),
                Found::Purged(t) => line(&json!({
                    "job_id": t.job_id, "state": t.state, "purged": true, "purged_at": fmt_time(t.purged_at),
                    "queue": t.queue, "key": t.job_key, "epoch": t.epoch, "token": t.token, "version": t.version,
                })),
            }
            Ok(output::OK)
        }
        Cmd::History { job, json } => {
            if *json {
                for v in jobledger::ledger::timeline::json_lines(&ledger, *job).await? {
                    line(&v);
                }
            } else {
                for l in jobledger::ledger::timeline::lines(&ledger, *job).await? {
                    println!("{l}");
                }
            }
            Ok(output::OK)
        }
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
        Cmd::Verify {
            job,
            audit_log,
            rebuilt,
        } => {
            if let Some(url) = audit_log {
                return super::consume::verify_audit_log(&ledger, url).await;
            }
            if *rebuilt {
                let reader = jobledger::reader::LogReader::source(ledger.pool().clone());
                let runner =
                    jobledger_projections::runner::Runner::new(ledger.pool().clone(), &reader, 5000).await?;
                runner.catch_up(&[&jobledger::rebuilt::JobsRebuilt]).await?;
                let problems = ledger.compare_rebuilt().await?;
                for p in &problems {
                    line(&json!({ "problem": p }));
                }
                line(
                    &json!({ "ok": problems.is_empty(), "compared": "jobs_rebuilt", "problems": problems.len() }),
                );
                return Ok(if problems.is_empty() {
                    output::OK
                } else {
                    output::FAILURE
                });
            }
            let report = ledger.verify(*job).await?;
            for p in &report.problems {
                line(&json!({ "problem": p }));
            }
            line(
                &json!({ "ok": report.ok(), "jobs": report.jobs, "events": report.events,
                          "problems": report.problems.len() }),
            );
            Ok(if report.ok() { output::OK } else { output::FAILURE })
        }
        Cmd::Worker {
            queue,
            exec,
            kind,
            concurrency,
            lease,
            heartbeat,
            poll,
            drain_timeout,
            metrics_addr,
            name,
            no_sweeper,
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
                .sweeper((!no_sweeper).then_some(Duration::from_secs(1)));
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
        Cmd::ReplayLog { from, to, job, json } => {
            let mut after = from - 1;
            loop {
                let page = ledger.log_page(*from, *to, *job, after, 1000).await?;
                let Some(last) = page.last() else { break };
                after = last.position;
                for h in &page {
                    if *json {
                        line(&serde_json::to_value(h)?);
                    } else {
                        println!(
                            "{} {}",
                            h.event.job_id,
                            jobledger::ledger::timeline::event_line(h)
                        );
                    }
                }
            }
            Ok(output::OK)
        }
        Cmd::Stats => {
            for (state, n) in ledger.counts_by_state().await? {
                line(&json!({ "state": state, "jobs": n }));
            }
            for name in ledger.reader_names().await? {
                let reader = jobledger::reader::LogReader::open(ledger.pool().clone(), &name).await?;
                let cp = reader.checkpoint().await?;
                let lag = reader.lag(cp).await?;
                line(
                    &json!({ "reader": name, "checkpoint": cp, "lag_events": lag.events,
                              "lag_seconds": lag.seconds, "horizon_held_by": lag.horizon_holder }),
                );
            }
            Ok(output::OK)
        }
    }
}
