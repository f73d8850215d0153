//! The checkpointer: a fenced log reader (`merkle`) that appends the log's
//! leaves to the tree in whole blocks and, every `every` events or
//! `interval` (whichever comes first, and only when the log grew by more
//! than its own checkpoints), signs the tree head and appends it to the log
//! as a checkpoint event. The blocks, the reader's checkpoint and the
//! checkpoint event go in one transaction, fenced by the reader's lease:
//! a stalled checkpointer that lost its lease writes nothing.

use ed25519_dalek::SigningKey;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::tree::{leaf_of, to_hash};
use super::{AuditError, AuditResult};
use crate::domain::checkpoint::{self, Checkpoint, TreeHead, CHECKPOINT, LOG_STREAM};
use crate::domain::merkle::{root_of, Frontier, Hash, BLOCK_HEIGHT, BLOCK_LEAVES};
use crate::ledger::Ledger;
use crate::reader::{LogReader, ReaderLease};
use crate::store::merkle::{self, BlockRow, LeafRow};
use crate::store::{events, readers, EventRow};

pub const READER: &str = "merkle";
/// Leaves read per step.
const PAGE: i64 = 20_000;

#[derive(Clone)]
pub struct CheckpointConfig {
    /// Sign once this many events joined the tree since the last head...
    pub every: u64,
    /// ...or this long after the last head, if anything joined it.
    pub interval: Duration,
    pub holder: String,
    pub lease: Duration,
    /// How often an idle checkpointer looks at the log.
    pub poll: Duration,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            every: 10_000,
            interval: Duration::from_secs(60),
            holder: format!("{}:checkpointer", crate::worker::process_holder_id()),
            lease: Duration::from_secs(15),
            poll: Duration::from_millis(500),
        }
    }
}

/// The tree as this checkpointer holds it: the stored blocks as a frontier,
/// the leaves past them, and what was signed last.
struct Tree {
    blocks: Frontier,
    /// `(txid, position)` of the last leaf in a stored block.
    block_end: (i64, i64),
    pending: Vec<LeafRow>,
    /// Leaves (not counting the checkpoints themselves) since the last head.
    unsigned: u64,
    /// The tree size of the last signed head.
    signed_size: u64,
    last_signed: Instant,
}

impl Tree {
    /// The tree as stored, trusted only as far as it is checked: the blocks
    /// under the last signed head must give its root, and every block past
    /// them must be the log's own leaves. A tree that fails either (the log
    /// was changed after it was signed, or someone wrote a block: the
    /// worker role may insert them) is refused: nothing is signed over it.
    async fn load(conn: &mut sqlx::PgConnection) -> AuditResult<Tree> {
        let roots = merkle::block_roots(&mut *conn).await?;
        let signed = match merkle::last_of_stream(&mut *conn, LOG_STREAM).await? {
            Some((_, row)) => Some(
                Checkpoint::from_data(&row.data)
                    .ok_or_else(|| {
                        AuditError::Mismatch(format!("checkpoint v{} is unreadable", row.version))
                    })?
                    .head,
            ),
            None => None,
        };
        let signed_size = signed.as_ref().map_or(0, |h| h.tree_size);
        // Blocks wholly under the head are vouched for by its root (checked
        // below); the walk over the log starts after them.
        let trusted = (signed_size / BLOCK_LEAVES).min(roots.len() as u64);
        let mut f = Frontier::new();
        for r in &roots[..trusted as usize] {
            f.push_subtree(BLOCK_HEIGHT, to_hash(r)?);
        }
        let mut cursor = match trusted {
            0 => (0, 0),
            n => merkle::block(&mut *conn, n as i64 - 1)
                .await?
                .map(|b| (b.last_txid, b.last_position))
                .ok_or_else(|| AuditError::Mismatch(format!("block {} is missing", n - 1)))?,
        };
        let stored_end = roots.len() as u64 * BLOCK_LEAVES;
        let walk_to = stored_end.max(signed_size);
        let mut tree = Tree {
            blocks: f.clone(),
            block_end: cursor,
            pending: vec![],
            unsigned: 0,
            signed_size,
            last_signed: Instant::now(),
        };
        if signed_size > 0 && signed_size == f.size() {
            check_head(&f, signed.as_ref().expect("signed"))?;
        }
        while f.size() < walk_to {
            let want = (walk_to - f.size()).min(PAGE as u64) as i64;
            let page = merkle::leaves_after(&mut *conn, cursor.0, cursor.1, want).await?;
            let Some(last) = page.last() else { break };
            cursor = (last.txid, last.position);
            for l in page {
                f.push(leaf_of(&l));
                let index = f.size() - 1;
                tree.count(&l, index);
                tree.pending.push(l);
                if f.size() == signed_size {
                    check_head(&f, signed.as_ref().expect("signed"))?;
                }
                if tree.pending.len() as u64 == BLOCK_LEAVES && tree.blocks.size() < stored_end {
                    tree.adopt_block(conn).await?;
                }
            }
        }
        if signed_size > f.size() {
            return Err(AuditError::Mismatch(format!(
                "the last signed head covers {signed_size} leaves; the log has {}: refusing to sign",
                f.size()
            )));
        }
        if tree.blocks.size() < stored_end {
            return Err(AuditError::Mismatch(format!(
                "the tree stores {} blocks; the log fills {}: refusing to sign",
                roots.len(),
                tree.blocks.size() / BLOCK_LEAVES
            )));
        }
        Ok(tree)
    }

