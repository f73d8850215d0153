-- Issue 15, the claim's scans as one function. This replaces the two
-- functions of 20261206000001 (due_jobs, expired_leases), which had landed:
-- that file stays byte for byte as it landed (sqlx refuses a database whose
-- applied migration was modified since), and everything below was first
-- written into it by mistake after it landed (review of the reread).
DROP FUNCTION jobledger.due_jobs(text, bigint);
DROP FUNCTION jobledger.expired_leases(text, text, bigint);

-- A claim walks jobs_due (due jobs) and jobs_leases (expired leases) in
-- their order, whatever the statistics say.
--
-- Why (issue 15, the history fall-off): a claim asks for the first due jobs
-- of a queue by (priority, run_at), which jobs_due gives in order. The
-- search index jobs_search_state (state, created_at, job_id) also finds
-- queued rows, out of order, so it needs a sort. While the statistics say
-- no job is queued (ANALYZE ran while the queues were empty, and
-- autoanalyze waits for 10 % of the table to change: 1M rows on a 10M-row
-- table), both paths are costed at one row and the search index won on its
-- column correlation. A burst of 50,000 jobs on top of 1M finished ones
-- then made every claim read and sort all 30,000 queued rows: 62 ms and
-- 13,500 buffers per claim, W3 at 2,037 jobs/s against 6,208 on an empty
-- log (docs/benchmarks.md). The claim's two scans (expired leases first,
-- then due jobs) are planned here with sorts off, so the only plan left
-- for each is the index that gives its order: a claim's cost no
-- longer depends on how fresh the statistics are. The limited path
-- (store::admission, queues with limits or a rate) is not covered yet.
--
-- A queue under control (paused, limits, rate) yields nothing here, and
-- nothing of it is locked: the check (jobledger.queue_controlled, a STABLE
-- function, so it reads its caller's snapshot) is part of each scan's own
-- query and reads the same snapshot as that scan. So a claim that waited
-- for its lock on jobs before its snapshot sees a pause committed meanwhile
-- (review: checked in the calling statement, it read an older snapshot and
-- took the paused queue's jobs). A pause committing while a scan is under
-- way is not ordered with it, as before this change.
--
-- Expired leases first, then as many due jobs as the limit leaves: two
-- queries, so no final sort (a sort with no other plan carries the
-- planner's disable cost, which is above the JIT thresholds: the first
-- version, one query, JIT-compiled every claim, 245 ms) and no due row is
-- locked beyond the limit. Rows are taken as columns, never as a whole-row
-- value (review: a whole-row value pulled every large payload into the
-- CTE's store, 37 MB of temp files per claim of 50 jobs of 192 KB).
-- STRICT: no argument may be NULL (a NULL limit meant no limit).
--
-- The rows come out of the locking query itself, so a row that a
-- transaction committing meanwhile changed is returned at its new version,
-- as the claim's fenced write needs (store::jobs::lock_claimable). PL/pgSQL
-- caches the plans (custom, then generic), each made under the SET.

CREATE FUNCTION jobledger.queue_controlled(q text) RETURNS boolean
    LANGUAGE sql STABLE STRICT
AS $$
    SELECT EXISTS (SELECT 1 FROM jobledger.queues c
                   WHERE c.queue = q AND (c.paused OR c.limits <> '{}' OR c.rate IS NOT NULL))
$$;

CREATE FUNCTION jobledger.claimable_jobs(q text, holder text, n bigint) RETURNS SETOF jobledger.jobs
    LANGUAGE plpgsql VOLATILE STRICT
    SET enable_sort = off
AS $$
DECLARE
    got bigint;
BEGIN
    RETURN QUERY
        SELECT j.* FROM jobledger.jobs j
        WHERE NOT (SELECT jobledger.queue_controlled(q))
          AND j.queue = q AND j.state IN ('leased', 'cancel_requested') AND j.lease_until <= now()
          AND j.policy ->> 'on_lease_expiry' = 'reconcile' AND j.holder IS DISTINCT FROM claimable_jobs.holder
        ORDER BY j.lease_until
        LIMIT n FOR UPDATE OF j SKIP LOCKED;
    GET DIAGNOSTICS got = ROW_COUNT;
    IF got < n THEN
        RETURN QUERY
            SELECT j.* FROM jobledger.jobs j
            WHERE NOT (SELECT jobledger.queue_controlled(q))
              AND j.queue = q AND j.state = 'queued' AND j.run_at <= now()
            ORDER BY j.priority, j.run_at
            LIMIT n - got FOR UPDATE OF j SKIP LOCKED;
    END IF;
END
$$;

-- Claiming is the workers' (and the admin's) business, not the readers'.
REVOKE EXECUTE ON FUNCTION jobledger.claimable_jobs(text, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION jobledger.claimable_jobs(text, text, bigint) TO jobledger_worker, jobledger_admin;
