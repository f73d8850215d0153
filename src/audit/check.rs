//! `verify`'s look at the tree: the log walked in log order, its leaves
//! against the stored blocks (naming the first leaf that differs), its root
//! at every signed checkpoint's size against the signed root, and the
//! checkpoints' own chain and signatures (with the public key, if given).

use ed25519_dalek::VerifyingKey;
use sqlx::PgConnection;
use std::collections::BTreeMap;

use super::tree::{block_leaves, leaf_of};
use super::AuditResult;
use crate::domain::checkpoint::{Checkpoint, LOG_STREAM};
use crate::domain::merkle::{root_of, Frontier, Hash, BLOCK_LEAVES};
use crate::ledger::Problem;
use crate::store::merkle::{self, BlockRow};

fn problem(version: Option<i64>, position: Option<i64>, detail: String) -> Problem {
    Problem {
        job_id: LOG_STREAM,
        version,
        position,
        detail,
    }
}

/// What the walk found: leaves walked and the problems.
#[derive(Debug, Default)]
pub struct TreeCheck {
    pub leaves: u64,
    pub blocks: u64,
    pub checkpoints: u64,
    pub problems: Vec<Problem>,
}

/// A signed head to hold the log to: one of the log's own checkpoints
/// (its version and position), or one the auditor holds from outside.
struct Due {
    label: String,
    version: Option<i64>,
    position: Option<i64>,
    checkpoint: Checkpoint,
}

/// Walks the log in log order, in the caller's snapshot. `held`: heads the
/// auditor holds from outside the database (`verify --head`): the log must
/// still have them, whatever happened to its own checkpoints.
pub async fn check_tree(
    conn: &mut PgConnection,
    key: Option<&VerifyingKey>,
    held: &[Checkpoint],
) -> AuditResult<TreeCheck> {
    let mut out = TreeCheck::default();
    let mut due: BTreeMap<u64, Vec<Due>> = BTreeMap::new();
    for cp in held {
        if let Some(Err(e)) = key.map(|k| cp.verify(k)) {
            out.problems
                .push(problem(None, None, format!("the head you hold: {e}")));
        }
        let d = Due {
            label: "the head you hold".into(),
            version: None,
            position: None,
            checkpoint: cp.clone(),
        };
        due.entry(cp.head.tree_size).or_default().push(d);
    }
    let mut prev: Option<String> = None;
    for (_, row) in merkle::log_stream(&mut *conn, LOG_STREAM).await? {
        let (v, p) = (Some(row.version), Some(row.position));
        if row.stored_hash() != row.hash {
            out.problems
                .push(problem(v, p, "checkpoint event: hash mismatch".into()));
        }
        if row.prev_hash != prev {
            out.problems.push(problem(
                v,
                p,
                "checkpoint event does not link to the one before".into(),
            ));
        }
        prev = Some(row.hash.clone());
        let Some(cp) = Checkpoint::from_data(&row.data) else {
            out.problems
                .push(problem(v, p, "checkpoint event is unreadable".into()));
            continue;
        };
        if let Some(k) = key {
            if let Err(e) = cp.verify(k) {
                out.problems
                    .push(problem(v, p, format!("checkpoint v{}: {e}", row.version)));
            }
        }
        out.checkpoints += 1;
        let d = Due {
            label: format!("checkpoint v{}", row.version),
            version: Some(row.version),
            position: Some(row.position),
            checkpoint: cp,
        };
        due.entry(d.checkpoint.head.tree_size).or_default().push(d);
    }
    let mut f = Frontier::new();
    let (mut txid, mut position) = (0i64, 0i64);
    let mut block: Option<(BlockRow, Vec<Hash>)> = None;
    let mut block_broken = false;
    loop {
        let page = merkle::leaves_after(&mut *conn, txid, position, 10_000).await?;
        let Some(last) = page.last() else { break };
        (txid, position) = (last.txid, last.position);
        for l in &page {
            let index = f.size();
            if index % BLOCK_LEAVES == 0 {
                block = merkle::block(&mut *conn, (index / BLOCK_LEAVES) as i64)
                    .await?
                    .map(|b| block_leaves(&b).map(|ls| (b, ls)))
                    .transpose()?;
                block_broken = false;
                if let Some((b, ls)) = &block {
                    if root_of(ls).to_vec() != b.root {
                        out.problems.push(problem(
                            None,
                            None,
                            format!("block {}: its root is not its leaves'", b.block),
                        ));
                    }
                    out.blocks += 1;
                }
            }
            let leaf = leaf_of(l);
            if let Some((b, ls)) = &block {
                let i = (index % BLOCK_LEAVES) as usize;
                if !block_broken && (ls[i] != leaf || b.positions[i] != l.position) {
                    block_broken = true;
                    out.problems.push(problem(
                        None,
                        Some(l.position),
                        format!(
                            "leaf {index} (position {}) is not what the tree recorded there (position {}): \
                             an event was changed, removed or added after it was checkpointed",
                            l.position, b.positions[i]
                        ),
                    ));
                }
            }
            f.push(leaf);
            if let Some(cps) = due.remove(&f.size()) {
                let root = hex::encode(f.root());
                for d in cps.into_iter().filter(|d| d.checkpoint.head.root != root) {
                    let detail = format!(
                        "{} signed root {} over {} leaves; the log's is {root}: \
                         an event up to position {} was changed, removed or added",
                        d.label, d.checkpoint.head.root, d.checkpoint.head.tree_size, l.position
                    );
                    out.problems.push(problem(d.version, d.position, detail));
                }
            }
        }
    }
    out.leaves = f.size();
    for (size, cps) in due {
        for d in cps {
            let detail = format!("{} signs {size} leaves; the log has {}", d.label, f.size());
            out.problems.push(problem(d.version, d.position, detail));
        }
    }
    let stored = match merkle::block_roots(&mut *conn).await {
        Ok(r) => r.len() as u64,
        Err(crate::store::StoreError::Corrupt(d)) => {
            out.problems.push(problem(None, None, d));
            0
        }
        Err(e) => return Err(e.into()),
    };
    if stored * BLOCK_LEAVES > f.size() {
        out.problems.push(problem(
            None,
            None,
            format!(
                "the tree stores {stored} blocks; the log fills {}",
                f.size() / BLOCK_LEAVES
            ),
        ));
    }
    Ok(out)
}
