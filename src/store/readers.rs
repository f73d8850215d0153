//! Queries of the log reader: following `jobledger.events` below the
//! snapshot horizon, and the readers' fenced checkpoints.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{Column, PgConnection, PgExecutor, Row};
use uuid::Uuid;

use super::rows::{EventRow, EVENT_COLUMNS};
use super::StoreResult;

/// The event columns of alias `e`, each as `column` writes it.
fn qualified_with(column: impl Fn(&str) -> String) -> String {
    std::iter::once("position")
        .chain(EVENT_COLUMNS.split(',').map(str::trim))
        .map(column)
        .collect::<Vec<_>>()
        .join(", ")
}

/// An event with its place in the reader's order.
#[derive(Debug, Clone)]
pub struct LoggedEvent {
    pub txid: i64,
    pub row: EventRow,
    /// The event's data as PostgreSQL prints it, unparsed, when read with
    /// `DataAs::Raw` (`row.data` is then JSON `null`).
    pub raw_data: Option<sqlx::types::Json<Box<serde_json::value::RawValue>>>,
}

/// The position of column `name` in a reader's row: `txid`, `position`,
/// then `EVENT_COLUMNS` in their order; past them (the empty name), where
/// `raw_data` goes. Found at compile time, from `EVENT_COLUMNS` itself: each
/// field is tied to its column's name, and a name not among them does not
/// build.
const fn at(name: &str) -> usize {
    let (cols, name) = (EVENT_COLUMNS.as_bytes(), name.as_bytes());
    let (mut i, mut index) = (0, 2);
    while i < cols.len() {
        let start = i;
        while i < cols.len() && cols[i] != b',' {
            i += 1;
        }
        // The column between `start` and the comma, spaces trimmed.
        let (mut a, mut b) = (start, i);
        while a < b && cols[a] == b' ' {
            a += 1;
        }
        while b > a && cols[b - 1] == b' ' {
            b -= 1;
        }
        let mut same = b - a == name.len();
        let mut k = 0;
        while same && k < name.len() {
            same = cols[a + k] == name[k];
            k += 1;
        }
        if same {
            return index;
        }
        index += 1;
        i += 1; // past the comma
    }
    assert!(name.is_empty(), "not a column of the reader's rows");
    index
}

/// Where `raw_data` is, when read raw: after every event column.
const RAW_DATA: usize = at("");

/// A row of the reader's queries (and `merkle::log_stream`), decoded by
/// position: `txid`, `position`, `EVENT_COLUMNS`, then `raw_data` when
/// read raw. By
/// name, sqlx looks each column up in a hash map for every row: 21 lookups
/// an event, the largest share of a rebuild's decoding (`perf`).
pub(super) fn logged_of(r: &PgRow, raw: bool) -> Result<LoggedEvent, sqlx::Error> {
    // Checked in debug builds (every test): the row carries the columns
    // `at` counts on, in that order (`raw_data` last).
    debug_assert!(
        r.columns().iter().map(|c| c.name()).eq(["txid", "position"]
            .into_iter()
            .chain(EVENT_COLUMNS.split(',').map(str::trim))
            .chain(raw.then_some("raw_data"))),
        "the reader's columns are selected in EVENT_COLUMNS' order"
    );
    Ok(LoggedEvent {
        txid: r.try_get(0)?,
        row: EventRow {
            position: r.try_get(1)?,
            job_id: r.try_get(const { at("job_id") })?,
            version: r.try_get(const { at("version") })?,
            kind: r.try_get(const { at("type") })?,
            from_state: r.try_get(const { at("from_state") })?,
            to_state: r.try_get(const { at("to_state") })?,
            reason: r.try_get(const { at("reason") })?,
            error_class: r.try_get(const { at("error_class") })?,
            actor: r.try_get(const { at("actor") })?,
            epoch: r.try_get(const { at("epoch") })?,
            token: r.try_get(const { at("token") })?,
            attempt: r.try_get(const { at("attempt") })?,
            run: r.try_get(const { at("run") })?,
            data: r.try_get(const { at("data") })?,
            recorded_at: r.try_get(const { at("recorded_at") })?,
            prev_hash: r.try_get(const { at("prev_hash") })?,
            hash: r.try_get(const { at("hash") })?,
            schema: r.try_get(const { at("schema") })?,
            trace: r.try_get(const { at("trace") })?,
        },
        raw_data: if raw { r.try_get(RAW_DATA)? } else { None },
    })
}

