//! The independent checker: reads what the ledger, the provider and the
//! mirror recorded after the run and lists every broken promise.

use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::faults::{Enqueued, FaultCounts};
use super::provider::{Execution, Provider, ProviderStats};
use super::{Plan, QUEUE};
use jobledger::ledger::Ledger;
use jobledger::reader::LogReader;
use jobledger::store::audit;
use uuid::Uuid;

#[derive(Debug, Default, serde::Serialize)]
pub struct Report {
    pub plan: Option<Plan>,
    pub seconds: f64,
    pub faults: FaultCounts,
    pub jobs_enqueued: usize,
    pub jobs: BTreeMap<String, i64>,
    pub events: i64,
    pub takeovers: i64,
    pub rejected_writes: BTreeMap<String, i64>,
    pub reconciled_successes: u64,
    pub workflows: i64,
    pub workflow_steps: i64,
    pub most_leased_per_key: i64,
    pub schedule_fired: i64,
    pub schedule_skipped: i64,
    pub executed_not_succeeded_after_lost_answer: u64,
    pub provider: ProviderStats,
    pub kafka: BTreeMap<String, u64>,
    pub consumers: Value,
    pub workers: Value,
    pub checks: Vec<String>,
    pub violations: Vec<String>,
}

impl Report {
    pub fn new(plan: &Plan, faults: FaultCounts, took: Duration) -> Self {
        let mut r = Report {
            plan: Some(plan.clone()),
            seconds: took.as_secs_f64(),
            ..Report::default()
        };
        if faults.unexpected_exits > 0 {
            r.violation(format!(
                "{} processes crashed on their own",
                faults.unexpected_exits
            ));
        }
        r.faults = faults;
        r
    }

    pub fn violation(&mut self, v: String) {
        eprintln!("chaos: VIOLATION {v}");
        self.violations.push(v);
    }

    /// Records a check and its failures (at most 5 examples each).
    pub fn check<T: std::fmt::Debug>(&mut self, name: &str, failures: &[T]) {
        self.checks.push(name.to_string());
        if !failures.is_empty() {
            let shown: Vec<String> = failures.iter().take(5).map(|f| format!("{f:?}")).collect();
            self.violation(format!(
                "{name}: {} failures, e.g. {}",
                failures.len(),
                shown.join("; ")
            ));
        }
    }

    pub fn print(&self) {
        eprintln!("chaos report ({:.0}s)", self.seconds);
        eprintln!("  faults          {}", json!(self.faults));
        eprintln!(
            "  jobs            {} enqueued, by state {}",
            self.jobs_enqueued,
            json!(self.jobs)
        );
        eprintln!(
            "  takeovers       {}   rejected writes {}",
            self.takeovers,
            json!(self.rejected_writes)
        );
        eprintln!("  provider        {}", json!(self.provider));
        eprintln!("  kafka           {}", json!(self.kafka));
        eprintln!("  mirror consumer {}", self.consumers);
        eprintln!("  workers         {}", self.workers);
        eprintln!(
            "  checks          {} run, {} violations",
            self.checks.len(),
            self.violations.len()
        );
        for v in &self.violations {
            eprintln!("    VIOLATION {v}");
        }
    }
}

