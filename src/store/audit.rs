//! Whole-log checks for an independent checker (`jobledger chaos`): each
//! answers the rows that break one invariant, so an empty answer is a pass.

use serde_json::Value;
use sqlx::PgExecutor;
use uuid::Uuid;

use super::StoreResult;

/// Jobs neither terminal nor explained: not succeeded, cancelled, dead or
/// awaiting a receipt, or dead without a reason code.
pub async fn unexplained_jobs<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(Uuid, String, String)>> {
    Ok(sqlx::query_as(
        "SELECT job_id, state, reason FROM jobledger.jobs \
         WHERE state NOT IN ('succeeded', 'cancelled', 'dead', 'awaiting_receipt') \
            OR (state = 'dead' AND coalesce(reason, '') = '') ORDER BY job_id",
    )
    .fetch_all(exec)
    .await?)
}

/// Jobs that entered `succeeded` more than once.
pub async fn double_successes<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(Uuid, i64)>> {
    Ok(sqlx::query_as(
        "SELECT job_id, count(*) FROM jobledger.events \
         WHERE to_state = 'succeeded' AND from_state IS DISTINCT FROM 'succeeded' \
         GROUP BY job_id HAVING count(*) > 1",
    )
    .fetch_all(exec)
    .await?)
}

/// Jobs whose versions are not exactly 1..n, or whose current row is not at
/// the last event's version.
pub async fn version_gaps<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT coalesce(j.job_id, e.job_id) FROM jobledger.jobs j \
         FULL JOIN (SELECT job_id, count(*) AS n, min(version) AS lo, max(version) AS hi \
                    FROM jobledger.events GROUP BY job_id) e ON e.job_id = j.job_id \
         WHERE e.job_id IS NULL OR e.lo <> 1 OR e.n <> e.hi \
            OR (j.job_id IS NOT NULL AND j.version <> e.hi)",
    )
    .fetch_all(exec)
    .await?)
}

/// State-changing events written with an older (epoch, token) than the
/// event before them: a write that should have been fenced out.
/// Observations are exempt: any worker may record one.
pub async fn token_regressions<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(Uuid, i64)>> {
    Ok(sqlx::query_as(
        "SELECT job_id, version FROM ( \
            SELECT job_id, version, type, epoch, token, \
                   max(epoch) OVER w AS max_epoch, \
                   max(token) FILTER (WHERE type <> 'observed') OVER w AS max_token \
            FROM jobledger.events WINDOW w AS (PARTITION BY job_id ORDER BY version \
                                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)) t \
         WHERE type <> 'observed' AND (epoch < max_epoch OR (epoch = max_epoch AND token < max_token))",
    )
    .fetch_all(exec)
    .await?)
}

/// Every job's key, state, epoch and result, with the token of the event
/// that made it succeed (if it did). Workflow parents are left out: they
/// never run, their state is their steps'.
pub async fn outcomes<'e>(
    exec: impl PgExecutor<'e>,
) -> StoreResult<Vec<(Uuid, Option<String>, String, i64, Option<i64>, Option<Value>)>> {
    Ok(sqlx::query_as(
        "SELECT j.job_id, j.job_key, j.state, j.epoch, \
                (SELECT e.token FROM jobledger.events e WHERE e.job_id = j.job_id \
                   AND e.to_state = 'succeeded' ORDER BY e.version LIMIT 1), j.result \
         FROM jobledger.jobs j WHERE j.workflow ->> 'role' IS DISTINCT FROM 'parent' ORDER BY j.job_id",
    )
    .fetch_all(exec)
    .await?)
}

/// Jobs that recorded a failure with this code at least once.
pub async fn jobs_that_failed_with<'e>(exec: impl PgExecutor<'e>, code: &str) -> StoreResult<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT DISTINCT job_id FROM jobledger.events WHERE type = 'failed' AND data->>'code' = $1",
    )
    .bind(code)
    .fetch_all(exec)
    .await?)
}

/// Refused writes by outcome (stale, conflict, ...).
pub async fn rejections_by_outcome<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(String, i64)>> {
    Ok(
        sqlx::query_as(
            "SELECT outcome, count(*) FROM jobledger.rejections GROUP BY outcome ORDER BY outcome",
        )
        .fetch_all(exec)
        .await?,
    )
}

/// Events carrying this reason code.
pub async fn count_reason<'e>(exec: impl PgExecutor<'e>, reason: &str) -> StoreResult<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM jobledger.events WHERE reason = $1")
            .bind(reason)
            .fetch_one(exec)
            .await?,
    )
}

