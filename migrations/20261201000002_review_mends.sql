-- Issue 9, second review: what a leaked worker or admin credential could
-- still do with hand-written SQL (docs/guarantees.md "What the database
-- refuses").

-- An event's place in the log is the database's, never the writer's. With
-- INSERT on the whole table a writer could give an event a txid below a
-- reader's checkpoint (the reader never sees it: a gap downstream) or far
-- in the future (every reader is "behind" forever), or take the next
-- identity values by OVERRIDING SYSTEM VALUE (honest appends then fail on
-- the primary key). Column privileges leave `position` and `txid` to their
-- defaults (the identity and `pg_current_xact_id()`); naming either column
-- in an INSERT is refused (42501). The ledger never names them.
REVOKE INSERT ON jobledger.events FROM jobledger_worker, jobledger_admin;
GRANT INSERT (job_id, version, type, from_state, to_state, reason, error_class, actor,
              epoch, token, attempt, run, data, recorded_at, prev_hash, hash)
    ON jobledger.events TO jobledger_worker, jobledger_admin;

-- The per-key epoch floor is kept by the database alone: the triggers that
-- read and raise it run as the owner, and no role may write it directly
-- (a worker that could lower it could give a reused key a lower epoch; one
-- that could raise it could make a key unusable).
ALTER FUNCTION jobledger.check_key_epoch() SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION jobledger.raise_key_floor() SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
REVOKE INSERT, UPDATE, DELETE ON jobledger.key_floors FROM jobledger_worker, jobledger_admin;

-- A jobs row is inserted only at version 1, by the job's first event (an
-- admin who may delete rows could otherwise delete a job and insert it
-- again at a later version with another queue, kind or epoch, next to a
-- forged second `enqueued` event).
CREATE OR REPLACE FUNCTION jobledger.check_job_has_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM jobledger.events e
                   WHERE e.job_id = NEW.job_id AND e.version = NEW.version
                     AND e.txid = pg_current_xact_id()
                     AND e.to_state = NEW.state AND e.reason = NEW.reason AND e.hash = NEW.last_hash
                     AND e.epoch = NEW.epoch AND e.token = NEW.token AND e.attempt = NEW.attempt
                     AND e.run = NEW.run AND e.recorded_at = NEW.updated_at
                     AND CASE WHEN TG_OP = 'UPDATE' THEN e.from_state = OLD.state
                         ELSE NEW.version = 1 AND e.prev_hash IS NULL
                              AND e.type = 'enqueued' AND e.data ->> 'queue' = NEW.queue
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

-- A jobs row goes only with a purge: the `purged` event that follows the
-- row's last version, appended in the same transaction, and the tombstone
-- that records it. A plain DELETE would make a live job vanish with no
-- trace in the log (and free its key for reuse).
CREATE FUNCTION jobledger.check_job_purged() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM jobledger.events e
                   JOIN jobledger.tombstones t ON t.job_id = e.job_id AND t.version = e.version
                                              AND t.last_hash = e.hash
                   WHERE e.job_id = OLD.job_id AND e.version = OLD.version + 1
                     AND e.type = 'purged' AND e.prev_hash = OLD.last_hash
                     AND e.txid = pg_current_xact_id()) THEN
        RAISE EXCEPTION 'jobledger.jobs row of job % deleted without its purge event and tombstone',
            OLD.job_id
            USING ERRCODE = 'JL001',
                  HINT = 'a job leaves the projection only by a purge (jobledger purge)';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER jobs_need_purge AFTER DELETE ON jobledger.jobs
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION jobledger.check_job_purged();

-- A tombstone is written only by a purge: the `purged` event of the same
-- job and version with the same hash, appended in the same transaction. A
-- bare tombstone would raise the key's epoch floor (the floor trigger runs
-- as the owner) or squat on a live job's id so that its purge fails.
CREATE FUNCTION jobledger.check_tombstone_purged() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM jobledger.events e
                   WHERE e.job_id = NEW.job_id AND e.version = NEW.version AND e.type = 'purged'
                     AND e.hash = NEW.last_hash AND e.epoch = NEW.epoch
                     AND e.txid = pg_current_xact_id())
       OR EXISTS (SELECT 1 FROM jobledger.jobs j WHERE j.job_id = NEW.job_id) THEN
        RAISE EXCEPTION 'tombstone of job % written without its purge', NEW.job_id
            USING ERRCODE = 'JL001',
                  HINT = 'a job leaves the projection only by a purge (jobledger purge)';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER tombstones_need_purge AFTER INSERT ON jobledger.tombstones
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION jobledger.check_tombstone_purged();

-- The projection runner keeps its checkpoints in its registry; the reader
-- row it used to create under the name `projections` was never moved, so
-- `stats` reported its whole log as lag. Dropped where it never moved.
DELETE FROM jobledger.readers WHERE name = 'projections' AND position = 0 AND lease_holder IS NULL;
