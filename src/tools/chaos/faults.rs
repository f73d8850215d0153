//! The chaos window: jobs are enqueued at a steady rate (and some cancelled)
//! while faults hit the processes, the broker and the database.

use anyhow::Result;
use nix::sys::signal::{kill, Signal};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::json;
use std::time::{Duration, Instant};
use uuid::Uuid;

use super::{procs, Cluster, Plan, QUEUE};
use jobledger::domain::workflow::{DependencyPolicy, StepSpec, WorkflowSpec};
use jobledger::domain::{NewJob, Policy};
use jobledger::ledger::Ledger;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FaultCounts {
    pub worker_kill9: u32,
    pub worker_sigstop: u32,
    pub relay_restart: u32,
    pub relay_kill9: u32,
    pub mirror_kill9: u32,
    pub broker_sigstop: u32,
    pub broker_restart: u32,
    pub pg_restart: u32,
    pub pg_restart_failed: u32,
    /// Processes that died without being killed (crashes): must stay 0.
    pub unexpected_exits: u32,
    pub enqueue_retries: u64,
    pub cancels_requested: u64,
}

/// An enqueued job as its caller saw it.
#[derive(Clone, Debug)]
pub struct Enqueued {
    pub job_id: Uuid,
}

fn new_job(i: usize) -> NewJob {
    NewJob {
        queue: QUEUE.into(),
        kind: "refund".into(),
        job_key: Some(format!("r-{i:06}")),
        payload: json!({ "order": format!("ord-{i}"), "amount_cents": 100 + i % 9_000, "refuse": i % 67 == 13 }),
        priority: 0,
        run_at: None,
        delay_ms: None,
        policy: Some(Policy {
            max_attempts: 15,
            backoff_base_ms: 50,
            backoff_cap_ms: 1_000,
            ..Policy::default()
        }),
        concurrency_key: Some(super::admission::merchant_of(i)),
        unique_for_ms: None,
    }
}

/// Jobs `i..i+3` of every 30 are the steps of one workflow, a chain: 10 % of
/// the refunds run in workflows (parent kind `refund_batch`, key `wf-<i>`).
fn workflow_at(i: usize, jobs: usize) -> Option<WorkflowSpec> {
    if i % 30 != 0 || i + 3 > jobs {
        return None;
    }
    let steps = (i..i + 3)
        .map(|j| {
            let n = new_job(j);
            StepSpec {
                name: format!("s{}", j - i),
                queue: None,
                kind: n.kind,
                key: n.job_key,
                payload: n.payload,
                after: if j == i {
                    vec![]
                } else {
                    vec![format!("s{}", j - i - 1)]
                },
                on_dependency_failure: DependencyPolicy::Cancel,
                priority: 0,
                policy: n.policy,
            }
        })
        .collect();
    Some(WorkflowSpec {
        queue: QUEUE.into(),
        name: "refund_batch".into(),
        key: Some(format!("wf-{i:06}")),
        payload: json!({ "first": i }),
        steps,
        finally: None,
    })
}

