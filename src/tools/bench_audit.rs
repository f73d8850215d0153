//! `bench --only audit` (issue 14): on a log of about `--history-events`
//! events, the checkpointer's catch-up, `export`, the offline `audit` of the
//! export (events/s), `prove` latency, and W3 with a checkpointer signing
//! every 10,000 events next to W3 without one, in alternating rounds.
//! Every figure is checked before it is printed: the audit finds nothing,
//! every proof checks offline, every W3 job succeeded.

use anyhow::{ensure, Context, Result};
use ed25519_dalek::SigningKey;
use serde_json::json;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::tools::bench::{drain, enqueue_batched, history, noop_worker, report};
use jobledger::audit::checkpointer::{CheckpointConfig, Checkpointer};
use jobledger::audit::offline::Auditor;
use jobledger::audit::proofcheck::audit_proof;
use jobledger::ledger::Ledger;

/// W3 rounds with and without a checkpointer: the effect measured is a few
/// per cent, the VM's round-to-round spread ±20 %, so many rounds, the
/// order alternating within each.
const ROUNDS: usize = 7;

pub async fn audit(ledger: &Ledger, history_events: usize, w3_jobs: usize) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("jobledger-bench-audit-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run(ledger, history_events, w3_jobs, &dir).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn run(ledger: &Ledger, history_events: usize, w3_jobs: usize, dir: &std::path::Path) -> Result<()> {
    let key = SigningKey::from_bytes(&rand::random());
    let public = key.verifying_key();
    history(ledger, history_events).await?;
    let checkpointer = Checkpointer::new(ledger.clone(), key.clone(), CheckpointConfig::default());
    let started = Instant::now();
    let step = checkpointer.checkpoint_now().await?;
    let leaves = step.tree_size as usize;
    report(
        "checkpointer catch-up: blocks stored, head signed",
        leaves,
        started.elapsed(),
        json!({ "blocks": step.blocks }),
    );

    let file = dir.join("log.zst");
    let started = Instant::now();
    let exported = ledger.export(0, None, &file).await?;
    let n = exported.manifest.events as usize;
    report(
        "export, zstd NDJSON",
        n,
        started.elapsed(),
        json!({ "bytes": exported.bytes }),
    );

    let started = Instant::now();
    let mut findings = 0u64;
    let mut auditor = Auditor::new(Some(public), |_| findings += 1);
    auditor.segment(&file)?;
    let audited = auditor.finish();
    ensure!(
        audited.findings == 0 && audited.events as usize == n,
        "the audit found {} problems",
        audited.findings
    );
    report(
        "audit of the export, offline (hashes, replay, Merkle root, signed heads)",
        n,
        started.elapsed(),
        json!({ "events_per_s": (n as f64 / started.elapsed().as_secs_f64()).round(), "jobs_in_log": audited.jobs }),
    );

    prove_latency(ledger, &public, dir).await?;
    checkpoint_cost(ledger, key, w3_jobs).await
}

/// `prove` for random jobs under the latest head; each proof checked offline.
async fn prove_latency(
    ledger: &Ledger,
    public: &ed25519_dalek::VerifyingKey,
    dir: &std::path::Path,
) -> Result<()> {
    let ids: Vec<uuid::Uuid> = ledger
        .states_in("history")
        .await?
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    ensure!(!ids.is_empty(), "no jobs to prove");
    let mut ms = vec![];
    for i in 0..200 {
        let id = ids[rand::random::<usize>() % ids.len()];
        let t = Instant::now();
        let proof = ledger.prove_job(id).await?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        if i % 20 == 0 {
            let f = dir.join("proof.json");
            std::fs::write(&f, serde_json::to_vec(&proof)?)?;
            ensure!(audit_proof(&f, public)?.is_empty(), "a proof did not check");
            ensure!(!proof.events.is_empty(), "a proof proved nothing");
        }
    }
    ms.sort_by(f64::total_cmp);
    let pct = |p: f64| ms[((ms.len() as f64 - 1.0) * p).round() as usize];
    println!(
        "{}",
        json!({ "workload": "prove JOB under the latest signed head", "samples": ms.len(),
                "events_in_log": ledger.count_events_total().await?,
                "p50_ms": (pct(0.5) * 100.0).round() / 100.0, "p99_ms": (pct(0.99) * 100.0).round() / 100.0,
                "max_ms": (pct(1.0) * 100.0).round() / 100.0 })
    );
    Ok(())
}

/// W3 with a checkpointer running (signing every 10,000 events) against W3
/// without one, alternating rounds on the same log.
async fn checkpoint_cost(ledger: &Ledger, key: SigningKey, jobs: usize) -> Result<()> {
    let mut ratios = vec![];
    for round in 0..ROUNDS {
        let (plain, with) = if round % 2 == 0 {
            let p = w3_round(ledger, &format!("ck-off-{round}"), jobs, None).await?;
            (
                p,
                w3_round(ledger, &format!("ck-on-{round}"), jobs, Some(key.clone())).await?,
            )
        } else {
            let w = w3_round(ledger, &format!("ck-on-{round}"), jobs, Some(key.clone())).await?;
            (w3_round(ledger, &format!("ck-off-{round}"), jobs, None).await?, w)
        };
        ratios.push(with / plain);
        println!(
            "{}",
            json!({ "workload": "W3 with a checkpointer against without", "round": round,
                    "without_jobs_per_s": plain.round(), "with_jobs_per_s": with.round(),
                    "ratio": (with / plain * 100.0).round() / 100.0 })
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "{}",
        json!({ "workload": "W3 with a checkpointer, median of the rounds", "rounds": ROUNDS,
                "of_w3": (ratios[ROUNDS / 2] * 100.0).round() / 100.0 })
    );
    Ok(())
}

async fn w3_round(ledger: &Ledger, queue: &str, n: usize, key: Option<SigningKey>) -> Result<f64> {
    enqueue_batched(ledger, queue, n).await?;
    let stop = CancellationToken::new();
    let signer = key.map(|k| {
        // The defaults a deployment runs: sign every 10,000 events, look
        // at the log every 500 ms.
        let c = Checkpointer::new(ledger.clone(), k, CheckpointConfig::default());
        let s = stop.clone();
        tokio::spawn(async move { c.run(s).await })
    });
    let took = drain(noop_worker(ledger, queue, 16, None)?, n).await?;
    stop.cancel();
    if let Some(s) = signer {
        s.await.context("checkpointer")??;
    }
    Ok(n as f64 / took.as_secs_f64())
}
