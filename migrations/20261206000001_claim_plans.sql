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
-- longer depends on how fresh the statistics are. A queue under control
-- (paused, limits, rate) passes n = 0 and nothing is locked.
--
-- PL/pgSQL: the plan is cached per session (planned once, under the SET).
-- The rows come out of the locking query itself, so a row that a
-- transaction committing meanwhile changed is returned at its new version,
-- as the claim's fenced write needs (store::jobs::lock_claimable).

CREATE FUNCTION jobledger.due_jobs(q text, n bigint) RETURNS SETOF jobledger.jobs
    LANGUAGE plpgsql VOLATILE
    SET enable_sort = off
AS $$
BEGIN
    RETURN QUERY
        SELECT * FROM jobledger.jobs j
        WHERE j.queue = q AND j.state = 'queued' AND j.run_at <= now()
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
        ORDER BY j.lease_until
        LIMIT n FOR UPDATE SKIP LOCKED;
END
$$;

-- Claiming is the workers' (and the admin's) business, not the readers'.
REVOKE EXECUTE ON FUNCTION jobledger.due_jobs(text, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION jobledger.expired_leases(text, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION jobledger.due_jobs(text, bigint) TO jobledger_worker, jobledger_admin;
GRANT EXECUTE ON FUNCTION jobledger.expired_leases(text, text, bigint) TO jobledger_worker, jobledger_admin;
