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
-- xid, which `pg_current_snapshot()` shows everyone anyway). Replication
-- slots hold back vacuum's horizon, never a snapshot's, so they do not
-- appear here. On a hot standby a snapshot lists no in-progress xids (they
-- are all "sub-xids" there), so it falls back to the snapshot's xmin.
CREATE FUNCTION jobledger.log_horizon() RETURNS xid8
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN pg_is_in_recovery() THEN pg_snapshot_xmin(pg_current_snapshot())
                ELSE coalesce(min(x.x), pg_snapshot_xmax(pg_current_snapshot())) END
    FROM pg_snapshot_xip(pg_current_snapshot()) AS x(x)
    WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                      WHERE a.backend_xid = x.x::xid AND a.datname IS NOT NULL
                        AND a.datname <> current_database())
      AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts p
                      WHERE p.transaction = x.x::xid AND p.database <> current_database())
$$;

-- What holds the horizon back, if anything: the in-progress transaction
-- whose xid is the horizon, as a session or a prepared transaction (or
-- neither, when it ended a moment ago or cannot be seen). The query text is
-- shown only to a caller (the session's login role) that could read it in
-- `pg_stat_activity` itself: a member of the session's role or of
-- `pg_read_all_stats`. Everything else is what `pg_stat_activity` shows
-- anyone.
CREATE FUNCTION jobledger.horizon_holder()
RETURNS TABLE (kind text, xid xid8, pid integer, database text, open_seconds float8, state text,
               query text, gid text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH h AS (SELECT jobledger.log_horizon() AS x, pg_snapshot_xmax(pg_current_snapshot()) AS xmax),
    held AS (SELECT x FROM h WHERE x < xmax),
    sessions AS (
        SELECT 'session'::text, held.x, a.pid, a.datname::text,
               extract(epoch FROM now() - a.xact_start)::float8, a.state,
               CASE WHEN pg_has_role(session_user, a.usesysid, 'MEMBER')
                      OR pg_has_role(session_user, 'pg_read_all_stats', 'MEMBER')
                    THEN left(a.query, 120) END,
               NULL::text
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
-- the event of the same job and version that produces the row's fold
-- columns (state, reason, epoch, token, attempt, run, time, hash; for an
-- update also the from-state; for an insert the enqueued event's queue,
-- kind, key, payload, priority and policy). Deferred to the commit, so the
-- write path may update the row and append the event in either order within
-- one statement or transaction. A leaked worker credential (or a
-- hand-written "fix") can no longer mark a job done without a trace in the
-- log, the relay and every consumer. (The remaining columns come from the
-- event's data through `apply`; checking them here would be a second state
-- machine. A writer who appends a false event at least leaves it in the log,
-- relayed, and `verify` finds the row differs from the event's replay.)
CREATE FUNCTION jobledger.check_job_has_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM jobledger.events e
                   WHERE e.job_id = NEW.job_id AND e.version = NEW.version
                     AND e.txid = pg_current_xact_id()
                     AND e.to_state = NEW.state AND e.reason = NEW.reason AND e.hash = NEW.last_hash
                     AND e.epoch = NEW.epoch AND e.token = NEW.token AND e.attempt = NEW.attempt
                     AND e.run = NEW.run AND e.recorded_at = NEW.updated_at
                     AND CASE WHEN TG_OP = 'UPDATE' THEN e.from_state = OLD.state
                         ELSE e.type = 'enqueued' AND e.data ->> 'queue' = NEW.queue
                              AND e.data ->> 'kind' = NEW.kind
                              AND (e.data ->> 'job_key') IS NOT DISTINCT FROM NEW.job_key
                              AND e.data ->> 'payload_digest' = NEW.payload_digest
                              AND e.data -> 'payload' = NEW.payload
                              AND (e.data ->> 'priority')::smallint = NEW.priority
                              AND e.data -> 'policy' = NEW.policy END) THEN
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

-- What a job is never changes after its enqueue (a replay is a new run of
-- the same job), and every update is exactly one event: the version goes up
-- by one.
CREATE FUNCTION jobledger.check_job_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.job_id, NEW.queue, NEW.kind, NEW.job_key, NEW.epoch, NEW.payload, NEW.payload_digest,
        NEW.policy, NEW.priority, NEW.created_at)
       IS DISTINCT FROM
       (OLD.job_id, OLD.queue, OLD.kind, OLD.job_key, OLD.epoch, OLD.payload, OLD.payload_digest,
        OLD.policy, OLD.priority, OLD.created_at) THEN
        RAISE EXCEPTION 'job % : its identity, payload and policy never change', OLD.job_id
            USING ERRCODE = 'JL001';
    END IF;
    IF NEW.version <> OLD.version + 1 THEN
        RAISE EXCEPTION 'job % : version % follows %, not one event', OLD.job_id, NEW.version, OLD.version
            USING ERRCODE = 'JL001';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER jobs_update_shape BEFORE UPDATE ON jobledger.jobs
    FOR EACH ROW EXECUTE FUNCTION jobledger.check_job_update();

-- A reused key's new lifecycle gets a higher epoch than every purged one of
-- the same key (consumers fence per queue-qualified key on the epoch first).
-- The epoch is part of the `enqueued` event's hash, so it is drawn before
-- the inserting statement; this check runs after the row went in, i.e.
-- after the unique index on (queue, job_key) waited for a purge of the same
-- key in flight. `key_floors` holds, per key, the highest epoch any purged
-- lifecycle had (kept by a trigger on tombstones).
--   READ COMMITTED (the default; `Ledger::enqueue`): the check reads the
--   floor with a fresh snapshot, so a purge that committed between the
--   epoch's draw and the insert is always seen. Nothing is written.
--   REPEATABLE READ / SERIALIZABLE (a caller's own transaction): its
--   snapshot may predate the purge, so the check writes the floor instead:
--   a purge that committed after the snapshot makes that write a
--   serialization failure (40001), one in flight makes it wait and then
--   fail the same way.
-- Either way a lower epoch is refused with SQLSTATE JL002 (retryable):
-- the enqueue draws a new epoch.
CREATE TABLE jobledger.key_floors (
    queue    text NOT NULL,
    job_key  text NOT NULL,
    epoch    bigint NOT NULL,
    PRIMARY KEY (queue, job_key)
);
INSERT INTO jobledger.key_floors (queue, job_key, epoch)
    SELECT queue, job_key, max(epoch) FROM jobledger.tombstones WHERE job_key IS NOT NULL
    GROUP BY queue, job_key;
GRANT SELECT, INSERT, UPDATE ON jobledger.key_floors TO jobledger_worker, jobledger_admin;

CREATE FUNCTION jobledger.raise_key_floor() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO jobledger.key_floors AS f (queue, job_key, epoch) VALUES (NEW.queue, NEW.job_key, NEW.epoch)
    ON CONFLICT (queue, job_key) DO UPDATE SET epoch = EXCLUDED.epoch WHERE f.epoch < EXCLUDED.epoch;
    RETURN NULL;
END
$$;

CREATE TRIGGER tombstones_key_floor AFTER INSERT ON jobledger.tombstones
    FOR EACH ROW WHEN (NEW.job_key IS NOT NULL) EXECUTE FUNCTION jobledger.raise_key_floor();

CREATE FUNCTION jobledger.check_key_epoch() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    floor_epoch bigint;
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        SELECT f.epoch INTO floor_epoch FROM jobledger.key_floors f
        WHERE f.queue = NEW.queue AND f.job_key = NEW.job_key;
        IF floor_epoch IS NULL OR floor_epoch < NEW.epoch THEN
            RETURN NULL;
        END IF;
    ELSE
        INSERT INTO jobledger.key_floors AS f (queue, job_key, epoch) VALUES (NEW.queue, NEW.job_key, NEW.epoch)
        ON CONFLICT (queue, job_key) DO UPDATE SET epoch = f.epoch WHERE f.epoch < EXCLUDED.epoch
        RETURNING f.epoch INTO floor_epoch;
        IF floor_epoch IS NOT NULL THEN
            RETURN NULL;
        END IF;
        SELECT f.epoch INTO floor_epoch FROM jobledger.key_floors f
        WHERE f.queue = NEW.queue AND f.job_key = NEW.job_key;
    END IF;
    RAISE EXCEPTION 'epoch % of key % in queue % is below purged lifecycle epoch %',
        NEW.epoch, NEW.job_key, NEW.queue, floor_epoch
        USING ERRCODE = 'JL002', HINT = 'draw a new epoch and enqueue again';
END
$$;

CREATE TRIGGER jobs_key_epoch AFTER INSERT ON jobledger.jobs
    FOR EACH ROW WHEN (NEW.job_key IS NOT NULL) EXECUTE FUNCTION jobledger.check_key_epoch();
