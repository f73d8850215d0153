//! `bench --only workflows`: 1,000 workflows of 10 steps, half a chain and
//! half a fan-out/fan-in (one root, eight in parallel, one join), created
//! and drained by one 16-way worker; per-step throughput against W3 run in
//! the same process on as many plain jobs. Every step still gets its
//! events, hash chain and fence, and every end its parent's event.

use anyhow::Result;
use serde_json::json;
use std::time::Instant;

use super::bench::{drain, enqueue_batched, noop_worker, report};
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

fn spec(i: usize, queue: &str) -> WorkflowSpec {
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
        key: Some(format!("wf-{i}")),
        payload: json!(null),
        steps,
        finally: None,
    }
}

pub async fn workflows(ledger: &Ledger, n: usize) -> Result<()> {
    let steps = n * 10;
    // The reference: W3 on as many plain jobs, in this same run.
    enqueue_batched(ledger, "wf-w3", steps).await?;
    let plain = drain(noop_worker(ledger, "wf-w3", 16, None)?, steps).await?;
    let plain_rate = steps as f64 / plain.as_secs_f64();
    report(
        "W3 drain no-op jobs, 16-way (reference for workflows)",
        steps,
        Instant::now() - plain,
        json!({}),
    );

    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..4 {
        let l = ledger.clone();
        tasks.spawn(async move {
            for i in (c..n).step_by(4) {
                l.workflow(&spec(i, "wf")).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    report(
        "workflows created, 10 steps each, 4 clients",
        n,
        started,
        json!({ "steps": steps, "steps_per_s": (steps as f64 / started.elapsed().as_secs_f64()).round() }),
    );
    let took = drain(noop_worker(ledger, "wf", 16, None)?, steps).await?;
    let rate = steps as f64 / took.as_secs_f64();
    report(
        "workflow steps drained (chains and fan-out/fan-in), 16-way",
        steps,
        Instant::now() - took,
        json!({ "workflows": n, "of_w3": (rate / plain_rate * 100.0).round() / 100.0 }),
    );
    Ok(())
}
