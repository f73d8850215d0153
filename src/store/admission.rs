//! The claim of a queue with limits (migration 20261202000008): candidates
//! with their concurrency key and cap, the per-key locks and counts that
//! make a cap hold across workers, and the rate limit's sliding window.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};
use uuid::Uuid;

use super::jobs::Locked;
use super::rows::JOB_COLUMNS;
use super::StoreResult;

/// A claimable row of a limited queue, locked.
#[derive(Debug, sqlx::FromRow)]
pub struct Candidate {
    #[sqlx(flatten)]
    pub locked: Locked,
    pub ckey: Option<String>,
    /// The smallest `max` of the limits covering it (None: no limit does).
    pub cap: Option<i32>,
}

/// Claimable rows of a limited queue, locked with SKIP LOCKED: expired
/// leases under the reconcile policy first, then due jobs: the first
/// `pool` in line, and besides them the first few jobs of each of `keys`
/// (from `walk_keys`), at most `pool` of those, so a hot key's backlog,
/// however long and old, cannot crowd the other keys out, and a queue of
/// many keys costs a claim no more than its pool. Due jobs whose key holds its cap
/// already are no candidates. Nothing when the queue is paused. Each
/// row's `rn` is its place within its key (1 for unkeyed jobs).
pub async fn lock_candidates(
    conn: &mut PgConnection,
    queue: &str,
    holder: &str,
    pool: i64,
    keys: &[String],
) -> StoreResult<Vec<Candidate>> {
    let covers = |j: &str| {
        format!(
            "(lim.kind IS NULL OR lim.kind = {j}.kind) AND (lim.pat IS NULL OR {j}.admission ->> 'concurrency_key' LIKE lim.pat)"
        )
    };
    let key = "admission ->> 'concurrency_key'";
    // The job's key holds its cap already (under some limit covering it).
    let saturated = |j: &str| {
        format!(
            "EXISTS (SELECT 1 FROM held h JOIN lim ON {} WHERE h.ckey = {j}.{key} AND h.n >= lim.max)",
            covers(j)
        )
    };
    let keyed_due = "queue = $1 AND state = 'queued' AND admission ? 'concurrency_key'";
    let sql = format!(
        "WITH ctl AS (SELECT limits FROM jobledger.queues WHERE queue = $1 AND NOT paused), \
         lim AS (SELECT l.value ->> 'kind' AS kind, l.value ->> 'like' AS pat, (l.value ->> 'max')::int AS max \
                 FROM ctl, jsonb_each(ctl.limits) l), \
         held AS (SELECT {key} AS ckey, count(*) AS n FROM jobledger.jobs \
                  WHERE queue = $1 AND state IN ('leased', 'cancel_requested') AND admission ? 'concurrency_key' \
                  GROUP BY 1), \
         heads AS ( \
            SELECT job_id, rn FROM ( \
              SELECT h.job_id, h.rn, h.priority, h.run_at FROM unnest($4::text[]) keys(k), LATERAL ( \
                SELECT job_id, priority, run_at, row_number() OVER (ORDER BY priority, run_at) AS rn FROM ( \
                  SELECT job_id, priority, run_at FROM jobledger.jobs \
                  WHERE {keyed_due} AND {key} = keys.k AND run_at <= now() \
                  ORDER BY priority, run_at LIMIT least($2, (SELECT coalesce(max(max), 1) FROM lim))) x) h \
              ) hh \
            ORDER BY rn, priority, run_at LIMIT $2), \
         line AS (SELECT job_id, 1::int8 AS rn FROM jobledger.jobs l \
                  WHERE queue = $1 AND state = 'queued' AND run_at <= now() AND NOT {} \
                  ORDER BY priority, run_at LIMIT $2), \
         cand AS (SELECT job_id, min(rn) AS rn FROM (SELECT * FROM heads UNION ALL SELECT * FROM line) c \
                  WHERE EXISTS (SELECT 1 FROM ctl) GROUP BY job_id), \
         expired AS ( \
            SELECT {JOB_COLUMNS}, 0 AS pick, 1::int8 AS rn FROM jobledger.jobs \
            WHERE queue = $1 AND state IN ('leased', 'cancel_requested') AND lease_until <= now() \
              AND EXISTS (SELECT 1 FROM ctl) \
              AND policy ->> 'on_lease_expiry' = 'reconcile' AND holder IS DISTINCT FROM $3 \
            ORDER BY lease_until LIMIT $2 FOR UPDATE SKIP LOCKED), \
         due AS ( \
            SELECT {}, 1 AS pick, cand.rn FROM jobledger.jobs j JOIN cand USING (job_id) \
            WHERE j.state = 'queued' AND j.run_at <= now() \
              AND NOT {} \
            FOR UPDATE OF j SKIP LOCKED) \
         SELECT {JOB_COLUMNS}, clock_timestamp() AS db_now, p.{key} AS ckey, \
           (SELECT min(lim.max) FROM lim WHERE p.admission ? 'concurrency_key' AND {}) AS cap \
         FROM (SELECT * FROM expired UNION ALL SELECT * FROM due) p ORDER BY pick, rn, priority, run_at, job_id",
        saturated("l"),
        JOB_COLUMNS.split(", ").map(|c| format!("j.{c}")).collect::<Vec<_>>().join(", "),
        saturated("j"),
        covers("p"),
    );
    Ok(sqlx::query_as(&sql)
        .bind(queue)
        .bind(pool)
        .bind(holder)
        .bind(keys)
        .fetch_all(conn)
        .await?)
}

