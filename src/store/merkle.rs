//! Queries of the log's Merkle tree (`jobledger.merkle_blocks`) and of the
//! log stream (signed checkpoints, `domain::checkpoint`).

use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::rows::{EventRow, EVENT_COLUMNS};
use super::StoreResult;

/// One stored block of 256 leaves.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct BlockRow {
    pub block: i64,
    pub last_txid: i64,
    pub last_position: i64,
    pub positions: Vec<i64>,
    pub leaves: Vec<u8>,
    pub root: Vec<u8>,
}

/// One leaf's source: an event's place in log order and its chain hash.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct LeafRow {
    pub txid: i64,
    pub position: i64,
    pub job_id: Uuid,
    pub hash: String,
}

pub async fn log_id<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Uuid> {
    Ok(sqlx::query_scalar("SELECT log_id FROM jobledger.ledger_identity")
        .fetch_one(exec)
        .await?)
}

/// The next `limit` events after `(txid, position)` in log order, below the
/// horizon (as `readers::events_after`, without the events' data).
pub async fn leaves_after(
    conn: &mut PgConnection,
    txid: i64,
    position: i64,
    limit: i64,
) -> StoreResult<Vec<LeafRow>> {
    Ok(sqlx::query_as(
        "SELECT e.txid::text::bigint AS txid, e.position, e.job_id, e.hash FROM jobledger.events e \
         WHERE (e.txid, e.position) > ($1::text::xid8, $2) AND e.txid < (SELECT jobledger.log_horizon()) \
         ORDER BY e.txid, e.position LIMIT $3",
    )
    .bind(txid)
    .bind(position)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// The roots of the stored blocks, in order. Blocks are numbered from 0
/// without a hole; a hole (a deleted block) is an error, never read past.
pub async fn block_roots<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<Vec<u8>>> {
    let rows: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT block, root FROM jobledger.merkle_blocks ORDER BY block")
            .fetch_all(exec)
            .await?;
    if let Some((i, (b, _))) = rows.iter().enumerate().find(|(i, (b, _))| *b != *i as i64) {
        return Err(super::StoreError::Corrupt(format!(
            "the tree's block {i} is missing (the next stored is block {b})"
        )));
    }
    Ok(rows.into_iter().map(|(_, r)| r).collect())
}

pub async fn block<'e>(exec: impl PgExecutor<'e>, block: i64) -> StoreResult<Option<BlockRow>> {
    Ok(sqlx::query_as(
        "SELECT block, last_txid::text::bigint AS last_txid, last_position, positions, leaves, root \
         FROM jobledger.merkle_blocks WHERE block = $1",
    )
    .bind(block)
    .fetch_optional(exec)
    .await?)
}

/// Blocks from `from` on, in order (verify's walk), at most `limit`.
pub async fn blocks_from<'e>(exec: impl PgExecutor<'e>, from: i64, limit: i64) -> StoreResult<Vec<BlockRow>> {
    Ok(sqlx::query_as(
        "SELECT block, last_txid::text::bigint AS last_txid, last_position, positions, leaves, root \
         FROM jobledger.merkle_blocks WHERE block >= $1 ORDER BY block LIMIT $2",
    )
    .bind(from)
    .bind(limit)
    .fetch_all(exec)
    .await?)
}

/// The block holding the event at `(txid, position)`: the first block whose
/// last leaf is not before it.
pub async fn block_holding<'e>(
    exec: impl PgExecutor<'e>,
    txid: i64,
    position: i64,
) -> StoreResult<Option<BlockRow>> {
    Ok(sqlx::query_as(
        "SELECT block, last_txid::text::bigint AS last_txid, last_position, positions, leaves, root \
         FROM jobledger.merkle_blocks WHERE (last_txid, last_position) >= ($1::text::xid8, $2) \
         ORDER BY last_txid, last_position LIMIT 1",
    )
    .bind(txid)
    .bind(position)
    .fetch_optional(exec)
    .await?)
}

