//! `export`: a self-contained segment of the log for an auditor without
//! database access: zstd-compressed NDJSON, one line each of
//! - `segment`: the header (log id, the first leaf index, the tree's peaks
//!   before it, the tree sizes of the checkpoints that fall in it);
//! - `event`: every event as stored, in log order, with its leaf index;
//! - `head`: each job's chain head in the segment;
//! - `manifest`: range, positions, counts, schema versions, the Merkle root
//!   over every leaf up to the segment's end.
//!
//! Ranges are leaf indexes (log order, docs/audit.md), `[from, to)`.
//! Streams: memory does not grow with the segment.

use futures_util::TryStreamExt;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::Ordering;
use uuid::Uuid;

use super::tree::{leaf_of, to_hash};
use super::{io, AuditError, AuditResult};
use crate::domain::checkpoint::{Checkpoint, LOG_STREAM};
use crate::domain::merkle::{event_leaf, Frontier, BLOCK_HEIGHT, BLOCK_LEAVES};
use crate::ledger::Ledger;
use crate::store::merkle;
use crate::store::{readers, EventRow};

pub const FORMAT: u32 = 1;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Header {
    pub kind: String,
    pub format: u32,
    pub log_id: Uuid,
    pub from_index: u64,
    /// The tree's peaks (largest first) over leaves `[0, from_index)`.
    pub prefix_peaks: Vec<String>,
    /// Tree sizes signed by the checkpoints in this segment: the auditor
    /// keeps the root at each of them to check the signed one.
    pub checkpoint_sizes: Vec<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EventLine {
    pub kind: String,
    pub index: u64,
    pub txid: i64,
    /// The event's log position (`EventRow` leaves it out of its JSON).
    pub position: i64,
    pub event: EventRow,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HeadLine {
    pub kind: String,
    pub job_id: Uuid,
    pub version: i64,
    pub hash: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub kind: String,
    pub format: u32,
    pub log_id: Uuid,
    pub from_index: u64,
    pub end_index: u64,
    pub first_position: Option<i64>,
    pub last_position: Option<i64>,
    pub events: u64,
    pub jobs: u64,
    pub schemas: Vec<i16>,
    /// RFC 6962 root over leaves `[0, end_index)`.
    pub root: String,
}

fn line<T: Serialize>(out: &mut impl Write, path: &Path, v: &T) -> AuditResult<()> {
    serde_json::to_writer(&mut *out, v).map_err(|e| io(path, e.into()))?;
    out.write_all(b"\n").map_err(|e| io(path, e))
}

/// The tree's frontier over its first `from` leaves and the log place of
/// leaf `from - 1`: whole stored blocks by their roots, the rest leaf by leaf.
async fn prefix(conn: &mut sqlx::PgConnection, from: u64) -> AuditResult<(Frontier, (i64, i64))> {
    let mut f = Frontier::new();
    let mut cursor = (0i64, 0i64);
    let whole = from / BLOCK_LEAVES;
    let roots = merkle::block_roots(&mut *conn).await?;
    let use_blocks = whole.min(roots.len() as u64);
    for r in &roots[..use_blocks as usize] {
        f.push_subtree(BLOCK_HEIGHT, to_hash(r)?);
    }
    if use_blocks > 0 {
        let b = merkle::block(&mut *conn, use_blocks as i64 - 1)
            .await?
            .ok_or_else(|| AuditError::Mismatch(format!("block {} is missing", use_blocks - 1)))?;
        cursor = (b.last_txid, b.last_position);
    }
    while f.size() < from {
        let page = merkle::leaves_after(
            &mut *conn,
            cursor.0,
            cursor.1,
            (from - f.size()).min(10_000) as i64,
        )
        .await?;
        let Some(last) = page.last() else {
            return Err(AuditError::BadInput(format!(
                "the log has only {} leaves, not {from}",
                f.size()
            )));
        };
        cursor = (last.txid, last.position);
        page.iter().for_each(|l| f.push(leaf_of(l)));
    }
    Ok((f, cursor))
}

/// What `export` wrote.
#[derive(Debug, Clone, Serialize)]
pub struct Exported {
    pub manifest: Manifest,
    pub bytes: u64,
}

impl Ledger {
    /// Writes the segment `[from, to)` of the log (to the log's end as of
    /// now when `to` is `None`) to `out`.
    pub async fn export(&self, from: u64, to: Option<u64>, out: &Path) -> AuditResult<Exported> {
        self.export_tracked(from, to, out, None).await
    }

    /// `export`, telling `progress` (if any) the events to write (a count
    /// over the log, so only when someone watches) and those written.
    pub async fn export_tracked(
        &self,
        from: u64,
        to: Option<u64>,
        out: &Path,
        progress: Option<&super::Progress>,
    ) -> AuditResult<Exported> {
        if to.is_some_and(|t| t < from) {
            return Err(AuditError::BadInput(format!(
                "--to {} is before --from {from}",
                to.unwrap_or(0)
            )));
        }
        let mut conn = self.pool().acquire().await?;
        let log_id = merkle::log_id(&mut *conn).await?;
        let end_place = merkle::log_end(&mut *conn).await?;
        let (mut frontier, mut cursor) = prefix(&mut conn, from).await?;
        if let Some(p) = progress {
            let leaves = match end_place {
                Some(end) => merkle::leaves_through(&mut *conn, end).await? as u64,
                None => from,
            };
            let leaves = to.map_or(leaves, |t| t.min(leaves));
            p.total.store(leaves.saturating_sub(from), Ordering::Relaxed);
        }
        let file = std::fs::File::create(out).map_err(|e| io(out, e))?;
        let mut z = zstd::stream::write::Encoder::new(std::io::BufWriter::with_capacity(1 << 20, file), 3)
            .map_err(|e| io(out, e))?;
        let sizes: Vec<u64> = super::checkpointer::checkpoints(self)
            .await?
            .into_iter()
            .map(|(_, _, c)| c.head.tree_size)
            .filter(|s| *s > from && to.is_none_or(|t| *s <= t))
            .collect();
        let header = Header {
            kind: "segment".into(),
            format: FORMAT,
            log_id,
            from_index: from,
            prefix_peaks: frontier.peaks().iter().map(hex::encode).collect(),
            checkpoint_sizes: sizes,
        };
        line(&mut z, out, &header)?;
        let start_place = cursor;
        let (mut first, mut last, mut schemas) = (None, None, std::collections::BTreeSet::new());
        let mut index = from;
        'pages: while to.is_none_or(|t| index < t) && end_place.is_some_and(|e| cursor < e) {
            let want = to.map_or(10_000, |t| (t - index).min(10_000)) as i64;
            let page = readers::events_after(
                &mut conn,
                cursor.0,
                cursor.1,
                want,
                readers::DataAs::Parsed {
                    kinds: None,
                    keys: None,
                    hashes: true,
                },
                None,
            )
            .await?;
            if page.is_empty() {
                break;
            }
            for e in page {
                if end_place.is_some_and(|end| (e.txid, e.row.position) > end) {
                    break 'pages;
                }
                cursor = (e.txid, e.row.position);
                first.get_or_insert(e.row.position);
                last = Some(e.row.position);
                schemas.insert(e.row.schema);
                frontier.push(event_leaf(e.row.position, &e.row.hash));
                let l = EventLine {
                    kind: "event".into(),
                    index,
                    txid: e.txid,
                    position: e.row.position,
                    event: e.row,
                };
                line(&mut z, out, &l)?;
                index += 1;
                if let Some(p) = progress {
                    p.done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let mut jobs = 0;
        let mut heads = merkle::heads_between(&mut conn, start_place, cursor);
        while let Some((job_id, version, hash)) =
            heads.try_next().await.map_err(crate::store::StoreError::from)?
        {
            jobs += 1;
            let h = HeadLine {
                kind: "head".into(),
                job_id,
                version,
                hash,
            };
            line(&mut z, out, &h)?;
        }
        drop(heads);
        let manifest = Manifest {
            kind: "manifest".into(),
            format: FORMAT,
            log_id,
            from_index: from,
            end_index: index,
            first_position: first,
            last_position: last,
            events: index - from,
            jobs,
            schemas: schemas.into_iter().collect(),
            root: hex::encode(frontier.root()),
        };
        line(&mut z, out, &manifest)?;
        let mut w = z.finish().map_err(|e| io(out, e))?;
        w.flush().map_err(|e| io(out, e))?;
        let bytes = std::fs::metadata(out).map_err(|e| io(out, e))?.len();
        Ok(Exported { manifest, bytes })
    }
}

/// A checkpoint line's data, if the event is one.
pub(crate) fn checkpoint_of(e: &EventRow) -> Option<Checkpoint> {
    (e.job_id == LOG_STREAM)
        .then(|| Checkpoint::from_data(&e.data))
        .flatten()
}