/// Polls `cond` until it holds or `within` passes.
pub async fn until<F, Fut>(what: &str, within: Duration, mut cond: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !cond().await {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// The status mirror's database (the consumer created it).
pub async fn mirror_pool(url: &str) -> Result<sqlx::PgPool> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .context("mirror database")
}

async fn mirror_matches(ledger: &Ledger, mirror: &sqlx::PgPool) -> Result<Vec<String>> {
    let mirror = jobledger_consumers::shipped::mirror_rows(mirror).await?;
    let mirror: HashMap<_, _> = mirror.into_iter().map(|(j, s, v)| (j, (s, v))).collect();
    let jobs = ledger.states_in(QUEUE).await?;
    let mut diff: Vec<String> = jobs
        .iter()
        .filter(|(j, s, v)| mirror.get(j) != Some(&(s.clone(), *v)))
        .map(|(j, s, v)| format!("{j}: ledger {s} v{v}, mirror {:?}", mirror.get(j)))
        .collect();
    if mirror.len() != jobs.len() {
        diff.push(format!("mirror has {} jobs, ledger {}", mirror.len(), jobs.len()));
    }
    Ok(diff)
}

/// Waits for the jobs to settle, the relay to pass every event and the
/// mirror to equal the ledger.
pub async fn drain(
    ledger: &Ledger,
    relay_reader: &str,
    mirror: &sqlx::PgPool,
    within: Duration,
) -> Result<()> {
    until("every job is terminal or explained", within, || async {
        audit::unexplained_jobs(ledger.pool())
            .await
            .is_ok_and(|u| u.is_empty())
    })
    .await?;
    let relay = LogReader::open(ledger.pool().clone(), relay_reader).await?;
    until("the relay has published every event", within, || async {
        match relay.checkpoint().await {
            Ok(cp) => relay.behind(cp).await.is_ok_and(|b| !b),
            Err(_) => false,
        }
    })
    .await?;
    until("the status mirror equals the ledger", within, || async {
        mirror_matches(ledger, mirror).await.is_ok_and(|d| d.is_empty())
    })
    .await
}

pub async fn ledger_invariants(ledger: &Ledger, enqueued: &[Enqueued], r: &mut Report) -> Result<()> {
    let pool = ledger.pool();
    r.jobs_enqueued = enqueued.len();
    r.jobs = ledger.counts_by_state_in(QUEUE).await?.into_iter().collect();
    r.events = ledger.count_events_total().await?;
    r.takeovers = audit::count_reason(pool, "lease_expired_takeover").await?;
    r.rejected_writes = audit::rejections_by_outcome(pool).await?.into_iter().collect();

    let unexplained = audit::unexplained_jobs(pool).await?;
    r.check("every job is terminal or explained", &unexplained);
    r.check("no job succeeded twice", &audit::double_successes(pool).await?);
    r.check("no job has a version gap", &audit::version_gaps(pool).await?);
    r.check(
        "no state change carries an older token than its predecessor",
        &audit::token_regressions(pool).await?,
    );
    let ids: HashSet<Uuid> = enqueued.iter().map(|e| e.job_id).collect();
    let in_ledger: HashSet<Uuid> = ledger
        .states_in(QUEUE)
        .await?
        .into_iter()
        .map(|(j, _, _)| j)
        .collect();
    let mut lost: Vec<String> = ids
        .difference(&in_ledger)
        .map(|j| format!("{j} enqueued, not in the ledger"))
        .collect();
    lost.extend(
        in_ledger
            .difference(&ids)
            .map(|j| format!("{j} in the ledger, never enqueued")),
    );
    r.check("nothing lost: the enqueued jobs are exactly the jobs", &lost);

    (r.workflows, r.workflow_steps) = audit::workflow_counts(pool).await?;
    r.check(
        "every workflow's state is the rule table over its steps",
        &audit::parents_off_the_rule_table(pool).await?,
    );
    r.check(
        "no workflow step ran before its prerequisites succeeded",
        &audit::steps_run_before_prerequisites(pool).await?,
    );
    let verify = ledger.verify(None).await?;
    r.check("verify: hash chains and replay = jobs", &verify.problems);
    let reader = LogReader::open(pool.clone(), "chaos-check").await?;
    let runner = jobledger_projections::runner::Runner::new(pool.clone(), &reader, 5000).await?;
    runner.catch_up(&[&jobledger::rebuilt::JobsRebuilt]).await?;
    r.check(
        "verify: rebuilt projection = jobs",
        &ledger.compare_rebuilt().await?,
    );
    Ok(())
}

/// The provider's log and the event log agree: each key executed at most
/// once; every success names the provider's refund and was written by the
/// token that executed it or, after reconciling, by a later one; nothing
/// executed for a job that did not succeed unless its answer was lost.
pub async fn provider_agreement(ledger: &Ledger, provider: &Provider, r: &mut Report) -> Result<()> {
    let executions = provider.executions();
    r.provider = provider.stats();
    let mut by_key: HashMap<&str, Vec<&Execution>> = HashMap::new();
    for e in &executions {
        by_key.entry(e.key.as_str()).or_default().push(e);
    }
    let doubles: Vec<_> = by_key
        .iter()
        .filter(|(_, v)| v.len() > 1)
        .map(|(k, v)| (*k, v.len()))
        .collect();
    r.check("the provider executed each job_key at most once", &doubles);

    let ambiguous: HashSet<Uuid> = audit::jobs_that_failed_with(ledger.pool(), "provider_no_answer")
        .await?
        .into_iter()
        .collect();
    let mut disagreements = vec![];
    for (job_id, key, state, epoch, token, result) in audit::outcomes(ledger.pool()).await? {
        let key = key.unwrap_or_default();
        let exec = by_key.get(key.as_str()).and_then(|v| v.first());
        match (state.as_str(), exec) {
            ("succeeded", None) => {
                disagreements.push(format!("{key}: succeeded, provider never executed it"))
            }
            ("succeeded", Some(e)) => {
                let named = result
                    .as_ref()
                    .and_then(|v| v["refund_id"].as_str())
                    .unwrap_or_default();
                let reconciled = result.as_ref().is_some_and(|v| v["reconciled"] == json!(true));
                let token = token.unwrap_or(-1);
                if e.job_id != job_id.to_string() {
                    disagreements.push(format!("{key}: the provider executed it for job {}", e.job_id));
                }
                if named != e.refund_id {
                    disagreements.push(format!(
                        "{key}: result names {named}, provider executed {}",
                        e.refund_id
                    ));
                }
                if e.epoch != epoch || e.token > token {
                    disagreements.push(format!(
                        "{key}: executed by ({}, {}) but success written by ({epoch}, {token})",
                        e.epoch, e.token
                    ));
                } else if e.token < token && !reconciled {
                    disagreements.push(format!("{key}: a later token succeeded without reconciling"));
                }
                if reconciled {
                    r.reconciled_successes += 1;
                }
            }
            (_, Some(_)) if ambiguous.contains(&job_id) => r.executed_not_succeeded_after_lost_answer += 1,
            (s, Some(e)) => disagreements.push(format!("{key}: {s} but executed as {}", e.refund_id)),
            _ => {}
        }
    }
    r.check("the provider log and the event log agree", &disagreements);
    Ok(())
}

pub async fn mirror_equals_jobs(ledger: &Ledger, mirror: &sqlx::PgPool, r: &mut Report) -> Result<()> {
    let diff = mirror_matches(ledger, mirror).await?;
    r.check("the status mirror equals jobledger.jobs", &diff);
    Ok(())
}

/// The JSON lines a process printed on a graceful exit (its counters).
pub fn process_outputs(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    Value::Array(
        text.lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect(),
    )
}

/// Counters of every graceful exit of several processes, summed by field.
pub fn process_outputs_sum(paths: impl Iterator<Item = PathBuf>) -> Value {
    let mut sum: BTreeMap<String, i64> = BTreeMap::new();
    for p in paths {
        if let Value::Array(lines) = process_outputs(&p) {
            for l in lines {
                for (k, v) in l.as_object().into_iter().flatten() {
                    *sum.entry(k.clone()).or_default() += v.as_i64().unwrap_or(0);
                }
            }
        }
    }
    json!(sum)
}
