//! Queries on `jobledger.jobs`, the inline projection and the fence.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::columns::{unnest, EventArrays, NewJobArrays, EVENT_TYPES, NEW_JOB_COLUMNS};
use super::rows::{EventRow, JobRow, EVENT_COLUMNS, JOB_COLUMNS};
use super::{StoreError, StoreResult};
use crate::domain::Job;

/// A locked row and the database clock read while holding its lock.
#[derive(Debug, sqlx::FromRow)]
pub struct Locked {
    #[sqlx(flatten)]
    pub row: JobRow,
    pub db_now: DateTime<Utc>,
}

/// Inserts new jobs and their first events in one statement (`jobs[i]` is
/// what `apply` made of `events[i]`). Jobs whose `(queue, job_key)` already
/// exists are skipped, and so are their events. Returns `(job_id, position)`
/// of what was inserted.
pub async fn insert_new_jobs(
    conn: &mut PgConnection,
    jobs: &[&Job],
    events: Vec<EventRow>,
) -> StoreResult<Vec<(Uuid, i64)>> {
    let sql = insert_jobs_sql("", "true", "");
    let q = sqlx::query_as(&sql);
    let q = EventArrays::of(events).bind_all(q);
    let q = NewJobArrays::of(jobs).bind_all(q);
    Ok(q.fetch_all(conn).await?)
}

/// What an enqueue took from the ledger's remembered context instead of
/// reading it (ledger::context), for its insert to check.
#[derive(Debug, Clone)]
pub struct ContextCheck {
    /// The jobs' time: the database clock as last read plus what the
    /// client measured since.
    pub now: DateTime<Utc>,
    /// How far behind the database clock `now` may be.
    pub within_ms: i64,
    /// `[[queue, kind, policy or null], ...]`: the registered policy each
    /// (queue, kind) was taken to have (null: none registered).
    pub policies: serde_json::Value,
}

/// `insert_new_jobs` for a remembered context: writes nothing and answers
/// None unless, when the statement checks (before it inserts; a lock it
/// then waits for can make the insert later, as with a context read
/// afresh), `now` is not ahead of the database clock nor more than
/// `within_ms` behind it, and every policy
/// the jobs were given is still the one registered. Outside a transaction
/// only: it leaves the wake-ups to the caller, after the commit (`wake`;
/// migration 20261207000001).
pub async fn insert_new_jobs_checked(
    conn: &mut PgConnection,
    jobs: &[&Job],
    events: Vec<EventRow>,
    check: &ContextCheck,
) -> StoreResult<Option<Vec<(Uuid, i64)>>> {
    let n = EVENT_TYPES.len() + NEW_JOB_COLUMNS.len();
    // The check's CTE is evaluated once; the insert takes no row when it
    // fails, and the answer then carries one row of NULLs.
    let ok = format!(
        "ok AS (SELECT set_config('jobledger.wake_after_commit', statement_timestamp()::text, true) IS NOT NULL \
                  AND ${a}::timestamptz <= clock_timestamp() \
                  AND clock_timestamp() - ${a} <= make_interval(secs => ${b}::float8 / 1000) \
                  AND NOT EXISTS (SELECT 1 FROM jsonb_array_elements(${c}::jsonb) g \
                      LEFT JOIN jobledger.kind_policies p ON p.queue = g ->> 0 AND p.kind = g ->> 1 \
                      WHERE p.policy IS DISTINCT FROM nullif(g -> 2, 'null'::jsonb)) AS ok), ",
        a = n + 1,
        b = n + 2,
        c = n + 3
    );
    let sql = insert_jobs_sql(
        &ok,
        "(SELECT ok FROM ok)",
        " UNION ALL SELECT NULL::uuid, NULL::int8 FROM ok WHERE NOT ok",
    );
    let q = sqlx::query_as(&sql);
    let q = EventArrays::of(events).bind_all(q);
    let q = NewJobArrays::of(jobs).bind_all(q);
    let got: Vec<(Option<Uuid>, Option<i64>)> = q
        .bind(check.now)
        .bind(check.within_ms)
        .bind(&check.policies)
        .fetch_all(conn)
        .await?;
    if got.iter().any(|(id, _)| id.is_none()) {
        return Ok(None);
    }
    Ok(Some(
        got.into_iter().filter_map(|(id, at)| Some((id?, at?))).collect(),
    ))
}