/// How `events_after` reads each event's `data`.
#[derive(Clone, Copy, Debug)]
pub enum DataAs<'a> {
    /// Parsed, on events of `kinds` (JSON `null` on the others; `None`: on
    /// all), and of that data only the top-level `keys`, as an object of
    /// exactly those keys (a key the data lacks is `null`; `None`: the data
    /// as stored). Without `hashes`, `prev_hash` is NULL and `hash` empty:
    /// printing and decoding them was about a tenth of a read that takes
    /// no data (docs/benchmarks.md).
    Parsed {
        kinds: Option<&'a [&'a str]>,
        keys: Option<&'a [&'a str]>,
        hashes: bool,
    },
    /// Unparsed, for a reader that passes it on as it is (the relay):
    /// building a `serde_json::Value` only to print it again was a third
    /// of the relay's own time.
    Raw,
}

impl<'a> DataAs<'a> {
    /// The kinds and keys a `Parsed` read binds (none for `Raw`).
    fn bound(self) -> (Option<&'a [&'a str]>, Option<&'a [&'a str]>) {
        match self {
            DataAs::Parsed { kinds, keys, .. } => (kinds, keys),
            DataAs::Raw => (None, None),
        }
    }

    fn raw(self) -> bool {
        matches!(self, DataAs::Raw)
    }

    /// The event columns of alias `e` with `data` read this way (`Raw`:
    /// `raw_data` last), the kinds bound in `$kinds` (a `text[]`, NULL: all)
    /// and the keys in the parameter after it. The batch's read and the
    /// lookups of versions handed out early use the same columns, so a
    /// (job, version) comes with the same data each time, and data a read
    /// leaves out is never parsed on either path (a number beyond `f64` or
    /// nesting deeper than serde's limit outside the keys read, or in the
    /// relay's unparsed data).
    fn columns(self, kinds: usize) -> String {
        let (keys, hashes) = match self {
            DataAs::Raw => {
                let columns = qualified_with(|c| match c {
                    "data" => "'null'::jsonb AS data".to_string(),
                    c => format!("e.{c}"),
                });
                return format!("{columns}, e.data AS raw_data");
            }
            DataAs::Parsed { keys, hashes, .. } => (keys, hashes),
        };
        let data = format!(
            "CASE WHEN ${kinds}::text[] IS NULL OR e.type = ANY(${kinds}::text[]) THEN {} ELSE 'null'::jsonb END AS data",
            data_keys_sql("e.data", &format!("${}", kinds + 1), keys)
        );
        qualified_with(|c| match c {
            "data" => data.clone(),
            "prev_hash" if !hashes => "NULL::text AS prev_hash".into(),
            "hash" if !hashes => "''::text AS hash".into(),
            c => format!("e.{c}"),
        })
    }
}

pub async fn ensure_reader<'e>(exec: impl PgExecutor<'e>, name: &str) -> StoreResult<()> {
    sqlx::query("INSERT INTO jobledger.readers (name) VALUES ($1) ON CONFLICT (name) DO NOTHING")
        .bind(name)
        .execute(exec)
        .await?;
    Ok(())
}

/// `(txid, position)` of the reader's checkpoint.
pub async fn reader_checkpoint<'e>(exec: impl PgExecutor<'e>, name: &str) -> StoreResult<Option<(i64, i64)>> {
    Ok(
        sqlx::query_as("SELECT txid::text::bigint, position FROM jobledger.readers WHERE name = $1")
            .bind(name)
            .fetch_optional(exec)
            .await?,
    )
}

/// Takes the reader's lease if it is free, expired, or already ours; the
/// token goes up on every acquisition, so an older holder is fenced out.
pub async fn acquire_reader_lease<'e>(
    exec: impl PgExecutor<'e>,
    name: &str,
    holder: &str,
    lease_ms: i64,
) -> StoreResult<Option<i64>> {
    Ok(sqlx::query_scalar(
        "UPDATE jobledger.readers SET lease_token = lease_token + 1, lease_holder = $2, \
           lease_until = now() + make_interval(secs => $3::double precision / 1000), updated_at = now() \
         WHERE name = $1 AND (lease_until IS NULL OR lease_until <= now() OR lease_holder = $2) \
         RETURNING lease_token",
    )
    .bind(name)
    .bind(holder)
    .bind(lease_ms)
    .fetch_optional(exec)
    .await?)
}

