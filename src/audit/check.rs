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

/// Walks the log in log order, in the caller's snapshot.
pub async fn check_tree(conn: &mut PgConnection, key: Option<&VerifyingKey>) -> AuditResult<TreeCheck> {
    let mut out = TreeCheck::default();
    let mut due: BTreeMap<u64, Vec<(i64, i64, Checkpoint)>> = BTreeMap::new();
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
        due.entry(cp.head.tree_size)
            .or_default()
            .push((row.version, row.position, cp));
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
                for (v, p, cp) in cps {
                    if cp.head.root != root {
                        out.problems.push(problem(
                            Some(v),
                            Some(p),
                            format!(
                                "checkpoint v{v} signed root {} over {} leaves; the log's is {root}: \
                                 an event up to position {} was changed, removed or added",
                                cp.head.root, cp.head.tree_size, l.position
                            ),
                        ));
                    }
                }
            }
        }
    }
    out.leaves = f.size();
    for (size, cps) in due {
        for (v, p, _) in cps {
            let d = format!("checkpoint v{v} signs {size} leaves; the log has {}", f.size());
            out.problems.push(problem(Some(v), Some(p), d));
        }
    }
    let stored = merkle::block_roots(&mut *conn).await?.len() as u64;
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
