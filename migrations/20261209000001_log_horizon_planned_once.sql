-- Issue 15 (rebuilds, the relay): the log horizon is planned once per
-- session instead of on every read.
--
-- jobledger.log_horizon() was a SQL function. One with a SET clause (its
-- search_path, needed as it is SECURITY DEFINER) is never inlined, and
-- PostgreSQL 15 plans a SQL function's body afresh on every call. Planning
-- its query over pg_stat_activity (a view of three joins) read about 500
-- catalog buffers and took 2-3 ms, on every batch a log reader reads:
-- a fifth of a 5,000-event read of a rebuild (EXPLAIN (ANALYZE, BUFFERS),
-- docs/benchmarks.md). PL/pgSQL keeps the plan for the session, and with
-- plan_cache_mode forced to generic it never plans it again: 0.03 ms.
--
-- The body is the same query (the horizon's promise is unchanged: see
-- 20261201000001_log_order.sql). STABLE as before: it reads the calling
-- statement's snapshot, and a STABLE PL/pgSQL function takes none of its own.
CREATE OR REPLACE FUNCTION jobledger.log_horizon() RETURNS xid8
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    s pg_snapshot := pg_current_snapshot();
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN pg_snapshot_xmin(s);
    END IF;
    RETURN (SELECT coalesce(min(x.x), pg_snapshot_xmax(s))
            FROM pg_snapshot_xip(s) AS x(x)
            WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                              WHERE a.backend_xid = x.x::xid AND a.datname IS NOT NULL
                                AND a.datname <> current_database())
              AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts p
                              WHERE p.transaction = x.x::xid AND p.database <> current_database()));
END $$;