/// Extends the lease; false when another holder took it.
pub async fn renew_reader_lease<'e>(
    exec: impl PgExecutor<'e>,
    name: &str,
    token: i64,
    lease_ms: i64,
) -> StoreResult<bool> {
    let done = sqlx::query(
        "UPDATE jobledger.readers SET lease_until = now() + make_interval(secs => $3::double precision / 1000) \
         WHERE name = $1 AND lease_token = $2",
    )
    .bind(name)
    .bind(token)
    .bind(lease_ms)
    .execute(exec)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Moves the checkpoint forward, fenced by the lease token: false when a
/// newer holder owns the reader (nothing is written).
pub async fn advance_checkpoint<'e>(
    exec: impl PgExecutor<'e>,
    name: &str,
    token: i64,
    txid: i64,
    position: i64,
) -> StoreResult<bool> {
    let done = sqlx::query(
        "UPDATE jobledger.readers SET txid = $3::text::xid8, position = $4, updated_at = now() \
         WHERE name = $1 AND lease_token = $2 AND (txid, position) <= ($3::text::xid8, $4)",
    )
    .bind(name)
    .bind(token)
    .bind(txid)
    .bind(position)
    .execute(exec)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Sets a checkpoint without a lease (projections store theirs in their own
/// transaction, together with what they applied).
pub async fn store_checkpoint<'e>(
    exec: impl PgExecutor<'e>,
    name: &str,
    txid: i64,
    position: i64,
) -> StoreResult<()> {
    sqlx::query("UPDATE jobledger.readers SET txid = $2::text::xid8, position = $3, updated_at = now() WHERE name = $1")
        .bind(name)
        .bind(txid)
        .bind(position)
        .execute(exec)
        .await?;
    Ok(())
}

/// Events after the checkpoint in (txid, position) order, only from
/// transactions below the log horizon (`jobledger.log_horizon()`, evaluated
/// once per statement): every transaction of this database with a smaller id
/// has finished, so nothing can later appear behind what is returned.
///
/// `DataAs::Parsed`: the event kinds (exactly as in `type`) whose `data` is
/// read; the others come with JSON `null` (PostgreSQL does not decompress,
/// print or send their data). `None`: every event's. Of that data, only the
/// named keys are printed and sent (an `enqueued` event's payload and policy
/// were most of what a `queue_stats` rebuild read: 45 ms against 25 ms a
/// 10,000-event batch in psql).
///
/// With `history`, only from that history of the log (`LogHistory`, checked
/// once, before the scan, under the statement's lock on the table): another
/// one returns nothing, which the caller tells from an empty log by asking
/// `log_history`. Returning the history with the rows instead sent three
/// more columns with every row, about 1.3 ms a 10,000-event batch (review,
/// helper-57).
pub async fn events_after(
    conn: &mut PgConnection,
    txid: i64,
    position: i64,
    limit: i64,
    data: DataAs<'_>,
    history: Option<LogHistory>,
) -> StoreResult<Vec<LoggedEvent>> {
    let (data_of, keys) = data.bound();
    let raw = data.raw();
    let sql = format!(
        // `ORDER BY e.txid`, not the bigint alias: ordering by the alias
        // would sort the whole tail instead of walking the index.
        "SELECT e.txid::text::bigint AS txid, {} FROM jobledger.events e \
         WHERE (e.txid, e.position) > ($1::text::xid8, $2) AND e.txid < (SELECT jobledger.log_horizon()) \
         AND ($6::int8 IS NULL OR (SELECT ({HISTORY}) = ($6::int8, $7::int8, $8::timestamptz))) \
         ORDER BY e.txid, e.position LIMIT $3",
        data.columns(4)
    );
    Ok(sqlx::query(&sql)
        .bind(txid)
        .bind(position)
        .bind(limit)
        .bind(data_of)
        .bind(keys)
        .bind(history.map(|h| h.table))
        .bind(history.map(|h| h.storage))
        .bind(history.map(|h| h.started))
        .try_map(move |r| logged_of(&r, raw))
        .fetch_all(conn)
        .await?)
}

/// Which history of the log a read read; a reader's memory of where events
/// lie holds within one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogHistory {
    /// The events table's oid: new when the table or its database is
    /// created again (a logical restore).
    pub table: i64,
    /// Its storage (`pg_relation_filenode`): new when the table is
    /// truncated and loaded again, or rewritten by `VACUUM FULL` or
    /// `CLUSTER` (then forgetting costs only lookups).
    pub storage: i64,
    /// When the server started: new after a physical restore or a
    /// failover.
    pub started: DateTime<Utc>,
}