/// Up to `budget` distinct keys of the queue's due keyed jobs, in key
/// order after `after` (from the start when None), one index probe each (a
/// loose scan of `jobs_key_due`), each with whether it holds its cap under
/// a limit of every kind (kind-scoped limits are left to the claim).
pub async fn walk_keys<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
    after: Option<&str>,
    budget: i64,
) -> StoreResult<Vec<(String, bool)>> {
    let key = "admission ->> 'concurrency_key'";
    let keyed_due = "queue = $1 AND state = 'queued' AND admission ? 'concurrency_key'";
    let sql = format!(
        "WITH RECURSIVE keys AS ( \
            (SELECT {key} AS k, 1 AS n FROM jobledger.jobs \
             WHERE {keyed_due} AND ($2::text IS NULL OR {key} > $2) ORDER BY {key} LIMIT 1) \
            UNION ALL \
            SELECT (SELECT {key} FROM jobledger.jobs WHERE {keyed_due} AND {key} > keys.k ORDER BY 1 LIMIT 1), \
                   keys.n + 1 \
            FROM keys WHERE keys.k IS NOT NULL AND keys.n < $3), \
         lim AS (SELECT l.value ->> 'like' AS pat, (l.value ->> 'max')::int AS max \
                 FROM jobledger.queues q, jsonb_each(q.limits) l \
                 WHERE q.queue = $1 AND l.value ->> 'kind' IS NULL) \
         SELECT k, coalesce((SELECT count(*) FROM jobledger.jobs WHERE queue = $1 \
                   AND state IN ('leased', 'cancel_requested') AND {key} = keys.k) \
                   >= (SELECT min(max) FROM lim WHERE lim.pat IS NULL OR keys.k LIKE lim.pat), false) \
         FROM keys WHERE k IS NOT NULL ORDER BY n"
    );
    Ok(sqlx::query_as(&sql)
        .bind(queue)
        .bind(after)
        .bind(budget)
        .fetch_all(exec)
        .await?)
}

/// Per-key transaction locks, in the order given (callers sort): a
/// limited claim counts a key's leases only while it holds the key, so two
/// claims never both see the same free slot. Released at commit.
pub async fn lock_keys(conn: &mut PgConnection, queue: &str, keys: &[String]) -> StoreResult<()> {
    if keys.is_empty() {
        return Ok(());
    }
    // unnest keeps the array's order and the function runs per row in it.
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtextextended('jobledger.key:' || $1 || ':' || k, 0)) \
         FROM unnest($2::text[]) k",
    )
    .bind(queue)
    .bind(keys)
    .execute(conn)
    .await?;
    Ok(())
}

/// Leases each key holds now (a fresh snapshot: after `lock_keys`, every
/// claim that held a key before us has committed), not counting `except`
/// (expired leases this claim is about to take over).
pub async fn held_per_key<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
    keys: &[String],
    except: &[Uuid],
) -> StoreResult<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT admission ->> 'concurrency_key', count(*) FROM jobledger.jobs \
         WHERE queue = $1 AND state IN ('leased', 'cancel_requested') AND admission ? 'concurrency_key' \
           AND admission ->> 'concurrency_key' = ANY($2) AND job_id <> ALL($3) GROUP BY 1",
    )
    .bind(queue)
    .bind(keys)
    .bind(except)
    .fetch_all(exec)
    .await?)
}

/// The queue's rate terms, its row locked: rate-limited claims of one
/// queue serialise here, so the window's count is never read twice.
pub async fn lock_rate(conn: &mut PgConnection, queue: &str) -> StoreResult<Option<serde_json::Value>> {
    Ok(
        // Only a rated queue's row: claims of a queue with limits alone
        // need not wait for each other here (their keys' locks order them).
        sqlx::query_scalar(
            "SELECT rate FROM jobledger.queues WHERE queue = $1 AND rate IS NOT NULL FOR UPDATE",
        )
        .bind(queue)
        .fetch_optional(conn)
        .await?
        .flatten(),
    )
}

/// Claims granted in the window ending now, and when the oldest of them
/// leaves it (when the next slot frees up).
pub async fn rate_used<'e>(
    exec: impl PgExecutor<'e>,
    queue: &str,
    per_ms: i64,
) -> StoreResult<(i64, Option<DateTime<Utc>>)> {
    Ok(sqlx::query_as(
        "SELECT coalesce(sum(n), 0)::int8, min(at) + make_interval(secs => $2::double precision / 1000) \
         FROM jobledger.rate_claims \
         WHERE queue = $1 AND at > clock_timestamp() - make_interval(secs => $2::double precision / 1000)",
    )
    .bind(queue)
    .bind(per_ms)
    .fetch_one(exec)
    .await?)
}

/// Records `n` claims now and drops what has left the window.
pub async fn record_rate(conn: &mut PgConnection, queue: &str, n: i64, per_ms: i64) -> StoreResult<()> {
    sqlx::query(
        "WITH gone AS (DELETE FROM jobledger.rate_claims \
           WHERE queue = $1 AND at <= clock_timestamp() - make_interval(secs => $3::double precision / 1000)) \
         INSERT INTO jobledger.rate_claims (queue, at, n) VALUES ($1, clock_timestamp(), $2)",
    )
    .bind(queue)
    .bind(n as i32)
    .bind(per_ms)
    .execute(conn)
    .await?;
    Ok(())
}

/// Whether the claim must take the limited path (paused, limited or rated).
pub async fn queue_is_controlled<'e>(exec: impl PgExecutor<'e>, queue: &str) -> StoreResult<(bool, bool)> {
    Ok(sqlx::query_as(
        "SELECT coalesce(bool_or(paused), false), coalesce(bool_or(limits <> '{}' OR rate IS NOT NULL), false) \
         FROM jobledger.queues WHERE queue = $1",
    )
    .bind(queue)
    .fetch_one(exec)
    .await?)
}