/// The wake-ups `insert_new_jobs_checked` left out (log readers, and idle
/// workers of `queues`, those with a queued job among the written), sent
/// after its commit, in a transaction of their own that holds PostgreSQL's notify
/// lock only briefly: its commit does not wait for a flush (it wrote
/// nothing that needs one).
pub async fn wake<'e>(exec: impl PgExecutor<'e>, queues: &[String]) -> StoreResult<()> {
    sqlx::query(
        "SELECT set_config('synchronous_commit', 'off', true), pg_notify('jobledger_events', ''), \
                (SELECT count(pg_notify('jobledger_queued', q)) FROM unnest($1::text[]) q)",
    )
    .bind(queues)
    .execute(exec)
    .await?;
    Ok(())
}

/// The insert of new jobs and events, with `with` before its CTEs, `cond`
/// on the jobs taken and `tail` after its answer.
fn insert_jobs_sql(with: &str, cond: &str, tail: &str) -> String {
    let types: Vec<&str> = EVENT_TYPES
        .iter()
        .copied()
        .chain(NEW_JOB_COLUMNS.iter().map(|(_, t)| *t))
        .collect();
    let names = NEW_JOB_COLUMNS
        .iter()
        .map(|(c, _)| *c)
        .collect::<Vec<_>>()
        .join(", ");
    let events = EVENT_COLUMNS
        .split(',')
        .map(|c| format!("u.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ");
    let job = JOB_COLUMNS
        .split(',')
        .map(|c| new_job_column(c.trim()))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "WITH {with}u AS MATERIALIZED (SELECT * FROM {} AS u({EVENT_COLUMNS}, {names})), \
              j AS (INSERT INTO jobledger.jobs ({JOB_COLUMNS}) SELECT {job} FROM u WHERE {cond} \
                    ON CONFLICT (queue, job_key) WHERE job_key IS NOT NULL DO NOTHING RETURNING job_id), \
              e AS (INSERT INTO jobledger.events ({EVENT_COLUMNS}) \
                    SELECT {events} FROM u WHERE u.job_id IN (SELECT job_id FROM j) \
                    ORDER BY u.job_id RETURNING job_id, position) \
         SELECT job_id, position FROM e{tail}",
        unnest(&types, 1)
    )
}

/// A new job's `column`, as `apply` makes it of its first event (row `u` of
/// the insert: the event's columns and `NEW_JOB_COLUMNS`): what the event
/// holds comes from it, a new job's lease, receipt, release and error are
/// empty. The statement checks (`jobs_need_event_insert`) compare the two
/// as for any other insert, and `verify` compares the row with its replay.
fn new_job_column(column: &str) -> String {
    match column {
        c if NEW_JOB_COLUMNS.iter().any(|(n, _)| *n == c) => format!("u.{c}"),
        "job_id" | "epoch" | "token" | "run" | "attempt" | "reason" | "version" => format!("u.{column}"),
        "state" => "u.to_state".into(),
        "created_at" | "updated_at" => "u.recorded_at".into(),
        "last_hash" => "u.hash".into(),
        "payload" | "policy" => format!("u.data -> '{column}'"),
        "lease_until" | "receipt_deadline" => "NULL::timestamptz".into(),
        "holder" | "step" | "receipt_id" => "NULL::text".into(),
        "release" | "last_error" => "NULL::jsonb".into(),
        other => unreachable!("a new job's column {other} has no source"),
    }
}

pub async fn find_job<'e>(exec: impl PgExecutor<'e>, job_id: Uuid) -> StoreResult<Option<JobRow>> {
    let sql = format!("SELECT {JOB_COLUMNS} FROM jobledger.jobs WHERE job_id = $1");
    Ok(sqlx::query_as(&sql).bind(job_id).fetch_optional(exec).await?)
}

pub async fn find_job_by_key<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
    key: &str,
) -> StoreResult<Option<JobRow>> {
    let sql = format!("SELECT {JOB_COLUMNS} FROM jobledger.jobs WHERE queue = $1 AND job_key = $2");
    Ok(sqlx::query_as(&sql)
        .bind(queue)
        .bind(key)
        .fetch_optional(exec)
        .await?)
}