/// Workflow parents whose state is not the rule table (docs/state-machine.md)
/// over their steps' states now, or that do not have their number of steps:
/// `(parent, state, the table's answer)`. The table is written here again,
/// in SQL, independently of `domain::workflow::parent_state`.
pub async fn parents_off_the_rule_table<'e>(
    exec: impl PgExecutor<'e>,
) -> StoreResult<Vec<(Uuid, String, String)>> {
    Ok(sqlx::query_as(
        "WITH s AS ( \
           SELECT (workflow ->> 'parent')::uuid AS parent, count(*) AS n, \
                  count(*) FILTER (WHERE state NOT IN ('succeeded', 'cancelled', 'dead')) AS open, \
                  count(*) FILTER (WHERE state = 'cancelled') AS cancelled, \
                  count(*) FILTER (WHERE state = 'dead') AS dead \
           FROM jobledger.jobs WHERE workflow ->> 'role' = 'step' GROUP BY 1), \
         t AS ( \
           SELECT p.job_id, p.state, (p.workflow ->> 'steps')::bigint AS steps, coalesce(s.n, 0) AS n, \
                  CASE WHEN s.open > 0 AND s.dead + s.cancelled = 0 THEN 'running' \
                       WHEN s.open > 0 THEN 'failing' \
                       WHEN s.dead > 0 THEN 'dead' \
                       WHEN s.cancelled > 0 THEN 'cancelled' \
                       ELSE 'succeeded' END AS expected \
           FROM jobledger.jobs p LEFT JOIN s ON s.parent = p.job_id \
           WHERE p.workflow ->> 'role' = 'parent') \
         SELECT job_id, state, CASE WHEN steps <> n THEN format('%s of %s steps', n, steps) ELSE expected END \
         FROM t WHERE state <> expected OR steps <> n ORDER BY job_id",
    )
    .fetch_all(exec)
    .await?)
}

/// Workflow steps (policy `cancel` or `hold`) claimed before one of their
/// prerequisites had succeeded: `(step, prerequisite's step name)`.
pub async fn steps_run_before_prerequisites<'e>(
    exec: impl PgExecutor<'e>,
) -> StoreResult<Vec<(Uuid, String)>> {
    Ok(sqlx::query_as(
        "SELECT s.job_id, pre ->> 'step' FROM jobledger.jobs s \
         CROSS JOIN LATERAL jsonb_array_elements(coalesce(s.workflow -> 'after', '[]')) pre \
         WHERE s.workflow ->> 'role' = 'step' AND s.workflow ->> 'on_dependency_failure' <> 'run' \
           AND EXISTS (SELECT 1 FROM jobledger.events c WHERE c.job_id = s.job_id AND c.type = 'claimed' \
                         AND c.position < coalesce((SELECT min(ok.position) FROM jobledger.events ok \
                                                    WHERE ok.job_id = (pre ->> 'job_id')::uuid \
                                                      AND ok.to_state = 'succeeded'), 9223372036854775807)) \
         ORDER BY 1",
    )
    .fetch_all(exec)
    .await?)
}

/// How many workflows and workflow steps the log holds.
pub async fn workflow_counts<'e>(exec: impl PgExecutor<'e>) -> StoreResult<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*) FILTER (WHERE workflow ->> 'role' = 'parent'), \
                count(*) FILTER (WHERE workflow ->> 'role' = 'step') FROM jobledger.jobs",
    )
    .fetch_one(exec)
    .await?)
}

/// From the log alone: per concurrency key (from each job's `enqueued`
/// event), the most leases held at once, sweeping lease starts (+1) and
/// ends (-1) by their database time, ends first at a tie.
pub async fn most_leased_per_key<'e>(exec: impl PgExecutor<'e>) -> StoreResult<Vec<(String, i64)>> {
    Ok(sqlx::query_as(
        "WITH keyed AS (SELECT job_id, data -> 'admission' ->> 'concurrency_key' AS k FROM jobledger.events \
                        WHERE version = 1 AND data -> 'admission' ? 'concurrency_key'), \
         d AS (SELECT k, e.recorded_at AS t, \
                 CASE WHEN e.to_state IN ('leased', 'cancel_requested') \
                        AND coalesce(e.from_state, '') NOT IN ('leased', 'cancel_requested') THEN 1 \
                      WHEN e.from_state IN ('leased', 'cancel_requested') \
                        AND e.to_state NOT IN ('leased', 'cancel_requested') THEN -1 ELSE 0 END AS d \
               FROM jobledger.events e JOIN keyed USING (job_id)) \
         SELECT k, max(n)::int8 FROM (SELECT k, sum(d) OVER (PARTITION BY k ORDER BY t, d) AS n FROM d WHERE d <> 0) x \
         GROUP BY k ORDER BY k",
    )
    .fetch_all(exec)
    .await?)
}