    /// The first 256 pending leaves are the stored block they fall in:
    /// checked against it, then taken as stored.
    async fn adopt_block(&mut self, conn: &mut sqlx::PgConnection) -> AuditResult<()> {
        let n = self.blocks.size() / BLOCK_LEAVES;
        let b = merkle::block(&mut *conn, n as i64)
            .await?
            .ok_or_else(|| AuditError::Mismatch(format!("block {n} is missing")))?;
        let leaves: Vec<Hash> = self.pending.iter().map(leaf_of).collect();
        let positions: Vec<i64> = self.pending.iter().map(|l| l.position).collect();
        if b.positions != positions || b.leaves != leaves.concat() || b.root != root_of(&leaves).to_vec() {
            return Err(AuditError::Mismatch(format!(
                "stored block {n} is not the log's leaves {}..{}: refusing to sign",
                n * BLOCK_LEAVES,
                (n + 1) * BLOCK_LEAVES
            )));
        }
        self.stored(&[b]);
        Ok(())
    }

    /// Counts a leaf the next head will cover for the first time.
    fn count(&mut self, l: &LeafRow, index: u64) {
        if index >= self.signed_size && l.job_id != LOG_STREAM {
            self.unsigned += 1;
        }
    }

    fn size(&self) -> u64 {
        self.blocks.size() + self.pending.len() as u64
    }

    fn cursor(&self) -> (i64, i64) {
        self.pending
            .last()
            .map_or(self.block_end, |l| (l.txid, l.position))
    }

    fn root(&self) -> Hash {
        let mut f = self.blocks.clone();
        self.pending.iter().for_each(|l| f.push(leaf_of(l)));
        f.root()
    }

    /// The whole blocks at the front of `pending`, as rows.
    fn full_blocks(&self) -> Vec<BlockRow> {
        let first = self.blocks.size() / BLOCK_LEAVES;
        self.pending
            .chunks_exact(BLOCK_LEAVES as usize)
            .enumerate()
            .map(|(i, c)| {
                let leaves: Vec<Hash> = c.iter().map(leaf_of).collect();
                let last = c.last().expect("256 leaves");
                BlockRow {
                    block: (first + i as u64) as i64,
                    last_txid: last.txid,
                    last_position: last.position,
                    positions: c.iter().map(|l| l.position).collect(),
                    leaves: leaves.concat(),
                    root: root_of(&leaves).to_vec(),
                }
            })
            .collect()
    }

    fn stored(&mut self, blocks: &[BlockRow]) {
        for b in blocks {
            self.blocks
                .push_subtree(BLOCK_HEIGHT, b.root.as_slice().try_into().expect("32 bytes"));
            self.block_end = (b.last_txid, b.last_position);
        }
        self.pending.drain(..blocks.len() * BLOCK_LEAVES as usize);
    }
}