/// Locks the rows (in id order, so two batches never deadlock) and reads the
/// database clock after the locks are granted.
pub async fn lock_jobs(conn: &mut PgConnection, ids: &[Uuid]) -> StoreResult<Vec<Locked>> {
    let sql = clock_after_locks(&format!(
        "SELECT {JOB_COLUMNS} FROM jobledger.jobs WHERE job_id = ANY($1) ORDER BY job_id FOR UPDATE"
    ));
    Ok(sqlx::query_as(&sql).bind(ids).fetch_all(conn).await?)
}

/// `select` (rows of `jobledger.jobs` locked `FOR UPDATE`, which may wait),
/// answered with the database clock read once every one of its rows is
/// locked, as `db_now`, in `job_id` order. A clock read beside each row is
/// read when the row is scanned, before the wait for its lock: a write
/// waiting behind a transaction that then rolled back decided at a time as
/// old as the wait (a heartbeat extended a lease from the past; review of
/// issue 15). The count makes the locking scan finish before the clock is
/// read.
pub(super) fn clock_after_locks(select: &str) -> String {
    format!(
        "WITH l AS ({select}) SELECT l.*, t.db_now FROM l, \
         (SELECT clock_timestamp() AS db_now FROM (SELECT count(*) FROM l) c) t ORDER BY l.job_id"
    )
}

/// A locked row's generation: what the fenced update checks (epoch, token,
/// state, version), the head of its chain, and the clock read once the
/// batch's rows are locked.
#[derive(Debug, sqlx::FromRow)]
pub struct Generation {
    pub job_id: Uuid,
    pub epoch: i64,
    pub token: i64,
    pub state: String,
    pub version: i64,
    pub last_hash: String,
    pub db_now: DateTime<Utc>,
}

/// Locks the rows like `lock_jobs` but reads only each row's generation.
/// For a caller that holds copies of the jobs (a worker's leases) and reads
/// in full only the rows that moved since (`ledger::engine::transition_many`).
pub async fn lock_generations(conn: &mut PgConnection, ids: &[Uuid]) -> StoreResult<Vec<Generation>> {
    Ok(sqlx::query_as(&clock_after_locks(
        "SELECT job_id, epoch, token, state, version, last_hash \
         FROM jobledger.jobs WHERE job_id = ANY($1) ORDER BY job_id FOR UPDATE",
    ))
    .bind(ids)
    .fetch_all(conn)
    .await?)
}

/// Locks the rows nobody else holds, skipping the others (in id order): the
/// purger never waits for live work, so it can never be part of a deadlock
/// (a replay locks a step, then its parent; a purge batch may hold both).
pub async fn lock_jobs_skip_locked(conn: &mut PgConnection, ids: &[Uuid]) -> StoreResult<Vec<Locked>> {
    let sql = format!(
        "SELECT {JOB_COLUMNS}, clock_timestamp() AS db_now FROM jobledger.jobs \
         WHERE job_id = ANY($1) ORDER BY job_id FOR UPDATE SKIP LOCKED"
    );
    Ok(sqlx::query_as(&sql).bind(ids).fetch_all(conn).await?)
}

/// What a claim takes, in one statement: expired leases whose kind's policy
/// is reconcile (taken over) first, then as many due queued jobs as the
/// limit leaves (highest priority, i.e. lowest number, then oldest); each
/// locked `SKIP LOCKED`. A queue under control (paused, limits, rate) takes
/// the limited path (`store::admission`): here it yields nothing and
/// nothing of it is locked, checked in the same snapshot as each scan.
///
/// The scans are the function `jobledger.claimable_jobs`, planned with sorts
/// off: each walks its index in the order asked, whatever the statistics
/// say (stale ones made claims sort every queued row; migration
/// 20261206000003).
///
/// The rows come out of the locking queries themselves: a row that a
/// transaction committing during this statement changed is locked at its new
/// version (PostgreSQL re-checks it), and that version is what the claim
/// decides on. Reading the rows again by id would see the statement's
/// snapshot, the old version, and the fenced write would then miss.
pub async fn lock_claimable(
    conn: &mut PgConnection,
    queue: &str,
    holder: &str,
    limit: i64,
) -> StoreResult<Vec<Locked>> {
    let sql = format!(
        "SELECT {JOB_COLUMNS}, clock_timestamp() AS db_now \
         FROM jobledger.claimable_jobs($1, $3, $2) ORDER BY job_id"
    );
    Ok(sqlx::query_as(&sql)
        .bind(queue)
        .bind(limit)
        .bind(holder)
        .fetch_all(conn)
        .await?)
}

