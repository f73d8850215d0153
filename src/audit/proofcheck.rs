//! `audit --proof`: a proof file checked offline against the public key.

use ed25519_dalek::VerifyingKey;
use std::path::Path;

use super::prove::{ConsistencyProof, InclusionProof};
use super::{io, AuditError, AuditResult};
use crate::domain::merkle::{event_leaf, verify_consistency, verify_inclusion, Hash};
use crate::store::EventRow;

/// Checks a proof file (`prove`'s output) offline against `pubkey`.
pub fn audit_proof(path: &Path, pubkey: &VerifyingKey) -> AuditResult<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| AuditError::BadInput(format!("{}: {e}", path.display())))?;
    let bad = |e: serde_json::Error| AuditError::BadInput(format!("{}: {e}", path.display()));
    match v.get("proof").and_then(|p| p.as_str()) {
        Some("inclusion") => Ok(inclusion(&serde_json::from_value(v).map_err(bad)?, pubkey)),
        Some("consistency") => Ok(consistency(&serde_json::from_value(v).map_err(bad)?, pubkey)),
        _ => Err(AuditError::BadInput(format!("{}: not a proof", path.display()))),
    }
}

fn hashes(path: &[String]) -> Option<Vec<Hash>> {
    path.iter()
        .map(|h| hex::decode(h).ok()?.try_into().ok())
        .collect()
}

fn inclusion(p: &InclusionProof, key: &VerifyingKey) -> Vec<String> {
    let mut out = vec![];
    let head = &p.head.checkpoint;
    if let Err(e) = head.verify(key) {
        out.push(format!("checkpoint v{}: {e}", p.head.version));
    }
    let Some(root) = head.head.root_bytes() else {
        out.push("the head's root is not 32 bytes of hex".into());
        return out;
    };
    let mut prev: Option<&EventRow> = None;
    let events: Vec<(u64, &[String], EventRow)> = p
        .events
        .iter()
        .map(|e| {
            let mut r = e.event.clone();
            r.position = e.position;
            (e.leaf_index, e.path.as_slice(), r)
        })
        .collect();
    // The job's events from version 1, each once, in order. A version may
    // be missing only if the proof says it came after the head (log order
    // is by transaction, so version n + 1 can be in a tree that n is not):
    // an inclusion proof shows what it carries is in the tree; it cannot
    // show that nothing else of the job is.
    let versions: Vec<i64> = events.iter().map(|(_, _, r)| r.version).collect();
    if versions.first().is_some_and(|v| *v != 1) || versions.windows(2).any(|w| w[1] <= w[0]) {
        out.push(format!(
            "the proof's events are not the job's versions from 1, each once, in order: {versions:?}"
        ));
    }
    let missing = versions
        .last()
        .map_or(0, |l| (*l as usize).saturating_sub(versions.len()));
    if missing > p.after_head.len() {
        out.push(format!(
            "{missing} of the job's versions up to v{} are neither proved nor said to come after the head",
            versions.last().copied().unwrap_or(0)
        ));
    }
    if events.is_empty() && p.after_head.is_empty() {
        out.push("the proof carries no event".into());
    }
    for (leaf_index, path, r) in &events {
        let at = format!("position {}", r.position);
        if r.job_id != p.job_id {
            out.push(format!("{at}: an event of job {}, not {}", r.job_id, p.job_id));
        }
        if r.stored_hash() != r.hash {
            out.push(format!("{at}: hash mismatch"));
        }
        if let Some(q) = prev.filter(|q| q.version + 1 == r.version) {
            if r.prev_hash.as_deref() != Some(q.hash.as_str()) {
                out.push(format!("{at}: does not link to version {}", q.version));
            }
        }
        let leaf = event_leaf(r.position, &r.hash);
        let ok = hashes(path)
            .is_some_and(|path| verify_inclusion(&leaf, *leaf_index, head.head.tree_size, &path, &root));
        if !ok {
            out.push(format!(
                "{at}: not in the tree of {} leaves that checkpoint v{} signed",
                head.head.tree_size, p.head.version
            ));
        }
        prev = Some(r);
    }
    out
}

fn consistency(p: &ConsistencyProof, key: &VerifyingKey) -> Vec<String> {
    let mut out = vec![];
    for h in [&p.old, &p.new] {
        if let Err(e) = h.checkpoint.verify(key) {
            out.push(format!("checkpoint v{}: {e}", h.version));
        }
    }
    let (old, new) = (&p.old.checkpoint.head, &p.new.checkpoint.head);
    let ok = match (old.root_bytes(), new.root_bytes(), hashes(&p.path)) {
        (Some(a), Some(b), Some(path)) => {
            old.log_id == new.log_id && verify_consistency(old.tree_size, new.tree_size, &a, &b, &path)
        }
        _ => false,
    };
    if !ok {
        out.push(format!(
            "checkpoint v{} ({} leaves) is not shown to extend v{} ({} leaves)",
            p.new.version, new.tree_size, p.old.version, old.tree_size
        ));
    }
    out
}