/// `LogHistory`, as SQL: the same expressions in `log_history` and in the
/// check of `events_after`.
const HISTORY: &str = "'jobledger.events'::regclass::oid::int8, \
     pg_relation_filenode('jobledger.events')::int8, pg_postmaster_start_time()";

/// The history of the log a statement run now reads.
pub async fn log_history(conn: &mut PgConnection) -> StoreResult<LogHistory> {
    let (table, storage, started) = sqlx::query_as(&format!("SELECT {HISTORY}"))
        .fetch_one(conn)
        .await?;
    Ok(LogHistory {
        table,
        storage,
        started,
    })
}

/// `data`, or with `keys` only those top-level keys of it, as an object
/// (`jsonb_build_object($5[1], data -> $5[1], …)`: the keys are bound in
/// `param`, a `text[]`; only their count shapes the statement). Taking keys
/// apart with `jsonb_each` instead cost more than reading the whole data
/// (42 ms against 29 ms a batch).
fn data_keys_sql(data: &str, param: &str, keys: Option<&[&str]>) -> String {
    let Some(keys) = keys else {
        return data.to_string();
    };
    if keys.is_empty() {
        return "'{}'::jsonb".to_string();
    }
    let pairs: Vec<String> = (1..=keys.len())
        .map(|i| format!("({param}::text[])[{i}], {data} -> ({param}::text[])[{i}]"))
        .collect();
    // A function takes at most 100 arguments: 50 keys an object, joined
    // with `||` (which keeps the later of a key named twice, as one
    // object does).
    pairs
        .chunks(50)
        .map(|c| format!("jsonb_build_object({})", c.join(", ")))
        .collect::<Vec<_>>()
        .join(" || ")
}

/// Of the given `(job_id, version)` pairs, those whose event lies past the
/// batch's end `(txid, position)`: one probe of the `(job_id, version)` key
/// each (`LATERAL` with `OFFSET 0`, so PostgreSQL cannot plan it as a walk
/// of the whole unread tail; seen: 1.6 s per batch on a 1M-event log).
pub async fn versions_past(
    conn: &mut PgConnection,
    end: (i64, i64),
    jobs: &[Uuid],
    versions: &[i64],
    data: DataAs<'_>,
) -> StoreResult<Vec<LoggedEvent>> {
    let (kinds, keys) = data.bound();
    let sql = format!(
        "SELECT e.txid::text::bigint AS txid, {} FROM unnest($3::uuid[], $4::int8[]) AS b(job_id, version) \
         CROSS JOIN LATERAL (SELECT * FROM jobledger.events x WHERE x.job_id = b.job_id \
                             AND x.version = b.version OFFSET 0) e \
         WHERE (e.txid, e.position) > ($1::text::xid8, $2)",
        data.columns(5)
    );
    Ok(sqlx::query(&sql)
        .bind(end.0)
        .bind(end.1)
        .bind(jobs)
        .bind(versions)
        .bind(kinds)
        .bind(keys)
        .try_map(move |r| logged_of(&r, data.raw()))
        .fetch_all(conn)
        .await?)
}

