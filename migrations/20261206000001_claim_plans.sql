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
-- log (docs/benchmarks.md). Each scan is planned here with sorts off, so
-- the only plan left is the index that gives the order: a claim's cost no
-- longer depends on how fresh the statistics are. The limited path
-- (store::admission, queues with limits or a rate) is not covered yet.
--
-- A queue under control (paused, limits, rate) yields nothing here, and
-- nothing of it is locked: that check is part of each scan's own query, so
-- it reads the same snapshot as the scan. (Review: checked in the calling
-- statement, it read an older snapshot than the functions' queries, which
-- take theirs after waiting for their locks, and a claim could lock jobs of
-- a queue paused before it read any job.)
--
-- The rows come out of the locking query itself, so a row that a
-- transaction committing meanwhile changed is returned at its new version,
-- as the claim's fenced write needs (store::jobs::lock_claimable). Each call
-- is planned for its arguments, always under the SET.

CREATE FUNCTION jobledger.due_jobs(q text, n bigint) RETURNS SETOF jobledger.jobs
    LANGUAGE plpgsql VOLATILE
    SET enable_sort = off
AS $$
BEGIN
    RETURN QUERY
        SELECT * FROM jobledger.jobs j
        WHERE j.queue = q AND j.state = 'queued' AND j.run_at <= now()
          AND NOT EXISTS (SELECT 1 FROM jobledger.queues c
                          WHERE c.queue = q AND (c.paused OR c.limits <> '{}' OR c.rate IS NOT NULL))
        ORDER BY j.priority, j.run_at
        LIMIT n FOR UPDATE SKIP LOCKED;
END
$$;

CREATE FUNCTION jobledger.expired_leases(q text, holder text, n bigint) RETURNS SETOF jobledger.jobs
    LANGUAGE plpgsql VOLATILE
    SET enable_sort = off
AS $$
BEGIN
    RETURN QUERY
        SELECT * FROM jobledger.jobs j
        WHERE j.queue = q AND j.state IN ('leased', 'cancel_requested') AND j.lease_until <= now()
          AND j.policy ->> 'on_lease_expiry' = 'reconcile' AND j.holder IS DISTINCT FROM expired_leases.holder
          AND NOT EXISTS (SELECT 1 FROM jobledger.queues c
                          WHERE c.queue = q AND (c.paused OR c.limits <> '{}' OR c.rate IS NOT NULL))
        ORDER BY j.lease_until
        LIMIT n FOR UPDATE SKIP LOCKED;
END
$$;

-- Claiming is the workers' (and the admin's) business, not the readers'.
REVOKE EXECUTE ON FUNCTION jobledger.due_jobs(text, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION jobledger.expired_leases(text, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION jobledger.due_jobs(text, bigint) TO jobledger_worker, jobledger_admin;
GRANT EXECUTE ON FUNCTION jobledger.expired_leases(text, text, bigint) TO jobledger_worker, jobledger_admin;
