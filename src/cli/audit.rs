//! The auditor's commands (docs/audit.md): keygen, checkpoint,
//! checkpointer, export, prove, audit. A thin adapter over `jobledger::audit`.

use anyhow::{Context, Result};
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;

use super::output::{self, line, BadInput};
use super::parse;
use jobledger::audit::checkpointer::{CheckpointConfig, Checkpointer};
use jobledger::audit::offline::Auditor;
use jobledger::audit::proofcheck::audit_proof;
use jobledger::audit::{keys, AuditError};
use jobledger::ledger::Ledger;

#[derive(clap::Args, Debug)]
pub struct KeygenArgs {
    /// Where to write the secret key (mode 0600); the public key goes to
    /// the same name with `.pub`.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(clap::Args, Debug)]
pub struct CheckpointArgs {
    /// The secret key file (`jobledger keygen`).
    #[arg(long)]
    pub key: PathBuf,
    /// Sign once this many events joined the tree since the last head...
    #[arg(long, default_value_t = 10_000)]
    pub every: u64,
    /// ...or this long after it (if the log grew).
    #[arg(long, value_parser = parse::duration, default_value = "60s")]
    pub interval: Duration,
}

#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// First leaf (log order) to export.
    #[arg(long, default_value_t = 0)]
    pub from: u64,
    /// Leaf to stop before [default: the log's end as of now].
    #[arg(long)]
    pub to: Option<u64>,
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(clap::Args, Debug)]
pub struct ProveArgs {
    /// The job whose events to prove included under the latest signed head.
    pub job: Option<uuid::Uuid>,
    /// Prove that checkpoint NEW extends checkpoint OLD (log stream versions).
    #[arg(long, num_args = 2, value_names = ["OLD", "NEW"], conflicts_with = "job")]
    pub consistency: Option<Vec<i64>>,
}

#[derive(clap::Args, Debug)]
pub struct AuditArgs {
    /// Exported segments, in log order.
    pub files: Vec<PathBuf>,
    /// A proof file (`jobledger prove`) to check instead.
    #[arg(long, conflicts_with = "files")]
    pub proof: Option<PathBuf>,
    /// The public key that signs the checkpoints (required with --proof).
    #[arg(long)]
    pub pubkey: Option<PathBuf>,
    /// A signed head you hold from outside these files (a relayed
    /// checkpoint message, a proof): the log must still have it. Repeatable.
    #[arg(long)]
    pub head: Vec<PathBuf>,
}

/// What is a user's mistake (exit 2) and what is not.
fn code(e: AuditError) -> anyhow::Error {
    match e {
        AuditError::BadInput(m) | AuditError::Key(m) | AuditError::Unanswerable(m) => BadInput(m).into(),
        // A file the user named that cannot be read or written.
        e @ AuditError::Io { .. } => BadInput(e.to_string()).into(),
        other => other.into(),
    }
}

/// `keygen` and `audit` need no database.
pub fn offline(keygen: Option<&KeygenArgs>, audit: Option<&AuditArgs>) -> Result<Option<i32>> {
    if let Some(k) = keygen {
        let (key_id, public) = keys::keygen(&k.out).map_err(code)?;
        line(&json!({ "key_id": key_id, "secret": k.out, "public": public }));
        return Ok(Some(output::OK));
    }
    let Some(a) = audit else { return Ok(None) };
    let pubkey = a
        .pubkey
        .as_deref()
        .map(keys::public_key)
        .transpose()
        .map_err(code)?;
    if let Some(proof) = &a.proof {
        let key = pubkey.ok_or_else(|| BadInput("--proof needs --pubkey".into()))?;
        let findings = audit_proof(proof, &key).map_err(code)?;
        for f in &findings {
            line(&json!({ "finding": f }));
        }
        line(&json!({ "ok": findings.is_empty(), "proof": proof, "findings": findings.len() }));
        return Ok(Some(if findings.is_empty() {
            output::OK
        } else {
            output::FAILURE
        }));
    }
    if a.files.is_empty() {
        return Err(BadInput("name the exported segments to audit, or --proof FILE".into()).into());
    }
    // Findings print above the bar (known once it exists), not through it.
    let bar = std::sync::OnceLock::<indicatif::ProgressBar>::new();
    let mut auditor = Auditor::new(pubkey, |f| {
        let print = || line(&json!({ "finding": f }));
        match bar.get() {
            Some(b) => b.suspend(print),
            None => print(),
        }
    });
    let progress = auditor.progress();
    let size: u64 = a
        .files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    progress.total.store(size, std::sync::atomic::Ordering::Relaxed);
    let ticker = output::Ticker::start(progress, "bytes", true);
    if let Some(b) = ticker.bar() {
        let _ = bar.set(b);
    }
    for h in &a.head {
        let cp = jobledger::audit::offline::read_head(h).map_err(code)?;
        auditor.hold(&h.display().to_string(), cp);
    }
    for f in &a.files {
        auditor.segment(f).map_err(code)?;
    }
    drop(ticker);
    let report = auditor.finish();
    let ok = report.findings == 0;
    line(&json!({ "ok": ok, "report": report }));
    Ok(Some(if ok { output::OK } else { output::FAILURE }))
}

pub async fn checkpoint(ledger: &Ledger, a: &CheckpointArgs, once: bool) -> Result<i32> {
    let key = keys::signing_key(&a.key).map_err(code)?;
    let cfg = CheckpointConfig {
        every: a.every,
        interval: a.interval,
        ..CheckpointConfig::default()
    };
    let c = Checkpointer::new(ledger.clone(), key, cfg);
    if once {
        let step = c.checkpoint_now().await.map_err(code)?;
        line(&json!(step));
        return Ok(output::OK);
    }
    let stop = tokio_util::sync::CancellationToken::new();
    jobledger::worker::cancel_on_signals(stop.clone());
    c.run(stop).await.map_err(code)?;
    line(&json!({ "stopped": true }));
    Ok(output::OK)
}

pub async fn export(ledger: &Ledger, a: &ExportArgs) -> Result<i32> {
    let progress = std::sync::Arc::new(jobledger::audit::Progress::default());
    let ticker = output::Ticker::start(progress.clone(), "events", false);
    let done = ledger
        .export_tracked(a.from, a.to, &a.out, ticker.drawing().then_some(&*progress))
        .await
        .map_err(code);
    drop(ticker);
    let done = done?;
    line(&json!(done));
    Ok(output::OK)
}

pub async fn prove(ledger: &Ledger, a: &ProveArgs) -> Result<i32> {
    let proof = match (&a.job, &a.consistency) {
        (Some(job), None) => serde_json::to_value(ledger.prove_job(*job).await.map_err(code)?)?,
        (None, Some(v)) => serde_json::to_value(ledger.prove_consistency(v[0], v[1]).await.map_err(code)?)?,
        _ => return Err(BadInput("prove JOB, or prove --consistency OLD NEW".into()).into()),
    };
    println!("{}", serde_json::to_string(&proof).context("proof")?);
    Ok(output::OK)
}
