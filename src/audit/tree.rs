//! The log's tree as the database holds it: whole blocks of 256 leaves
//! (`jobledger.merkle_blocks`) and, past the last block, the log itself.
//! `TreeView` loads what one proof needs and answers RFC 6962's range
//! hashes from it.

use sqlx::PgConnection;
use std::collections::HashMap;

use super::{AuditError, AuditResult};
use crate::domain::merkle::{event_leaf, root_of, Hash, Subtrees, BLOCK_LEAVES};
use crate::store::merkle::{self, BlockRow, LeafRow};

pub(crate) fn to_hash(bytes: &[u8]) -> AuditResult<Hash> {
    bytes
        .try_into()
        .map_err(|_| AuditError::Mismatch(format!("a stored hash of {} bytes", bytes.len())))
}

/// The 256 leaf hashes of a stored block.
pub(crate) fn block_leaves(b: &BlockRow) -> AuditResult<Vec<Hash>> {
    if b.leaves.len() != 32 * BLOCK_LEAVES as usize {
        return Err(AuditError::Mismatch(format!(
            "block {} holds {} bytes of leaves",
            b.block,
            b.leaves.len()
        )));
    }
    Ok(b.leaves
        .chunks(32)
        .map(|c| c.try_into().expect("32 bytes"))
        .collect())
}

pub(crate) fn leaf_of(l: &LeafRow) -> Hash {
    event_leaf(l.position, &l.hash)
}

/// What a proof over the first `size` leaves reads: every block root below
/// it, the leaves of the blocks it looks into, and the log's leaves past
/// the last stored block.
pub struct TreeView {
    size: u64,
    /// Roots of the blocks wholly inside the tree.
    roots: Vec<Hash>,
    /// Leaves by block number (stored blocks, or the tail read from the log).
    leaves: HashMap<u64, Vec<Hash>>,
    /// Where the tail (past the last stored block) starts, and its leaves.
    stored_blocks: u64,
}

impl TreeView {
    /// Loads the view of the tree of `size` leaves in which `wanted` leaf
    /// indexes (and the right edges `edges`) will be looked at.
    pub async fn load(
        conn: &mut PgConnection,
        size: u64,
        wanted: &[u64],
        edges: &[u64],
    ) -> AuditResult<TreeView> {
        let all_roots = merkle::block_roots(&mut *conn).await?;
        let stored_blocks = all_roots.len() as u64;
        let whole = (size / BLOCK_LEAVES).min(stored_blocks);
        let roots = all_roots[..whole as usize]
            .iter()
            .map(|r| to_hash(r))
            .collect::<AuditResult<Vec<_>>>()?;
        let mut view = TreeView {
            size,
            roots,
            leaves: HashMap::new(),
            stored_blocks,
        };
        let mut blocks: Vec<u64> = wanted
            .iter()
            .chain(
                edges
                    .iter()
                    .filter(|e| **e > 0)
                    .map(|e| e - 1)
                    .collect::<Vec<_>>()
                    .iter(),
            )
            .map(|i| i / BLOCK_LEAVES)
            .collect();
        blocks.sort_unstable();
        blocks.dedup();
        for b in blocks {
            if b < stored_blocks {
                let row = merkle::block(&mut *conn, b as i64)
                    .await?
                    .ok_or_else(|| AuditError::Mismatch(format!("block {b} is missing")))?;
                view.leaves.insert(b, block_leaves(&row)?);
            }
        }
        if size > stored_blocks * BLOCK_LEAVES {
            view.load_tail(conn).await?;
        }
        Ok(view)
    }

    /// The log's leaves past the last stored block, up to the tree's size.
    async fn load_tail(&mut self, conn: &mut PgConnection) -> AuditResult<()> {
        let (mut txid, mut position) = match self.stored_blocks {
            0 => (0, 0),
            n => {
                let last = merkle::block(&mut *conn, n as i64 - 1)
                    .await?
                    .ok_or_else(|| AuditError::Mismatch(format!("block {} is missing", n - 1)))?;
                (last.last_txid, last.last_position)
            }
        };
        let mut need = self.size - self.stored_blocks * BLOCK_LEAVES;
        let mut block = self.stored_blocks;
        let mut current = vec![];
        while need > 0 {
            let page = merkle::leaves_after(&mut *conn, txid, position, need.min(10_000) as i64).await?;
            if page.is_empty() {
                return Err(AuditError::Mismatch(format!(
                    "the log ends {need} leaves short of a tree of {}",
                    self.size
                )));
            }
            for l in &page {
                current.push(leaf_of(l));
                if current.len() as u64 == BLOCK_LEAVES {
                    self.leaves.insert(block, std::mem::take(&mut current));
                    block += 1;
                }
            }
            let last = page.last().expect("not empty");
            (txid, position) = (last.txid, last.position);
            need -= page.len() as u64;
        }
        if !current.is_empty() {
            self.leaves.insert(block, current);
        }
        Ok(())
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Blocks stored when the view was loaded (the tail starts after them).
    pub fn stored_blocks(&self) -> u64 {
        self.stored_blocks
    }

    /// The leaf at `index`, as the view holds it.
    pub fn leaf(&self, index: u64) -> AuditResult<Hash> {
        self.leaves
            .get(&(index / BLOCK_LEAVES))
            .and_then(|b| b.get((index % BLOCK_LEAVES) as usize))
            .copied()
            .ok_or_else(|| AuditError::Mismatch(format!("leaf {index} was not loaded")))
    }
}

impl Subtrees for TreeView {
    type Error = AuditError;

    fn range_hash(&mut self, start: u64, end: u64) -> AuditResult<Hash> {
        let whole = self.roots.len() as u64 * BLOCK_LEAVES;
        if start % BLOCK_LEAVES == 0 && end % BLOCK_LEAVES == 0 && end <= whole {
            return Ok(root_of(
                &self.roots[(start / BLOCK_LEAVES) as usize..(end / BLOCK_LEAVES) as usize],
            ));
        }
        if start / BLOCK_LEAVES == (end - 1) / BLOCK_LEAVES {
            let b = self
                .leaves
                .get(&(start / BLOCK_LEAVES))
                .ok_or_else(|| AuditError::Mismatch(format!("leaves {start}..{end} were not loaded")))?;
            let (s, e) = (
                (start % BLOCK_LEAVES) as usize,
                ((end - 1) % BLOCK_LEAVES) as usize + 1,
            );
            if e > b.len() {
                return Err(AuditError::Mismatch(format!(
                    "leaves {start}..{end} are past the log's end"
                )));
            }
            return Ok(root_of(&b[s..e]));
        }
        let k = 1u64 << (63 - (end - start - 1).leading_zeros());
        let left = self.range_hash(start, start + k)?;
        let right = self.range_hash(start + k, end)?;
        Ok(crate::domain::merkle::node_hash(&left, &right))
    }
}
