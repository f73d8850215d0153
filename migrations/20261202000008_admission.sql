-- Issue 13: what decides when a job may start besides its state and run_at:
-- per-key concurrency limits and per-queue rate limits (recorded in the
-- queue's control stream), uniqueness windows, and periodic schedules.

-- A job's admission terms, from its `enqueued` event and never changed
-- after: {"concurrency_key": K} and/or {"unique_until": T}. NULL for a job
-- that has neither (every job before this migration).
ALTER TABLE jobledger.jobs ADD COLUMN admission jsonb;

-- The limited claim counts the leases each key holds (docs/admission.md).
CREATE INDEX jobs_key_held ON jobledger.jobs (queue, (admission ->> 'concurrency_key'))
    WHERE state IN ('leased', 'cancel_requested') AND admission ? 'concurrency_key';
-- ... and walks the distinct keys of due jobs (a loose index scan), taking
-- each key's first jobs in turn, so one key's backlog cannot fill a claim.
CREATE INDEX jobs_key_due ON jobledger.jobs (queue, (admission ->> 'concurrency_key'), priority, run_at)
    WHERE state = 'queued' AND admission ? 'concurrency_key';

CREATE OR REPLACE FUNCTION jobledger.check_job_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.job_id, NEW.queue, NEW.kind, NEW.job_key, NEW.epoch, NEW.payload, NEW.payload_digest,
        NEW.policy, NEW.priority, NEW.created_at, NEW.workflow, NEW.admission)
       IS DISTINCT FROM
       (OLD.job_id, OLD.queue, OLD.kind, OLD.job_key, OLD.epoch, OLD.payload, OLD.payload_digest,
        OLD.policy, OLD.priority, OLD.created_at, OLD.workflow, OLD.admission) THEN
        RAISE EXCEPTION 'job % : its identity, payload, policy, workflow and admission never change', OLD.job_id
            USING ERRCODE = 'JL001';
    END IF;
    IF NEW.version <> OLD.version + 1 THEN
        RAISE EXCEPTION 'job % : version % follows %, not one event', OLD.job_id, NEW.version, OLD.version
            USING ERRCODE = 'JL001';
    END IF;
    RETURN NEW;
END
$$;

-- Limits are queue controls: each set or removal is an event of the
-- queue's stream, its terms in `data` (NULL for pauses and resumes, so
-- their hashes are what they were).
ALTER TABLE jobledger.queue_events ADD COLUMN data jsonb;
ALTER TABLE jobledger.queue_events DROP CONSTRAINT queue_events_action_check;
ALTER TABLE jobledger.queue_events ADD CONSTRAINT queue_events_action_check
    CHECK (action IN ('paused', 'resumed', 'limit_set', 'limit_removed', 'rate_set', 'rate_removed'));
-- {name: {"kind": K|null, "key": glob|null, "like": LIKE form|null, "max": N}}
ALTER TABLE jobledger.queues ADD COLUMN limits jsonb NOT NULL DEFAULT '{}';
-- {"max": N, "per_ms": T} or NULL
ALTER TABLE jobledger.queues ADD COLUMN rate jsonb;

-- The rate limit's sliding window: one row per claim transaction that
-- leased from a rate-limited queue, written under the queue row's lock.
-- Rows older than the window are pruned by the claims themselves.
CREATE TABLE jobledger.rate_claims (
    queue  text NOT NULL,
    at     timestamptz NOT NULL,
    n      integer NOT NULL CHECK (n > 0)
);
CREATE INDEX rate_claims_queue_at ON jobledger.rate_claims (queue, at);
GRANT SELECT, INSERT, DELETE ON jobledger.rate_claims TO jobledger_worker, jobledger_admin;
GRANT SELECT ON jobledger.rate_claims TO jobledger_reader;
-- A rate-limited claim locks its queue's row (claims of it serialise).
GRANT UPDATE ON jobledger.queues TO jobledger_worker;

-- Periodic schedules: a hash-chained stream per schedule (domain::schedule)
-- and the state it leaves, written in one transaction.
CREATE TABLE jobledger.schedule_events (
    name         text NOT NULL,
    version      bigint NOT NULL,
    action       text NOT NULL CHECK (action IN ('created', 'paused', 'resumed', 'deleted', 'fired', 'skipped')),
    actor        text NOT NULL,
    reason       text NOT NULL,
    data         jsonb NOT NULL,
    recorded_at  timestamptz NOT NULL,
    prev_hash    text,
    hash         text NOT NULL,
    PRIMARY KEY (name, version)
);
CREATE TRIGGER schedule_events_no_update BEFORE UPDATE OR DELETE ON jobledger.schedule_events
    FOR EACH ROW EXECUTE FUNCTION jobledger.refuse_event_change();
CREATE TRIGGER schedule_events_no_truncate BEFORE TRUNCATE ON jobledger.schedule_events
    FOR EACH STATEMENT EXECUTE FUNCTION jobledger.refuse_event_change();

CREATE TABLE jobledger.schedules (
    name        text PRIMARY KEY,
    spec        jsonb NOT NULL,
    paused      boolean NOT NULL,
    deleted     boolean NOT NULL,
    -- Every slot at or before it was fired or skipped (recorded).
    cursor_at   timestamptz NOT NULL,
    version     bigint NOT NULL,
    last_hash   text NOT NULL
);

-- The scheduler's fenced lease: one active scheduler per database; the
-- token goes up on every acquisition and every firing checks it.
CREATE TABLE jobledger.scheduler_leases (
    name          text PRIMARY KEY,
    lease_token   bigint NOT NULL DEFAULT 0,
    lease_holder  text,
    lease_until   timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
INSERT INTO jobledger.scheduler_leases (name) VALUES ('scheduler');

GRANT SELECT ON jobledger.schedule_events, jobledger.schedules, jobledger.scheduler_leases
    TO jobledger_worker, jobledger_reader, jobledger_admin;
GRANT INSERT ON jobledger.schedule_events TO jobledger_worker, jobledger_admin;
GRANT INSERT, UPDATE ON jobledger.schedules TO jobledger_admin;
GRANT UPDATE ON jobledger.schedules, jobledger.scheduler_leases TO jobledger_worker;
