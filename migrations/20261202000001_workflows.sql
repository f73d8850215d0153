-- Issue 11: workflows. A parent job whose named steps are real jobs; the
-- tie is part of each one's `enqueued` event and kept on its row.

-- New states: a step that waits for its prerequisites, and the two open
-- states of a parent (docs/state-machine.md, "Workflows").
ALTER TABLE jobledger.jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE jobledger.jobs ADD CONSTRAINT jobs_state_check CHECK (state IN ('queued', 'leased',
    'cancel_requested', 'awaiting_receipt', 'succeeded', 'cancelled', 'dead', 'waiting', 'running',
    'failing'));

-- {"role":"parent","steps":N,"fan_in":{…}?} or {"role":"step","parent":…,"step":…,"after":[…],"then":[…],…}.
ALTER TABLE jobledger.jobs ADD COLUMN workflow jsonb;

-- A parent's steps, for `workflow show` and `workflow cancel`.
CREATE INDEX jobs_workflow_steps ON jobledger.jobs ((workflow ->> 'parent'))
    WHERE workflow ->> 'role' = 'step';

-- The tie is what the `enqueued` event says, like the rest of what a job is
-- (a parent's row keeps only its number of steps; its event lists them).
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
                              AND e.data -> 'policy' = NEW.policy
                              AND (CASE WHEN e.data -> 'workflow' ->> 'role' = 'parent'
                                        THEN jsonb_strip_nulls(jsonb_build_object('role', 'parent', 'steps',
                                             jsonb_array_length(e.data -> 'workflow' -> 'steps')
                                               + CASE WHEN e.data -> 'workflow' ? 'fan_in' THEN 1 ELSE 0 END,
                                             'fan_in', e.data -> 'workflow' -> 'fan_in'))
                                        ELSE e.data -> 'workflow' END) IS NOT DISTINCT FROM NEW.workflow
                         END) THEN
        RAISE EXCEPTION 'jobledger.jobs row of job % (version %, state %) written without its event',
            NEW.job_id, NEW.version, NEW.state
            USING ERRCODE = 'JL001',
                  HINT = 'every change of a job is an event appended in the same transaction';
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION jobledger.check_job_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.job_id, NEW.queue, NEW.kind, NEW.job_key, NEW.epoch, NEW.payload, NEW.payload_digest,
        NEW.policy, NEW.priority, NEW.created_at, NEW.workflow)
       IS DISTINCT FROM
       (OLD.job_id, OLD.queue, OLD.kind, OLD.job_key, OLD.epoch, OLD.payload, OLD.payload_digest,
        OLD.policy, OLD.priority, OLD.created_at, OLD.workflow) THEN
        RAISE EXCEPTION 'job % : its identity, payload, policy and workflow never change', OLD.job_id
            USING ERRCODE = 'JL001';
    END IF;
    IF NEW.version <> OLD.version + 1 THEN
        RAISE EXCEPTION 'job % : version % follows %, not one event', OLD.job_id, NEW.version, OLD.version
            USING ERRCODE = 'JL001';
    END IF;
    RETURN NEW;
END
$$;
