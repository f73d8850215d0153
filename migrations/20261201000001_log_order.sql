-- Issue 9: the log's order promise and the edges an outside review broke.

-- The log readers' horizon (docs/log-reader.md). Every event with a txid
-- below it comes from a finished transaction, so nothing can ever commit
-- behind a checkpoint below it. It is the smallest transaction id still in
-- progress in the calling statement's snapshot (or the snapshot's xmax),
-- leaving out transactions proven to belong to another database of the
-- cluster: a backend connected elsewhere, or a transaction prepared
-- elsewhere, can never write this database's events. Anything not proven
-- foreign counts as ours, so a race can only make a reader wait, never
-- skip. STABLE: it reads the caller's snapshot. SECURITY DEFINER: only a
-- privileged owner sees other roles' `backend_xid` (the function answers one
-- xid and nothing else). Replication slots hold back vacuum's horizon, never
-- a snapshot's, so they do not appear here.
CREATE FUNCTION jobledger.log_horizon() RETURNS xid8
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(min(x.x), pg_snapshot_xmax(pg_current_snapshot()))
    FROM pg_snapshot_xip(pg_current_snapshot()) AS x(x)
    WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                      WHERE a.backend_xid = x.x::xid AND a.datname IS NOT NULL
                        AND a.datname <> current_database())
      AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts p
                      WHERE p.transaction = x.x::xid AND p.database <> current_database())
$$;

-- What holds the horizon back, if anything: the in-progress transaction
-- whose xid is the horizon, as a session or a prepared transaction (or
-- neither, when it ended a moment ago or cannot be seen). Query text of
-- other roles is shown to the ledger's own roles only.
CREATE FUNCTION jobledger.horizon_holder()
RETURNS TABLE (kind text, xid xid8, pid integer, database text, open_seconds float8, state text,
               query text, gid text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH h AS (SELECT jobledger.log_horizon() AS x, pg_snapshot_xmax(pg_current_snapshot()) AS xmax),
    held AS (SELECT x FROM h WHERE x < xmax),
    sessions AS (
        SELECT 'session'::text, held.x, a.pid, a.datname::text,
               extract(epoch FROM now() - a.xact_start)::float8, a.state, left(a.query, 120), NULL::text
        FROM held JOIN pg_stat_activity a ON a.backend_xid = held.x::xid),
    prepared AS (
        SELECT 'prepared'::text, held.x, NULL::integer, p.database::text,
               extract(epoch FROM now() - p.prepared)::float8, 'prepared'::text, NULL::text, p.gid
        FROM held JOIN pg_prepared_xacts p ON p.transaction = held.x::xid)
    SELECT * FROM sessions
    UNION ALL SELECT * FROM prepared
    UNION ALL
    SELECT 'unknown', held.x, NULL, NULL, NULL, NULL, NULL, NULL FROM held
    WHERE NOT EXISTS (SELECT 1 FROM sessions) AND NOT EXISTS (SELECT 1 FROM prepared)
$$;
REVOKE EXECUTE ON FUNCTION jobledger.horizon_holder() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION jobledger.horizon_holder() TO jobledger_worker, jobledger_reader, jobledger_admin;

-- The projection is never changed without the event that produces it: every
-- insert or update of a `jobs` row must come, in the same transaction, with
-- the event of the same job and version whose target state and hash the row
-- carries. Deferred to the commit, so the write path may update the row and
-- append the event in either order within one statement or transaction.
-- A leaked worker credential (or a hand-written "fix") can no longer mark a
-- job done without a trace in the log, the relay and every consumer.
CREATE FUNCTION jobledger.check_job_has_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM jobledger.events e
                   WHERE e.job_id = NEW.job_id AND e.version = NEW.version
                     AND e.txid = pg_current_xact_id()
                     AND e.to_state = NEW.state AND e.hash = NEW.last_hash) THEN
        RAISE EXCEPTION 'jobledger.jobs row of job % (version %, state %) written without its event',
            NEW.job_id, NEW.version, NEW.state
            USING ERRCODE = 'JL001',
                  HINT = 'every change of a job is an event appended in the same transaction';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER jobs_need_event AFTER INSERT OR UPDATE ON jobledger.jobs
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION jobledger.check_job_has_event();

-- A reused key's new lifecycle gets a higher epoch than every purged one of
-- the same key (consumers fence per queue-qualified key on the epoch first).
-- The epoch is part of the `enqueued` event's hash, so it is drawn before
-- the inserting statement; this check runs after the row went in, i.e.
-- after the unique index on (queue, job_key) waited for a purge of the same
-- key in flight, and reads with a fresh snapshot, so a purge that committed
-- between the epoch's draw and the insert is always seen. The enqueue then
-- draws a new epoch (SQLSTATE JL002 is retryable).
CREATE INDEX tombstones_key ON jobledger.tombstones (queue, job_key, epoch) WHERE job_key IS NOT NULL;

CREATE FUNCTION jobledger.check_key_epoch() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    newer bigint;
BEGIN
    SELECT max(t.epoch) INTO newer FROM jobledger.tombstones t
    WHERE t.queue = NEW.queue AND t.job_key = NEW.job_key AND t.epoch > NEW.epoch;
    IF newer IS NOT NULL THEN
        RAISE EXCEPTION 'epoch % of key % in queue % is below purged lifecycle epoch %',
            NEW.epoch, NEW.job_key, NEW.queue, newer
            USING ERRCODE = 'JL002', HINT = 'draw a new epoch and enqueue again';
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_key_epoch AFTER INSERT ON jobledger.jobs
    FOR EACH ROW WHEN (NEW.job_key IS NOT NULL) EXECUTE FUNCTION jobledger.check_key_epoch();
