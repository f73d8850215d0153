//! Runs one CLI command against the ledger.

use anyhow::{Context, Result};
use serde_json::json;
use std::time::Duration;
use tracing::Instrument;

use super::args::{Cli, Cmd, FenceArgs, TokenCmd};
use super::output::{self, line, outcome_code, write_json, BadInput};
use super::parse::json_arg;
use jobledger::domain::{Fence, JobState, NewJob};
use jobledger::ledger::tokens::Role;
use jobledger::ledger::{Lease, Ledger, Limits, WriteResult};

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

pub(super) fn redact(url: &str) -> String {
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
        // Unlike every other command, `migrate` is asked to apply them: a
        // role that may not is an error here, not something to skip.
        Ledger::connect(&cli.database_url, 4)
            .await
            .with_context(|| format!("cannot reach the database at {}", redact(&cli.database_url)))?
            .migrate()
            .await
            .context("applying migrations")?;
        line(&json!({ "migrated": true, "database_created": created }));
        return Ok(output::OK);
    }
    if let Some(code) = tools(&cli).await? {
        return Ok(code);
    }
    let (keygen, audit) = match &cli.command {
        Cmd::Keygen(k) => (Some(k), None),
        Cmd::Audit(a) => (None, Some(a)),
        _ => (None, None),
    };
    if let Some(code) = super::audit::offline(keygen, audit)? {
        return Ok(code);
    }
    let ledger = connect(&cli).await?;
    let span = command_span(&cli.command);
    dispatch(ledger, cli).instrument(span).await
}

/// With tracing on, a one-shot command is one span of its caller's trace:
/// `TRACEPARENT`, as OpenTelemetry's environment propagation sets it for a
/// script. A service is not (its work has traces of its own: jobs, requests).
fn command_span(cmd: &Cmd) -> tracing::Span {
    let service = matches!(
        cmd,
        Cmd::Relay { .. }
            | Cmd::Worker { .. }
            | Cmd::Consume { .. }
            | Cmd::Projections { .. }
            | Cmd::Serve { .. }
            | Cmd::Checkpointer(_)
            | Cmd::ChaosWorker { .. }
    );
    if service || !jobledger::telemetry::enabled() {
        return tracing::Span::none();
    }
    // The subcommand's name as typed (parsed again: only with tracing on).
    use clap::CommandFactory;
    let name = Cli::command()
        .try_get_matches_from(std::env::args_os())
        .ok()
        .and_then(|m| m.subcommand_name().map(str::to_owned))
        .unwrap_or_else(|| "command".into());
    let span = tracing::info_span!("cli", otel.name = %format!("jobledger {name}"));
    jobledger::telemetry::adopt(&span, std::env::var("TRACEPARENT").ok().as_deref());
    span
}

async fn dispatch(ledger: Ledger, cli: Cli) -> Result<i32> {
    match &cli.command {
        Cmd::Migrate
        | Cmd::Demo { .. }
        | Cmd::Bench { .. }
        | Cmd::Chaos(_)
        | Cmd::Keygen(_)
        | Cmd::Audit(_) => {
            unreachable!("handled above")
        }
        Cmd::Checkpoint(a) => super::audit::checkpoint(&ledger, a, true).await,
        Cmd::Checkpointer(a) => super::audit::checkpoint(&ledger, a, false).await,
        Cmd::Export(a) => super::audit::export(&ledger, a).await,
        Cmd::Prove(a) => super::audit::prove(&ledger, a).await,
        Cmd::ChaosWorker {
            provider,
            name,
            lease,
            concurrency,
            careless,
        } => crate::tools::chaos::worker::run(ledger, provider, name, *lease, *concurrency, *careless).await,
        Cmd::Enqueue { .. } => enqueue(&ledger, &cli).await,
        Cmd::Claim { .. }
        | Cmd::Heartbeat { .. }
        | Cmd::Progress { .. }
        | Cmd::Complete { .. }
        | Cmd::Fail { .. }
        | Cmd::Submit { .. }
        | Cmd::ConfirmCancel { .. } => lease_writes(&ledger, &cli).await,
        Cmd::Receipt { .. }
        | Cmd::Observe { .. }
        | Cmd::Cancel { .. }
        | Cmd::Replay { .. }
        | Cmd::Resolve { .. }
        | Cmd::Annotate { .. }
        | Cmd::Sweep
        | Cmd::Purge { .. } => operator_writes(&ledger, &cli).await,
        Cmd::Workflow { action } => super::workflow::run(&ledger, action, cli.max_payload_bytes).await,
        Cmd::Show { .. }
        | Cmd::History { .. }
        | Cmd::ReplayLog { .. }
        | Cmd::Stats { .. }
        | Cmd::Verify { .. } => super::reads::run(&ledger, &cli).await,
        Cmd::Token { action } => tokens(&ledger, action).await,
        Cmd::Queue { action } => super::queues::run(&ledger, action).await,
        Cmd::Schedule { action } => super::schedules::run(&ledger, action).await,
        Cmd::Relay { .. }
        | Cmd::Worker { .. }
        | Cmd::Consume { .. }
        | Cmd::Projections { .. }
        | Cmd::Serve { .. } => super::services::run(ledger, &cli).await,
    }
}