/// Enqueues `plan.jobs` over the window; an enqueue whose answer was lost
/// (the database restarted) is simply repeated: the key makes it the same
/// job (or workflow). Cancels a few jobs at random moments, as an operator
/// would (a workflow's waiting step too; a parent refuses a plain cancel).
async fn enqueue_all(ledger: Ledger, plan: Plan) -> (Vec<Enqueued>, u64, u64) {
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 0xe9);
    let per_tick = plan.jobs.div_ceil((plan.window_s.max(1) * 10) as usize).max(1);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let (mut out, mut retries, mut cancels) = (Vec::with_capacity(plan.jobs), 0u64, 0u64);
    for chunk in (0..plan.jobs).collect::<Vec<_>>().chunks(per_tick) {
        tick.tick().await;
        for &i in chunk {
            if i % 30 < 3 && i - i % 30 + 3 <= plan.jobs {
                if let Some(spec) = workflow_at(i, plan.jobs) {
                    let c = loop {
                        match ledger.workflow(&spec).await {
                            Ok(c) => break c,
                            Err(err) => {
                                retries += 1;
                                tracing::info!("chaos: workflow wf-{i:06} failed ({err}); repeating");
                                tokio::time::sleep(Duration::from_millis(200)).await;
                            }
                        }
                    };
                    out.push(Enqueued {
                        job_id: c.parent.job.job_id,
                    });
                    out.extend(c.steps.iter().map(|(_, e)| Enqueued { job_id: e.job.job_id }));
                }
                continue;
            }
            let new = new_job(i);
            let e = loop {
                match ledger.enqueue(new.clone()).await {
                    Ok(e) => break e,
                    Err(err) => {
                        retries += 1;
                        tracing::info!("chaos: enqueue r-{i:06} failed ({err}); repeating");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            };
            out.push(Enqueued { job_id: e.job.job_id });
            // A recent job: likely still queued or running, so the cancel
            // meets a live job (before start, during execution, mid-retry).
            if rng.gen_bool(0.03) {
                let victim = out[rng.gen_range(out.len().saturating_sub(20)..out.len())].job_id;
                if let Ok(w) = ledger.cancel(victim, Some("chaos: operator cancel")).await {
                    cancels += u64::from(w.committed());
                }
            }
        }
    }
    (out, retries, cancels)
}

/// Runs the window: enqueues, injects faults, restarts what crashed. Leaves
/// every process running and unfrozen.
pub async fn inject(ledger: &Ledger, plan: &Plan, c: &mut Cluster) -> Result<(Vec<Enqueued>, FaultCounts)> {
    let mut n = FaultCounts::default();
    let mut rng = StdRng::seed_from_u64(plan.seed ^ 0xfa);
    let enqueuer = tokio::spawn(enqueue_all(ledger.clone(), plan.clone()));
    let start = Instant::now();
    let window = Duration::from_secs(plan.window_s);
    let every = Duration::from_millis(plan.fault_every_ms);
    let stall = Duration::from_millis(plan.lease_ms + 1_500);
    let mut next = start + every;
    let mut frozen_until = vec![start; c.workers.len()];
    let mut fault_no = 0u32;
    let (mut broker_stalled, mut pg_done, mut broker_restarted) =
        (false, !plan.pg_restart, !plan.broker_restart);
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        restart_crashed(c, &mut n)?;
        let frac = start.elapsed().as_secs_f64() / window.as_secs_f64();
        if !broker_stalled && frac >= 0.3 {
            super::say!("chaos: SIGSTOP broker for {}s", plan.broker_stall_s);
            c.broker.signal(Signal::SIGSTOP);
            tokio::time::sleep(Duration::from_secs(plan.broker_stall_s)).await;
            c.broker.signal(Signal::SIGCONT);
            n.broker_sigstop += 1;
            broker_stalled = true;
        }
        if !pg_done && frac >= 0.55 {
            match procs::restart_postgres(c.pg_port).await {
                Ok(cluster) => {
                    super::say!("chaos: restarted PostgreSQL {cluster}");
                    n.pg_restart += 1;
                }
                Err(e) => {
                    super::say!("chaos: could not restart PostgreSQL: {e:#}");
                    n.pg_restart_failed += 1;
                }
            }
            pg_done = true;
        }
        if !broker_restarted && frac >= 0.75 {
            super::say!("chaos: kill -9 and restart the (durable) broker");
            c.broker.kill9().await;
            c.broker.start()?;
            procs::wait_for_port(c.broker_port, Duration::from_secs(60)).await?;
            n.broker_restart += 1;
            broker_restarted = true;
        }
        let now = Instant::now();
        if now >= next && now < start + window {
            next += every;
            // Every kind once first (short runs too), then at random.
            let roll: f64 = match fault_no {
                0 => 0.0,
                1 => 0.5,
                2 => 0.8,
                3 => 0.95,
                _ => rng.gen(),
            };
            fault_no += 1;
            let i = rng.gen_range(0..c.workers.len());
            if roll < 0.35 {
                super::say!("chaos: kill -9 {}", c.workers[i].name);
                c.workers[i].kill9().await;
                c.workers[i].start()?;
                n.worker_kill9 += 1;
            } else if roll < 0.7 {
                if frozen_until[i] > now {
                    continue;
                }
                let Some(pid) = c.workers[i].pid() else { continue };
                super::say!("chaos: SIGSTOP {} for {stall:?}", c.workers[i].name);
                let _ = kill(pid, Signal::SIGSTOP);
                frozen_until[i] = now + stall;
                tokio::spawn(async move {
                    tokio::time::sleep(stall).await;
                    let _ = kill(pid, Signal::SIGCONT);
                });
                n.worker_sigstop += 1;
            } else if roll < 0.9 {
                if n.relay_restart % 2 == 0 {
                    super::say!("chaos: restart the relay (SIGTERM)");
                    c.relay.stop(Duration::from_secs(10)).await;
                } else {
                    super::say!("chaos: kill -9 the relay");
                    c.relay.kill9().await;
                    n.relay_kill9 += 1;
                }
                c.relay.start()?;
                n.relay_restart += 1;
            } else {
                super::say!("chaos: kill -9 the status-mirror consumer");
                c.mirror.kill9().await;
                c.mirror.start()?;
                n.mirror_kill9 += 1;
            }
        }
        if enqueuer.is_finished() && now >= start + window && broker_stalled && pg_done && broker_restarted {
            break;
        }
    }
    for w in &c.workers {
        w.signal(Signal::SIGCONT);
    }
    let (enqueued, retries, cancels) = enqueuer.await?;
    n.enqueue_retries = retries;
    n.cancels_requested = cancels;
    Ok((enqueued, n))
}

/// A process that exited without being told to is a crash: counted (the
/// checker fails the run on it) and restarted, as a supervisor would.
fn restart_crashed(c: &mut Cluster, n: &mut FaultCounts) -> Result<()> {
    for p in c.workers.iter_mut().chain([&mut c.relay, &mut c.mirror]) {
        if let Some(status) = p.exited() {
            super::say!("chaos: {} exited on its own ({status}); restarting it", p.name);
            n.unexpected_exits += 1;
            p.start()?;
        }
    }
    Ok(())
}