/// Appends whole blocks (the checkpointer, in its fenced transaction).
pub async fn insert_blocks(conn: &mut PgConnection, blocks: &[BlockRow]) -> StoreResult<()> {
    for b in blocks {
        sqlx::query(
            "INSERT INTO jobledger.merkle_blocks (block, last_txid, last_position, positions, leaves, root) \
             VALUES ($1, $2::text::xid8, $3, $4, $5, $6)",
        )
        .bind(b.block)
        .bind(b.last_txid)
        .bind(b.last_position)
        .bind(&b.positions)
        .bind(&b.leaves)
        .bind(&b.root)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// `(txid, position, hash)` of the events at `positions` (a block's leaves
/// recomputed from the log).
pub async fn hashes_at<'e>(exec: impl PgExecutor<'e>, positions: &[i64]) -> StoreResult<Vec<(i64, String)>> {
    Ok(
        sqlx::query_as("SELECT position, hash FROM jobledger.events WHERE position = ANY($1)")
            .bind(positions)
            .fetch_all(exec)
            .await?,
    )
}

/// The events of the log stream (the checkpoints), oldest first.
pub async fn log_stream<'e>(exec: impl PgExecutor<'e>, stream: Uuid) -> StoreResult<Vec<(i64, EventRow)>> {
    let sql = format!(
        "SELECT txid::text::bigint AS txid, position, {EVENT_COLUMNS} FROM jobledger.events \
         WHERE job_id = $1 ORDER BY version"
    );
    let rows = sqlx::query(&sql)
        .bind(stream)
        .try_map(|r| super::readers::logged_of(&r, false))
        .fetch_all(exec)
        .await?;
    Ok(rows.into_iter().map(|r| (r.txid, r.row)).collect())
}

/// The log stream's last `(version, hash)`, if any.
pub async fn stream_head<'e>(exec: impl PgExecutor<'e>, stream: Uuid) -> StoreResult<Option<(i64, String)>> {
    Ok(sqlx::query_as(
        "SELECT version, hash FROM jobledger.events WHERE job_id = $1 ORDER BY version DESC LIMIT 1",
    )
    .bind(stream)
    .fetch_optional(exec)
    .await?)
}

/// `(txid, position)` of every event of `job`, by version (`prove`).
pub async fn places_of<'e>(exec: impl PgExecutor<'e>, job: Uuid) -> StoreResult<Vec<(i64, i64)>> {
    Ok(sqlx::query_as(
        "SELECT txid::text::bigint, position FROM jobledger.events WHERE job_id = $1 ORDER BY version",
    )
    .bind(job)
    .fetch_all(exec)
    .await?)
}

/// The database clock, for a head's `signed_at`.
pub async fn db_now<'e>(exec: impl PgExecutor<'e>) -> StoreResult<chrono::DateTime<chrono::Utc>> {
    Ok(sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(exec)
        .await?)
}

/// `(txid, position)` of the last event below the horizon: where an export
/// started now ends.
pub async fn log_end<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Option<(i64, i64)>> {
    Ok(sqlx::query_as(
        "SELECT txid::text::bigint, position FROM jobledger.events \
         WHERE txid < (SELECT jobledger.log_horizon()) ORDER BY txid DESC, position DESC LIMIT 1",
    )
    .fetch_optional(exec)
    .await?)
}

/// How many events are at or before `(txid, position)` in log order: the
/// size of the tree an export started now covers (for its progress).
pub async fn leaves_through<'e>(exec: impl PgExecutor<'e>, end: (i64, i64)) -> StoreResult<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM jobledger.events WHERE (txid, position) <= ($1::text::xid8, $2)",
    )
    .bind(end.0.to_string())
    .bind(end.1)
    .fetch_one(exec)
    .await?)
}

/// Each job's last `(job_id, version, hash)` among the events after `from`
/// up to `to` in log order, by job id, as a stream (an export's heads).
pub fn heads_between(
    conn: &mut PgConnection,
    from: (i64, i64),
    to: (i64, i64),
) -> impl futures_util::Stream<Item = Result<(Uuid, i64, String), sqlx::Error>> + '_ {
    sqlx::query_as(
        "SELECT DISTINCT ON (job_id) job_id, version, hash FROM jobledger.events \
         WHERE (txid, position) > ($1::text::xid8, $2) AND (txid, position) <= ($3::text::xid8, $4) \
         ORDER BY job_id, version DESC",
    )
    .bind(from.0)
    .bind(from.1)
    .bind(to.0)
    .bind(to.1)
    .fetch(conn)
}

/// The log stream's last event with its position (the latest signed head).
pub async fn last_of_stream<'e>(
    exec: impl PgExecutor<'e>,
    stream: Uuid,
) -> StoreResult<Option<(i64, EventRow)>> {
    let sql = format!(
        "SELECT position, {EVENT_COLUMNS} FROM jobledger.events WHERE job_id = $1 ORDER BY version DESC LIMIT 1"
    );
    let row: Option<EventRow> = sqlx::query_as(&sql).bind(stream).fetch_optional(exec).await?;
    Ok(row.map(|r| (r.position, r)))
}
