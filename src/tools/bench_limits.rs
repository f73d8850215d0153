//! `bench --only limits`: what admission control costs the drain (issue
//! 13). W3 (16 handlers, no-op jobs) on a queue without controls, on one
//! whose jobs carry concurrency keys under a limit that does not bind, on
//! one with a rate limit that does not bind, and on one where the cap binds
//! (4 keys x 2 leases for 16 handlers: throughput under the limit). Rounds
//! alternate so the machine's drift falls on all of them alike; every
//! figure is checked against the database's count before it prints.

use anyhow::{ensure, Result};
use serde_json::json;
use std::time::Duration;

use super::bench::{drain, job, noop_worker, report};
use jobledger::domain::JobState;
use jobledger::ledger::Ledger;

const ROUNDS: usize = 3;

pub async fn limits(ledger: &Ledger, n: usize) -> Result<()> {
    let mut by: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
    for round in 0..ROUNDS {
        for (shape, keys) in [("none", 0), ("keyed", 64), ("rated", 0), ("binding", 4)] {
            let queue = format!("limits-{shape}-{round}");
            match shape {
                "keyed" => {
                    ledger
                        .set_concurrency_limit(&queue, "cap", None, None, 16, "bench", "does not bind")
                        .await?;
                }
                "binding" => {
                    ledger
                        .set_concurrency_limit(&queue, "cap", None, None, 2, "bench", "binds")
                        .await?;
                }
                "rated" => {
                    ledger
                        .set_rate_limit(
                            &queue,
                            1_000_000,
                            Duration::from_secs(1),
                            "bench",
                            "does not bind",
                        )
                        .await?;
                }
                _ => {}
            }
            let jobs = if shape == "binding" { n / 5 } else { n };
            enqueue_keyed(ledger, &queue, jobs, keys).await?;
            let took = drain(noop_worker(ledger, &queue, 16, None)?, jobs).await?;
            let done = ledger
                .counts_by_state_in(&queue)
                .await?
                .into_iter()
                .find(|(s, _)| *s == JobState::Succeeded.as_str())
                .map_or(0, |(_, c)| c);
            ensure!(done as usize == jobs, "{queue}: {done} of {jobs} succeeded");
            let rate = jobs as f64 / took.as_secs_f64();
            by.entry(shape).or_default().push(rate);
            report(
                &format!("W3 limits: {shape}"),
                jobs,
                took,
                json!({ "round": round, "keys": keys }),
            );
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&by["none"]);
    println!(
        "{}",
        json!({ "workload": "W3 limits: median jobs/s and ratio to no limits", "rounds": ROUNDS,
                "none": base.round(), "keyed": median(&by["keyed"]).round(), "rated": median(&by["rated"]).round(),
                "binding_4x2": median(&by["binding"]).round(),
                "keyed_ratio": (median(&by["keyed"]) / base * 100.0).round() / 100.0,
                "rated_ratio": (median(&by["rated"]) / base * 100.0).round() / 100.0 })
    );
    Ok(())
}

/// `n` no-op jobs in batches of 1,000; with `keys`, spread over that many
/// concurrency keys.
async fn enqueue_keyed(ledger: &Ledger, queue: &str, n: usize, keys: usize) -> Result<()> {
    for start in (0..n).step_by(1000) {
        let batch = (start..(start + 1000).min(n))
            .map(|i| {
                let mut j = job(queue, i);
                j.concurrency_key = (keys > 0).then(|| format!("k{}", i % keys));
                j
            })
            .collect();
        ledger.enqueue_many_as(batch, "bench").await?;
    }
    Ok(())
}