/// What one step did.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Step {
    pub leaves: u64,
    pub blocks: u64,
    pub tree_size: u64,
    pub signed: Option<Checkpoint>,
}

pub struct Checkpointer {
    ledger: Ledger,
    key: SigningKey,
    cfg: CheckpointConfig,
}

impl Checkpointer {
    pub fn new(ledger: Ledger, key: SigningKey, cfg: CheckpointConfig) -> Self {
        Checkpointer { ledger, key, cfg }
    }

    /// Runs until `stop`: follows the log, stores blocks, signs heads.
    pub async fn run(&self, stop: CancellationToken) -> AuditResult<()> {
        let reader = LogReader::open(self.ledger.pool().clone(), READER).await?;
        let lease = loop {
            if let Some(l) = reader.acquire(&self.cfg.holder, self.cfg.lease).await? {
                break l;
            }
            tokio::select! { _ = stop.cancelled() => return Ok(()), _ = tokio::time::sleep(self.cfg.poll) => {} }
        };
        let mut conn = self.ledger.pool().acquire().await?;
        let mut tree = Tree::load(&mut conn).await?;
        drop(conn);
        let mut renewed = Instant::now();
        while !stop.is_cancelled() {
            if renewed.elapsed() > self.cfg.lease / 3 {
                if !lease.renew().await? {
                    return Err(AuditError::LeaseLost);
                }
                renewed = Instant::now();
            }
            let step = self.step(&lease, &mut tree, false).await?;
            if let Some(cp) = &step.signed {
                tracing::info!(tree_size = cp.head.tree_size, root = %cp.head.root, "checkpoint signed");
            }
            // Only a full page means more is waiting: otherwise look again
            // after `poll` (a busy loop of small reads cost W3 13 %).
            if step.leaves < PAGE as u64 {
                tokio::select! { _ = stop.cancelled() => {}, _ = tokio::time::sleep(self.cfg.poll) => {} }
            }
        }
        lease.release().await?;
        Ok(())
    }

    /// Catches the tree up with the log and signs its head now (if the log
    /// grew since the last head, or no head was signed yet).
    pub async fn checkpoint_now(&self) -> AuditResult<Step> {
        let reader = LogReader::open(self.ledger.pool().clone(), READER).await?;
        let lease = reader
            .acquire(&self.cfg.holder, self.cfg.lease)
            .await?
            .ok_or_else(|| AuditError::Unanswerable("another checkpointer holds the lease".into()))?;
        let done = self.catch_up_with(&lease).await;
        // Give the lease back, so the next one need not wait for it to expire.
        lease.release().await?;
        done
    }

    /// `checkpoint_now` under a lease the caller holds.
    pub async fn catch_up_with(&self, lease: &ReaderLease) -> AuditResult<Step> {
        let mut conn = self.ledger.pool().acquire().await?;
        let mut tree = Tree::load(&mut conn).await?;
        drop(conn);
        let mut total = Step::default();
        loop {
            let s = self.step(lease, &mut tree, true).await?;
            total.leaves += s.leaves;
            total.blocks += s.blocks;
            total.tree_size = s.tree_size;
            if s.signed.is_some() {
                total.signed = s.signed;
            }
            if s.leaves == 0 {
                return Ok(total);
            }
        }
    }