/// The tools around the product (src/tools), which bring their own database.
async fn tools(cli: &Cli) -> Result<Option<i32>> {
    if let Cmd::Bench {
        only,
        w1_jobs,
        w2_jobs,
        w2_clients,
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
            w2_clients: (*w2_clients).max(1),
            w3_jobs: *w3_jobs,
            history_events: *history_events,
            latency_samples: *latency_samples,
            prefetch: *prefetch,
            brokers: brokers.clone(),
        };
        return crate::tools::bench::run(args).await.map(Some);
    }
    if let Cmd::Demo {
        jobs,
        workers,
        brokers,
    } = &cli.command
    {
        return crate::tools::demo::run(&cli.database_url, *jobs, *workers, brokers)
            .await
            .map(Some);
    }
    if let Cmd::Chaos(args) = &cli.command {
        return crate::tools::chaos::run(&cli.database_url, args).await.map(Some);
    }
    Ok(None)
}

/// `enqueue`.
async fn enqueue(ledger: &Ledger, cli: &Cli) -> Result<i32> {
    match &cli.command {
        Cmd::Enqueue {
            queue,
            kind,
            key,
            payload,
            delay,
            run_at,
            priority,
            policy,
            concurrency_key,
            unique_for,
        } => {
            let new = NewJob {
                queue: queue.clone(),
                kind: kind.clone(),
                job_key: key.clone(),
                payload: json_input("--payload", payload, cli)?,
                priority: *priority,
                run_at: *run_at,
                delay_ms: delay.map(ms),
                policy: policy.to_policy(),
                concurrency_key: concurrency_key.clone(),
                unique_for_ms: unique_for.map(ms),
            };
            let e = ledger.enqueue(new).await?;
            line(&output::enqueued_json(&e));
            Ok(output::OK)
        }
        _ => unreachable!("dispatched by `run`"),
    }
}

/// What a lease holder writes (through the `Lease` it names).
async fn lease_writes(ledger: &Ledger, cli: &Cli) -> Result<i32> {
    match &cli.command {
        Cmd::Claim {
            queue,
            worker,
            lease,
            limit,
        } => {
            for l in ledger.claim(queue, worker, *lease, *limit).await? {
                line(&json!(
                    output::LeaseGrant::of(&l).expect("claimed leases carry their job")
                ));
            }
            Ok(output::OK)
        }
        Cmd::Heartbeat { fence, lease } => Ok(written(&lease_of(ledger, fence).heartbeat(*lease).await?)),
        Cmd::Progress { fence, step, lease } => {
            Ok(written(&lease_of(ledger, fence).progress(step, *lease).await?))
        }
        Cmd::Complete { fence, result } => {
            let result = result
                .as_deref()
                .map(|r| json_input("--result", r, cli))
                .transpose()?;
            Ok(written(&lease_of(ledger, fence).complete(result).await?))
        }
        Cmd::Fail {
            fence,
            class,
            code,
            message,
        } => Ok(written(
            &lease_of(ledger, fence)
                .fail(*class, code, message.as_deref())
                .await?,
        )),
        Cmd::Submit { fence, receipt } => Ok(written(&lease_of(ledger, fence).submit(receipt).await?)),
        Cmd::ConfirmCancel { fence } => Ok(written(&lease_of(ledger, fence).confirm_cancel().await?)),
        _ => unreachable!("dispatched by `run`"),
    }
}

/// Operators' and the outside world's writes.
async fn operator_writes(ledger: &Ledger, cli: &Cli) -> Result<i32> {
    match &cli.command {
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
            let data = json_input("--data", data, cli)?;
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
        Cmd::Resolve {
            job,
            verdict,
            reason,
            evidence,
            version,
            operator,
        } => {
            let verdict = JobState::parse(verdict).expect("clap allows only succeeded and cancelled");
            let evidence = json_input("--evidence", evidence, cli)?;
            Ok(written(
                &ledger
                    .resolve(*job, operator, verdict, reason, evidence, *version)
                    .await?,
            ))
        }
        Cmd::Annotate {
            job,
            corrects,
            reason,
            operator,
        } => Ok(written(
            &ledger.annotate(*job, operator, *corrects, reason).await?,
        )),
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
        _ => unreachable!("dispatched by `run`"),
    }
}

/// `token create|revoke|list`.
async fn tokens(ledger: &Ledger, action: &TokenCmd) -> Result<i32> {
    match action {
        TokenCmd::Create { role, name } => {
            let role = Role::parse(role).expect("clap allows only the four roles");
            let token = ledger.create_token(name, role).await?;
            line(&json!({ "name": name, "role": role.as_str(), "token": token }));
            eprintln!("token {name:?}: shown once; only its hash is kept");
        }
        TokenCmd::Revoke { name } => {
            ledger.revoke_token(name).await?;
            line(&json!({ "name": name, "revoked": true }));
        }
        TokenCmd::List => {
            for t in ledger.tokens().await? {
                line(&serde_json::to_value(t)?);
            }
        }
    }
    Ok(output::OK)
}