/// Per job, the versions below `up_to` that lie past the batch's end
/// `(txid, position)`, for jobs whose version `up_to` (the one just below
/// the batch's lowest) is itself past the end: the predecessor trap at a
/// batch's start, possibly several versions deep. A transaction that took
/// its xid early can append version n+1 with a smaller txid than version
/// n's. They are all committed: a version exists only after its
/// predecessor's transaction released the job's row lock.
///
/// Each job is walked down from `up_to - 1` and the walk stops at the first
/// version the checkpoint `after` has passed: every version below a passed
/// one was handed out when that one was (by the same rule), so the cost is
/// the few versions since the checkpoint, not the job's whole history (a
/// long job heartbeating for a day has thousands of versions).
pub async fn versions_below_walked(
    conn: &mut PgConnection,
    after: (i64, i64),
    end: (i64, i64),
    jobs: &[Uuid],
    up_to: &[i64],
    data: DataAs<'_>,
) -> StoreResult<Vec<LoggedEvent>> {
    let (kinds, keys) = data.bound();
    // Every step is one probe of the (job_id, version) key through LATERAL:
    // a plain join may be planned as a walk of the (txid, position) index
    // over the whole unread tail (seen: 1.6 s per batch on a 1M-event log).
    let sql = format!(
        "WITH RECURSIVE walk(job_id, version) AS ( \
            SELECT b.job_id, b.v - 1 FROM unnest($5::uuid[], $6::int8[]) AS b(job_id, v) WHERE b.v > 1 \
            UNION ALL \
            SELECT w.job_id, w.version - 1 FROM walk w CROSS JOIN LATERAL ( \
                SELECT x.txid, x.position FROM jobledger.events x \
                WHERE x.job_id = w.job_id AND x.version = w.version OFFSET 0) x \
            WHERE w.version > 1 AND (x.txid, x.position) > ($1::text::xid8, $2)) \
         SELECT e.txid::text::bigint AS txid, {} FROM walk w CROSS JOIN LATERAL ( \
            SELECT * FROM jobledger.events x WHERE x.job_id = w.job_id AND x.version = w.version OFFSET 0) e \
         WHERE (e.txid, e.position) > ($3::text::xid8, $4) ORDER BY e.job_id, e.version",
        data.columns(7)
    );
    Ok(sqlx::query(&sql)
        .bind(after.0)
        .bind(after.1)
        .bind(end.0)
        .bind(end.1)
        .bind(jobs)
        .bind(up_to)
        .bind(kinds)
        .bind(keys)
        .try_map(move |r| logged_of(&r, data.raw()))
        .fetch_all(conn)
        .await?)
}

/// Whether any committed event lies past the checkpoint, whether or not the
/// snapshot horizon lets a reader hand it out yet.
pub async fn any_after<'e>(exec: impl PgExecutor<'e>, txid: i64, position: i64) -> StoreResult<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM jobledger.events WHERE (txid, position) > ($1::text::xid8, $2))",
    )
    .bind(txid)
    .bind(position)
    .fetch_one(exec)
    .await?)
}

/// How far behind a checkpoint is: events not yet passed, the age of the
/// oldest of them, and the current snapshot horizon.
pub async fn lag<'e>(
    exec: impl PgExecutor<'e>,
    txid: i64,
    position: i64,
) -> StoreResult<(i64, Option<DateTime<Utc>>)> {
    Ok(sqlx::query_as(
        "SELECT count(*), min(recorded_at) FROM jobledger.events WHERE (txid, position) > ($1::text::xid8, $2)",
    )
    .bind(txid)
    .bind(position)
    .fetch_one(exec)
    .await?)
}

/// What holds the log horizon back, if anything (`jobledger.horizon_holder()`):
/// a session (in this database, or one not proven to be elsewhere) or a
/// prepared transaction, with its age.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct HolderRow {
    pub kind: String,
    pub xid: i64,
    pub pid: Option<i32>,
    pub database: Option<String>,
    pub open_seconds: Option<f64>,
    pub state: Option<String>,
    pub query: Option<String>,
    pub gid: Option<String>,
}

pub async fn horizon_holder<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Option<HolderRow>> {
    Ok(sqlx::query_as(
        "SELECT kind, xid::text::bigint AS xid, pid, database, open_seconds, state, query, gid \
         FROM jobledger.horizon_holder() LIMIT 1",
    )
    .fetch_optional(exec)
    .await?)
}

pub async fn reader_names<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<String>> {
    Ok(
        sqlx::query_scalar("SELECT name FROM jobledger.readers ORDER BY name")
            .fetch_all(exec)
            .await?,
    )
}

/// The last `(txid, position)` below the log horizon: where a reader that
/// only wants what comes next starts.
pub async fn log_tail<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Option<(i64, i64)>> {
    Ok(sqlx::query_as(
        "SELECT txid::text::bigint, position FROM jobledger.events \
         WHERE txid < (SELECT jobledger.log_horizon()) ORDER BY txid DESC, position DESC LIMIT 1",
    )
    .fetch_optional(exec)
    .await?)
}

#[cfg(test)]
mod tests {
    /// `at` counts `EVENT_COLUMNS` as the queries select them.
    #[test]
    fn at_finds_each_column_where_the_queries_select_it() {
        let selected: Vec<&str> = ["txid", "position"]
            .into_iter()
            .chain(super::EVENT_COLUMNS.split(',').map(str::trim))
            .collect();
        for (i, name) in selected.iter().enumerate().skip(2) {
            assert_eq!(super::at(name), i, "{name}");
        }
        assert_eq!(super::RAW_DATA, selected.len());
    }
}
