-- jobledger core schema: the append-only event log, the inline current-state
-- projection, and tombstones of purged jobs.

CREATE SCHEMA IF NOT EXISTS jobledger;

-- Lifecycle numbers. NO CYCLE: a wrapped sequence would hand out an old epoch
-- again, and the whole point of an epoch is that it is never reused.
CREATE SEQUENCE jobledger.epoch_seq AS bigint MINVALUE 1 NO CYCLE;

CREATE TABLE jobledger.events (
    position     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The writing transaction. Positions commit out of order; a log reader
    -- follows (txid, position) below pg_snapshot_xmin so it never skips a
    -- late-committing transaction (see docs/log-reader.md).
    txid         xid8 NOT NULL DEFAULT pg_current_xact_id(),
    job_id       uuid NOT NULL,
    version      bigint NOT NULL CHECK (version >= 1),
    type         text NOT NULL,
    from_state   text,
    to_state     text NOT NULL,
    reason       text NOT NULL,
    error_class  text,
    actor        text NOT NULL,
    epoch        bigint NOT NULL,
    token        bigint NOT NULL CHECK (token >= 0),
    attempt      integer NOT NULL,
    run          integer NOT NULL,
    data         jsonb NOT NULL,
    -- Read from the database clock (clock_timestamp()) under the job's row lock.
    recorded_at  timestamptz NOT NULL,
    prev_hash    text,
    hash         text NOT NULL,
    CONSTRAINT events_job_version UNIQUE (job_id, version)
);

CREATE INDEX events_txid ON jobledger.events (txid, position);
-- Observations are deduplicated by key, per job, by the database itself.
CREATE UNIQUE INDEX events_observation_key ON jobledger.events (job_id, (data ->> 'key'))
    WHERE type = 'observed';

-- History is never rewritten: corrections are new events.
CREATE FUNCTION jobledger.refuse_event_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'jobledger.events is append-only: % refused', TG_OP
        USING ERRCODE = 'P0001', HINT = 'append a correcting event instead';
END
$$;

CREATE TRIGGER events_no_update BEFORE UPDATE OR DELETE ON jobledger.events
    FOR EACH ROW EXECUTE FUNCTION jobledger.refuse_event_change();
CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON jobledger.events
    FOR EACH STATEMENT EXECUTE FUNCTION jobledger.refuse_event_change();

-- The database checks the chain links itself (the application computes the
-- hashes; `verify` recomputes them): version n's prev_hash is version n-1's
-- hash, and version 1 has none. A gap or a forged link cannot be inserted.
-- Per row, through the (job_id, version) key: a plan that stays an index
-- probe whatever the table's statistics say (a set-based check over the
-- transition table was measured to fall back to scanning the whole log).
CREATE FUNCTION jobledger.check_event_link() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    prev text;
BEGIN
    IF NEW.version = 1 THEN
        IF NEW.prev_hash IS NOT NULL THEN
            RAISE EXCEPTION 'first event of job % must not have a prev_hash', NEW.job_id;
        END IF;
        RETURN NEW;
    END IF;
    SELECT hash INTO prev FROM jobledger.events WHERE job_id = NEW.job_id AND version = NEW.version - 1;
    IF prev IS NULL OR prev IS DISTINCT FROM NEW.prev_hash THEN
        RAISE EXCEPTION 'event % of job % does not link to version %', NEW.version, NEW.job_id, NEW.version - 1;
    END IF;
    RETURN NEW;
END
$$;

-- A first event without a prev_hash needs no lookup; the WHEN clause keeps
-- the function from being called for it at all (bulk enqueues).
CREATE TRIGGER events_link BEFORE INSERT ON jobledger.events
    FOR EACH ROW WHEN (NEW.version <> 1 OR NEW.prev_hash IS NOT NULL)
    EXECUTE FUNCTION jobledger.check_event_link();

