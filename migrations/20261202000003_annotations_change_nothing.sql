-- Issue 12: an annotation (`annotated`, an operator's correction of an
-- earlier event) changes nothing about the job: not its state, not its
-- reason, not the time of its last change (purges, batch replays and
-- `workflow release-hold` go by those). Its event has its own time, so the
-- projection's `updated_at` is exempt from matching it for this one type;
-- everything else is checked as before.
CREATE OR REPLACE FUNCTION jobledger.check_job_has_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM jobledger.events e
                   WHERE e.job_id = NEW.job_id AND e.version = NEW.version
                     AND e.txid = pg_current_xact_id()
                     AND e.to_state = NEW.state AND e.reason = NEW.reason AND e.hash = NEW.last_hash
                     AND e.epoch = NEW.epoch AND e.token = NEW.token AND e.attempt = NEW.attempt
                     AND e.run = NEW.run
                     -- A correction leaves the job as it was, its time too.
                     AND CASE WHEN e.type = 'annotated' AND TG_OP = 'UPDATE'
                              THEN NEW.updated_at = OLD.updated_at AND e.reason = OLD.reason
                              ELSE e.recorded_at = NEW.updated_at END
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

