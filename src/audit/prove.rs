//! `prove`: a job's events are in the tree the latest signed head commits
//! to (inclusion), and a later head extends an earlier one (consistency).
//! A proof carries the events as stored, so its reader recomputes every
//! hash itself; `audit --proof` checks it offline.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use uuid::Uuid;

use super::checkpointer::checkpoints;
use super::tree::{leaf_of, TreeView};
use super::{AuditError, AuditResult};
use crate::domain::checkpoint::Checkpoint;
use crate::domain::merkle::{consistency_path, event_leaf, inclusion_path, Subtrees, BLOCK_LEAVES};
use crate::ledger::Ledger;
use crate::store::merkle::{self, LeafRow};
use crate::store::{events, EventRow};

/// A signed head and where it sits in the log stream.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SignedHead {
    /// Version of the checkpoint in the log stream.
    pub version: i64,
    /// Position of the checkpoint event in the log.
    pub position: i64,
    pub checkpoint: Checkpoint,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProvenEvent {
    pub leaf_index: u64,
    /// The event's log position (`EventRow` leaves it out of its JSON).
    pub position: i64,
    /// The event as stored.
    pub event: EventRow,
    /// The audit path, leaf to root, hex.
    pub path: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InclusionProof {
    pub proof: String,
    pub job_id: Uuid,
    pub head: SignedHead,
    pub events: Vec<ProvenEvent>,
    /// Positions of the job's events that came after the head (provable
    /// under a later one).
    pub after_head: Vec<i64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConsistencyProof {
    pub proof: String,
    pub old: SignedHead,
    pub new: SignedHead,
    pub path: Vec<String>,
}

/// The latest signed head (one row of the log stream, not all of them).
async fn latest_head(ledger: &Ledger) -> AuditResult<SignedHead> {
    let (position, row) = merkle::last_of_stream(ledger.pool(), crate::domain::checkpoint::LOG_STREAM)
        .await?
        .ok_or_else(|| AuditError::Unanswerable("no checkpoint has been signed yet".into()))?;
    let checkpoint = Checkpoint::from_data(&row.data)
        .ok_or_else(|| AuditError::Mismatch(format!("checkpoint v{} is unreadable", row.version)))?;
    Ok(SignedHead {
        version: row.version,
        position,
        checkpoint,
    })
}

async fn heads(ledger: &Ledger) -> AuditResult<Vec<SignedHead>> {
    Ok(checkpoints(ledger)
        .await?
        .into_iter()
        .map(|(position, version, checkpoint)| SignedHead {
            version,
            position,
            checkpoint,
        })
        .collect())
}

fn root_of_view(view: &mut TreeView, head: &SignedHead) -> AuditResult<()> {
    let size = head.checkpoint.head.tree_size;
    let root = if size == 0 {
        crate::domain::merkle::empty_root()
    } else {
        view.range_hash(0, size)?
    };
    if hex::encode(root) != head.checkpoint.head.root {
        return Err(AuditError::Mismatch(format!(
            "the log's tree of {size} leaves has root {}, but checkpoint v{} signed {}",
            hex::encode(root),
            head.version,
            head.checkpoint.head.root
        )));
    }
    Ok(())
}

impl Ledger {
    /// The inclusion of `job`'s events under the latest signed head.
    pub async fn prove_job(&self, job: Uuid) -> AuditResult<InclusionProof> {
        let head = latest_head(self).await?;
        let size = head.checkpoint.head.tree_size;
        let rows = events::job_events(self.pool(), job).await?;
        if rows.is_empty() {
            return Err(AuditError::Unanswerable(format!("job {job} has no events")));
        }
        let mut conn = self.pool().acquire().await?;
        let places = merkle::places_of(&mut *conn, job).await?;
        // Leaf indexes of the events in stored blocks; the rest are in the
        // tail past them, or after the head.
        let mut index: HashMap<i64, u64> = HashMap::new();
        for (txid, position) in &places {
            if let Some(b) = merkle::block_holding(&mut *conn, *txid, *position).await? {
                if let Some(i) = b.positions.iter().position(|p| p == position) {
                    index.insert(*position, b.block as u64 * BLOCK_LEAVES + i as u64);
                }
            }
        }
        let wanted: Vec<u64> = index.values().copied().filter(|i| *i < size).collect();
        let mut view = TreeView::load(&mut conn, size, &wanted, &[size]).await?;
        root_of_view(&mut view, &head)?;
        let tail = tail_index(&mut conn, &view).await?;
        let (mut proven, mut after_head) = (vec![], vec![]);
        for row in rows {
            let Some(i) = index
                .get(&row.position)
                .or_else(|| tail.get(&row.position))
                .copied()
            else {
                after_head.push(row.position);
                continue;
            };
            if i >= size {
                after_head.push(row.position);
                continue;
            }
            if view.leaf(i)? != event_leaf(row.position, &row.hash) {
                return Err(AuditError::Mismatch(format!(
                    "the event at position {} is not the leaf {i} the tree holds",
                    row.position
                )));
            }
            let path = inclusion_path(i, size, &mut view)?;
            proven.push(ProvenEvent {
                leaf_index: i,
                position: row.position,
                event: row,
                path: path.iter().map(hex::encode).collect(),
            });
        }
        Ok(InclusionProof {
            proof: "inclusion".into(),
            job_id: job,
            head,
            events: proven,
            after_head,
        })
    }

    /// That the head signed as checkpoint `new` extends checkpoint `old`
    /// (log stream versions).
    pub async fn prove_consistency(&self, old: i64, new: i64) -> AuditResult<ConsistencyProof> {
        let all = heads(self).await?;
        let find = |v: i64| {
            all.iter()
                .find(|h| h.version == v)
                .cloned()
                .ok_or_else(|| AuditError::Unanswerable(format!("no checkpoint v{v}")))
        };
        let (old, new) = (find(old)?, find(new)?);
        let (m, n) = (old.checkpoint.head.tree_size, new.checkpoint.head.tree_size);
        if m == 0 || m > n {
            return Err(AuditError::BadInput(format!(
                "checkpoint v{} ({m} leaves) cannot be extended by v{} ({n} leaves)",
                old.version, new.version
            )));
        }
        let mut conn = self.pool().acquire().await?;
        let mut view = TreeView::load(&mut conn, n, &[], &[m, n]).await?;
        root_of_view(&mut view, &new)?;
        root_of_view(&mut view, &old)?;
        let path = consistency_path(m, n, &mut view)?;
        Ok(ConsistencyProof {
            proof: "consistency".into(),
            old,
            new,
            path: path.iter().map(hex::encode).collect(),
        })
    }
}

/// Leaf indexes of the positions in the view's tail (past the stored blocks).
async fn tail_index(conn: &mut sqlx::PgConnection, view: &TreeView) -> AuditResult<HashMap<i64, u64>> {
    let stored = view.stored_blocks();
    let start = stored * BLOCK_LEAVES;
    if view.size() <= start {
        return Ok(HashMap::new());
    }
    let (mut txid, mut position) = match stored {
        0 => (0, 0),
        n => merkle::block(&mut *conn, n as i64 - 1)
            .await?
            .map(|b| (b.last_txid, b.last_position))
            .ok_or_else(|| AuditError::Mismatch(format!("block {} is missing", n - 1)))?,
    };
    let mut out = HashMap::new();
    let mut i = start;
    while i < view.size() {
        let page: Vec<LeafRow> =
            merkle::leaves_after(&mut *conn, txid, position, (view.size() - i).min(10_000) as i64).await?;
        let Some(last) = page.last() else { break };
        (txid, position) = (last.txid, last.position);
        for l in &page {
            if view.leaf(i)? != leaf_of(l) {
                return Err(AuditError::Mismatch(format!("leaf {i} changed while proving")));
            }
            out.insert(l.position, i);
            i += 1;
        }
    }
    Ok(out)
}
