//! `bench --only workflows`: 1,000 workflows of 10 steps, half a chain and
//! half a fan-out/fan-in (one root, eight in parallel, one join), created
//! and drained by one 16-way worker; per-step throughput against W3 run in
//! the same process on as many plain jobs, in alternating rounds. Every step still gets its
//! events, hash chain and fence, and every end its parent's event.

use anyhow::Result;
use serde_json::json;
use std::time::Instant;

use crate::tools::bench::{drain, enqueue_batched, noop_worker, report};
use jobledger::domain::workflow::{DependencyPolicy, StepSpec, WorkflowSpec};
use jobledger::ledger::Ledger;

fn step(name: String, after: Vec<String>) -> StepSpec {
    StepSpec {
        name,
        queue: None,
        kind: "noop".into(),
        key: None,
        payload: json!({}),
        after,
        on_dependency_failure: DependencyPolicy::Cancel,
        priority: 0,
        policy: None,
    }
}

fn spec(i: usize, round: usize, queue: &str) -> WorkflowSpec {
    let steps = if i % 2 == 0 {
        (0..10)
            .map(|s| {
                step(
                    format!("s{s}"),
                    if s == 0 {
                        vec![]
                    } else {
                        vec![format!("s{}", s - 1)]
                    },
                )
            })
            .collect()
    } else {
        let mut v = vec![step("root".into(), vec![])];
        v.extend((0..8).map(|s| step(format!("p{s}"), vec!["root".into()])));
        v.push(step("join".into(), (0..8).map(|s| format!("p{s}")).collect()));
        v
    };
    WorkflowSpec {
        queue: queue.into(),
        name: "bench".into(),
        key: Some(format!("wf-{round}-{i}")),
        payload: json!(null),
        steps,
        finally: None,
    }
}

/// Rounds of (reference, workflows): this VM's speed wanders by a factor of
/// two over seconds (other guests on the host), so one W3 phase followed by
/// one workflow phase compares two different machines. Alternating them and
/// taking the median of the per-round ratios compares like with like.
const ROUNDS: usize = 5;

pub async fn workflows(ledger: &Ledger, n: usize) -> Result<()> {
    let steps = n * 10;
    let mut ratios = vec![];
    for round in 0..ROUNDS {
        let plain_rate = reference(ledger, &format!("wf-w3-{round}"), steps).await?;
        let queue = format!("wf-{round}");
        let started = Instant::now();
        create(ledger, n, round, &queue).await?;
        report(
            "workflows created, 10 steps each, 4 clients",
            n,
            started.elapsed(),
            json!({ "round": round, "steps": steps,
                    "steps_per_s": (steps as f64 / started.elapsed().as_secs_f64()).round() }),
        );
        let took = drain(noop_worker(ledger, &queue, 16, None)?, steps).await?;
        let rate = steps as f64 / took.as_secs_f64();
        let ratio = rate / plain_rate;
        ratios.push(ratio);
        report(
            "workflow steps drained (chains and fan-out/fan-in), 16-way",
            steps,
            took,
            json!({ "round": round, "workflows": n, "of_w3": (ratio * 100.0).round() / 100.0 }),
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "{}",
        json!({ "workload": "workflow steps against W3, median of the rounds",
                "rounds": ROUNDS, "of_w3": (ratios[ROUNDS / 2] * 100.0).round() / 100.0,
                "min": (ratios[0] * 100.0).round() / 100.0,
                "max": (ratios[ROUNDS - 1] * 100.0).round() / 100.0 })
    );
    Ok(())
}

/// W3 on `steps` plain no-op jobs with the same worker: jobs/s.
async fn reference(ledger: &Ledger, queue: &str, steps: usize) -> Result<f64> {
    enqueue_batched(ledger, queue, steps).await?;
    let plain = drain(noop_worker(ledger, queue, 16, None)?, steps).await?;
    report(
        "W3 drain no-op jobs, 16-way (reference for workflows)",
        steps,
        plain,
        json!({}),
    );
    Ok(steps as f64 / plain.as_secs_f64())
}

/// `n` workflows from 4 clients, one transaction each.
async fn create(ledger: &Ledger, n: usize, round: usize, queue: &str) -> Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..4 {
        let (l, queue) = (ledger.clone(), queue.to_string());
        tasks.spawn(async move {
            for i in (c..n).step_by(4) {
                l.workflow(&spec(i, round, &queue)).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}