/// What the sweeper acts on: expired leases under requeue/dead policies or on
/// their last attempt, and receipts past their deadline.
pub async fn lock_sweepable(conn: &mut PgConnection, limit: i64) -> StoreResult<Vec<Locked>> {
    let sql = format!(
        "SELECT {JOB_COLUMNS}, clock_timestamp() AS db_now FROM jobledger.jobs WHERE job_id IN ( \
           (SELECT job_id FROM jobledger.jobs WHERE state IN ('leased', 'cancel_requested') \
              AND lease_until <= now() \
              AND (policy ->> 'on_lease_expiry' <> 'reconcile' OR attempt >= (policy ->> 'max_attempts')::int) \
            LIMIT $1) \
           UNION ALL \
           (SELECT job_id FROM jobledger.jobs WHERE state = 'awaiting_receipt' AND receipt_deadline <= now() LIMIT $1)) \
         ORDER BY job_id FOR UPDATE SKIP LOCKED"
    );
    Ok(sqlx::query_as(&sql).bind(limit).fetch_all(conn).await?)
}

pub async fn delete_jobs(conn: &mut PgConnection, ids: &[Uuid]) -> StoreResult<u64> {
    Ok(sqlx::query("DELETE FROM jobledger.jobs WHERE job_id = ANY($1)")
        .bind(ids)
        .execute(conn)
        .await?
        .rows_affected())
}

/// Dead jobs whose death reason is `reason` and that died within the range.
pub async fn dead_job_ids<'e>(
    exec: impl PgExecutor<'e>,
    reason: &str,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM jobledger.jobs WHERE state = 'dead' AND reason = $1 \
         AND ended_at >= $2 AND ended_at < $3 ORDER BY ended_at, job_id",
    )
    .bind(reason)
    .bind(since)
    .bind(until)
    .fetch_all(exec)
    .await?)
}

/// Terminal jobs that ended more than `older_than_ms` ago by the database clock.
pub async fn purgeable_job_ids<'e>(
    exec: impl PgExecutor<'e>,
    older_than_ms: i64,
    limit: i64,
) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM jobledger.jobs WHERE state IN ('succeeded', 'cancelled', 'dead') \
         AND ended_at < now() - make_interval(secs => $1::double precision / 1000) ORDER BY ended_at LIMIT $2",
    )
    .bind(older_than_ms)
    .bind(limit)
    .fetch_all(exec)
    .await?)
}

pub async fn count_by_state<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(String, i64)>> {
    Ok(
        sqlx::query_as("SELECT state, count(*) FROM jobledger.jobs GROUP BY state ORDER BY state")
            .fetch_all(exec)
            .await?,
    )
}

/// What an enqueue of `n` jobs needs, in one round trip: `n` fresh epochs
/// from the never-cycling sequence, the database clock, and the policies
/// registered for the given (queue, kind) pairs.
pub async fn enqueue_context(
    conn: &mut PgConnection,
    n: i64,
    queues: &[String],
    kinds: &[String],
) -> StoreResult<(Vec<i64>, DateTime<Utc>, Vec<(String, String, serde_json::Value)>)> {
    let (epochs, now, policies): (Vec<i64>, DateTime<Utc>, serde_json::Value) = sqlx::query_as(
        "SELECT (SELECT array_agg(nextval('jobledger.epoch_seq')) FROM generate_series(1, $1::bigint)), \
                clock_timestamp(), \
                (SELECT coalesce(jsonb_agg(jsonb_build_array(p.queue, p.kind, p.policy)), '[]'::jsonb) \
                 FROM jobledger.kind_policies p JOIN unnest($2::text[], $3::text[]) AS k(queue, kind) USING (queue, kind))",
    )
    .bind(n)
    .bind(queues)
    .bind(kinds)
    .fetch_one(conn)
    .await?;
    let policies =
        serde_json::from_value(policies).map_err(|e| StoreError::Corrupt(format!("kind policies: {e}")))?;
    Ok((epochs, now, policies))
}