-- Wakes log readers (relay, projections); delivered at commit, deduplicated
-- per transaction.
CREATE FUNCTION jobledger.notify_events() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('jobledger_events', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER events_notify AFTER INSERT ON jobledger.events
    FOR EACH STATEMENT EXECUTE FUNCTION jobledger.notify_events();

-- The inline projection: exactly the fold of each job's events.
CREATE TABLE jobledger.jobs (
    job_id           uuid PRIMARY KEY,
    queue            text NOT NULL,
    kind             text NOT NULL,
    job_key          text,
    epoch            bigint NOT NULL UNIQUE,
    token            bigint NOT NULL,
    run              integer NOT NULL,
    attempt          integer NOT NULL,
    state            text NOT NULL CHECK (state IN ('queued', 'leased', 'cancel_requested',
                         'awaiting_receipt', 'succeeded', 'cancelled', 'dead')),
    priority         smallint NOT NULL,
    payload          jsonb NOT NULL,
    payload_digest   text NOT NULL,
    policy           jsonb NOT NULL,
    run_at           timestamptz NOT NULL,
    lease_until      timestamptz,
    holder           text,
    next_action      text NOT NULL,
    step             text,
    receipt_id       text,
    receipt_deadline timestamptz,
    result           jsonb,
    release          jsonb,
    last_error       jsonb,
    reason           text NOT NULL,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    version          bigint NOT NULL,
    last_hash        text NOT NULL
);

-- Every transition updates a row and leaves a dead tuple behind in the
-- claim's partial index; vacuum this table far more eagerly than the default
-- (20 % of the table) so claims do not step over a growing backlog of them.
ALTER TABLE jobledger.jobs SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02);

-- Unique per queue among jobs that still exist; reusable after purge.
CREATE UNIQUE INDEX jobs_queue_key ON jobledger.jobs (queue, job_key) WHERE job_key IS NOT NULL;
CREATE INDEX jobs_due ON jobledger.jobs (queue, priority, run_at) WHERE state = 'queued';
CREATE INDEX jobs_leases ON jobledger.jobs (queue, lease_until) WHERE state IN ('leased', 'cancel_requested');
CREATE INDEX jobs_receipts ON jobledger.jobs (receipt_deadline) WHERE state = 'awaiting_receipt';
CREATE INDEX jobs_terminal ON jobledger.jobs (updated_at) WHERE state IN ('succeeded', 'cancelled', 'dead');
CREATE INDEX jobs_dead_reason ON jobledger.jobs (reason, updated_at) WHERE state = 'dead';

-- Wakes idle workers when something becomes claimable, and tells a holder at
-- once that a cancel was requested (so it stops at its next step boundary,
-- not at its next heartbeat). Statement-level: one pass per batch; pg_notify
-- deduplicates identical notifications within a transaction.
CREATE FUNCTION jobledger.notify_inserted_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('jobledger_queued', q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs WHERE state = 'queued') q;
    RETURN NULL;
END
$$;

CREATE FUNCTION jobledger.notify_updated_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('jobledger_queued', q.queue)
    FROM (SELECT DISTINCT n.queue FROM new_jobs n JOIN old_jobs o USING (job_id)
          WHERE n.state = 'queued' AND o.state <> 'queued') q;
    PERFORM pg_notify('jobledger_cancel', n.job_id::text)
    FROM new_jobs n JOIN old_jobs o USING (job_id)
    WHERE n.state = 'cancel_requested' AND o.state <> 'cancel_requested';
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_notify_insert AFTER INSERT ON jobledger.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION jobledger.notify_inserted_jobs();

CREATE TRIGGER jobs_notify_update AFTER UPDATE ON jobledger.jobs
    REFERENCING OLD TABLE AS old_jobs NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION jobledger.notify_updated_jobs();

-- Per-kind policies registered by workers; enqueue copies the kind's policy
-- into the job (and its `enqueued` event) when the caller gives none.
CREATE TABLE jobledger.kind_policies (
    queue       text NOT NULL,
    kind        text NOT NULL,
    policy      jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, kind)
);

-- What is left of a purged job: enough to answer `stale` to anything from its
-- lifecycle and to check its chain head. Its events stay in the log.
CREATE TABLE jobledger.tombstones (
    job_id     uuid PRIMARY KEY,
    queue      text NOT NULL,
    job_key    text,
    epoch      bigint NOT NULL UNIQUE,
    token      bigint NOT NULL,
    state      text NOT NULL,
    version    bigint NOT NULL,
    last_hash  text NOT NULL,
    release    jsonb,
    purged_at  timestamptz NOT NULL
);

-- Writes the fence refused (stale, conflict, invalid transition). They change
-- no job, so they are not in the job's event stream; they are kept here so a
-- job's history can show "a late worker tried to write, and was refused".
CREATE TABLE jobledger.rejections (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id       uuid NOT NULL,
    command      text NOT NULL,
    outcome      text NOT NULL,
    epoch        bigint,
    token        bigint,
    actor        text NOT NULL,
    detail       text NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX rejections_job ON jobledger.rejections (job_id, id);

CREATE TRIGGER rejections_no_update BEFORE UPDATE OR DELETE ON jobledger.rejections
    FOR EACH ROW EXECUTE FUNCTION jobledger.refuse_event_change();