    /// Reads what the log has past the tree, stores whole blocks, and signs
    /// when due (`force`: whenever the log grew, or no head exists yet).
    async fn step(&self, lease: &ReaderLease, tree: &mut Tree, force: bool) -> AuditResult<Step> {
        let mut conn = self.ledger.pool().acquire().await?;
        let (txid, position) = tree.cursor();
        let page = merkle::leaves_after(&mut conn, txid, position, PAGE).await?;
        let mut step = Step {
            leaves: page.len() as u64,
            ..Step::default()
        };
        for l in page {
            let index = tree.size();
            tree.count(&l, index);
            tree.pending.push(l);
        }
        let blocks = tree.full_blocks();
        let caught_up = step.leaves < PAGE as u64;
        let due = tree.unsigned > 0
            && caught_up
            && (force || tree.unsigned >= self.cfg.every || tree.last_signed.elapsed() >= self.cfg.interval);
        let due = due
            || (force
                && caught_up
                && tree.size() > 0
                && merkle::stream_head(&mut *conn, LOG_STREAM).await?.is_none());
        if blocks.is_empty() && !due {
            step.tree_size = tree.size();
            return Ok(step);
        }
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        // The fence of everything this transaction writes (blocks and the
        // head alike), taken first: the checkpoint moves, or stays, only for
        // the holder, and a fenced-out one meets it before anything else.
        let end = blocks
            .last()
            .map_or(tree.block_end, |b| (b.last_txid, b.last_position));
        if !readers::advance_checkpoint(&mut *tx, READER, lease.token(), end.0, end.1).await? {
            return Err(AuditError::LeaseLost);
        }
        merkle::insert_blocks(&mut tx, &blocks).await?;
        let signed = if due {
            Some(self.append_head(&mut tx, tree, lease.token()).await?)
        } else {
            None
        };
        tx.commit().await?;
        step.blocks = blocks.len() as u64;
        tree.stored(&blocks);
        if let Some(cp) = &signed {
            tree.unsigned = 0;
            tree.signed_size = cp.head.tree_size;
            tree.last_signed = Instant::now();
        }
        step.signed = signed;
        step.tree_size = tree.size();
        Ok(step)
    }

    /// Signs the head of `tree` and appends it as the log stream's next event.
    async fn append_head(
        &self,
        tx: &mut sqlx::PgConnection,
        tree: &Tree,
        token: i64,
    ) -> AuditResult<Checkpoint> {
        let head = TreeHead {
            log_id: merkle::log_id(&mut *tx).await?,
            tree_size: tree.size(),
            root: hex::encode(tree.root()),
            last_position: tree.cursor().1,
            signed_at: crate::domain::digest::to_micros(merkle::db_now(&mut *tx).await?),
        };
        let cp = checkpoint::sign(head, &self.key);
        let (version, prev) = match merkle::stream_head(&mut *tx, LOG_STREAM).await? {
            Some((v, h)) => (v + 1, Some(h)),
            None => (1, None),
        };
        let ev = checkpoint::checkpoint_event(&cp, version, prev, &self.cfg.holder, token);
        events::insert_events(tx, vec![log_row(ev)]).await?;
        Ok(cp)
    }
}

fn log_row(ev: checkpoint::CheckpointEvent) -> EventRow {
    EventRow {
        position: 0,
        job_id: LOG_STREAM,
        version: ev.version,
        kind: CHECKPOINT.into(),
        from_state: None,
        to_state: CHECKPOINT.into(),
        reason: CHECKPOINT.into(),
        error_class: None,
        actor: ev.actor,
        epoch: 0,
        token: ev.token,
        attempt: 0,
        run: 0,
        data: ev.data,
        recorded_at: ev.recorded_at,
        prev_hash: ev.prev_hash,
        hash: ev.hash,
        schema: ev.schema,
        trace: None,
    }
}

/// Every signed checkpoint in the log: `(position, version, checkpoint)`.
pub async fn checkpoints(ledger: &Ledger) -> AuditResult<Vec<(i64, i64, Checkpoint)>> {
    // An unreadable one is left out here (verify and audit report it): it
    // must not stop exports and proofs of the rest.
    Ok(merkle::log_stream(ledger.pool(), LOG_STREAM)
        .await?
        .into_iter()
        .filter_map(|(_, row)| Checkpoint::from_data(&row.data).map(|cp| (row.position, row.version, cp)))
        .collect())
}

/// The log id of this ledger.
pub async fn log_id(ledger: &Ledger) -> AuditResult<Uuid> {
    Ok(merkle::log_id(ledger.pool()).await?)
}

/// The frontier reached the last signed head's size: its root must be the
/// signed one, or the log (or the stored tree) changed after it was signed.
fn check_head(f: &Frontier, head: &TreeHead) -> AuditResult<()> {
    let root = hex::encode(f.root());
    if root != head.root {
        return Err(AuditError::Mismatch(format!(
            "the tree of {} leaves has root {root}, not the root {} signed for it: the log or the stored tree \
             changed after it was signed; refusing to sign over it",
            head.tree_size, head.root
        )));
    }
    Ok(())
}