pub async fn jobs_by_ids<'e>(exec: impl PgExecutor<'e>, ids: &[Uuid]) -> StoreResult<Vec<JobRow>> {
    let sql = format!("SELECT {JOB_COLUMNS} FROM jobledger.jobs WHERE job_id = ANY($1)");
    Ok(sqlx::query_as(&sql).bind(ids).fetch_all(exec).await?)
}

/// Projection rows with no event at all: a row written around the log.
pub async fn orphan_job_ids<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM jobledger.jobs j WHERE NOT EXISTS \
         (SELECT 1 FROM jobledger.events e WHERE e.job_id = j.job_id)",
    )
    .fetch_all(exec)
    .await?)
}

pub async fn count_by_state_in_queue<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
) -> StoreResult<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT state, count(*) FROM jobledger.jobs WHERE queue = $1 GROUP BY state ORDER BY state",
    )
    .bind(queue)
    .fetch_all(exec)
    .await?)
}

/// Per queue, the age in seconds of the oldest job not yet in a terminal
/// state (the seeds' "oldest pending age").
pub async fn oldest_open_age<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(String, f64)>> {
    Ok(sqlx::query_as(
        "SELECT queue, extract(epoch FROM now() - min(created_at))::float8 FROM jobledger.jobs \
         WHERE state NOT IN ('succeeded', 'cancelled', 'dead') GROUP BY queue",
    )
    .fetch_all(exec)
    .await?)
}

/// `(job_id, queue, job_key)` of live or purged jobs: what the relay puts in
/// a message's key and body.
pub async fn job_keys<'e>(exec: impl PgExecutor<'e>, ids: &[Uuid]) -> StoreResult<Vec<JobKeys>> {
    // A purged step's tie is read from its first event (tombstones keep none).
    Ok(sqlx::query_as(
        "SELECT job_id, queue, job_key, workflow ->> 'parent' AS parent, workflow ->> 'step' AS step \
         FROM jobledger.jobs WHERE job_id = ANY($1) \
         UNION ALL SELECT t.job_id, t.queue, t.job_key, e.data -> 'workflow' ->> 'parent', \
                          e.data -> 'workflow' ->> 'step' \
         FROM jobledger.tombstones t JOIN jobledger.events e ON e.job_id = t.job_id AND e.version = 1 \
         WHERE t.job_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(exec)
    .await?)
}

/// What the relay puts on a job's messages besides the event: its queue and
/// key (the message key) and, for a workflow step, its parent and name.
#[derive(Debug, Clone, Default, sqlx::FromRow)]
pub struct JobKeys {
    pub job_id: Uuid,
    pub queue: String,
    pub job_key: Option<String>,
    pub parent: Option<String>,
    pub step: Option<String>,
}

/// `(job_id, state, version)` of a queue's jobs, in id order.
pub async fn states_in_queue<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
) -> StoreResult<Vec<(Uuid, String, i64)>> {
    Ok(
        sqlx::query_as("SELECT job_id, state, version FROM jobledger.jobs WHERE queue = $1 ORDER BY job_id")
            .bind(queue)
            .fetch_all(exec)
            .await?,
    )
}

/// The rebuilt projection's live jobs (`jobledger_proj.jobs_rebuilt`), each
/// as the JSON text it keeps: the caller parses it, so a row that does not
/// parse is named rather than failing the read.
pub async fn rebuilt_jobs<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(Uuid, String)>> {
    Ok(
        sqlx::query_as("SELECT job_id, job FROM jobledger_proj.jobs_rebuilt WHERE NOT purged")
            .fetch_all(exec)
            .await?,
    )
}

/// Jobs of `jobledger.jobs` without a live row in `jobs_rebuilt`.
pub async fn jobs_not_rebuilt<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT j.job_id FROM jobledger.jobs j WHERE NOT EXISTS \
         (SELECT 1 FROM jobledger_proj.jobs_rebuilt r WHERE r.job_id = j.job_id AND NOT r.purged) \
         ORDER BY j.job_id",
    )
    .fetch_all(exec)
    .await?)
}
