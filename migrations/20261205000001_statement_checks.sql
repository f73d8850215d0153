-- Issue 15: the write path's three row checks become one set-based query per
-- statement. Profiled (docs/benchmarks.md "Where W2's time goes"), the
-- PL/pgSQL row triggers were about a fifth of PostgreSQL's time: per job and
-- per transition one call each of `check_event_link` (before insert),
-- `check_job_update` (before update) and the deferred `check_job_has_event`,
-- each starting its own SPI query. Each is now a statement-level AFTER
-- trigger over the statement's transition tables: the same conditions, the
-- same messages, one call per statement. (They run after the statement, so
-- a write that also breaks a unique or check constraint, say a swapped
-- epoch, is refused by that constraint's SQLSTATE instead of JL001.)
--
-- What changes for a writer: the event a `jobs` row needs must be written
-- by the same statement or earlier in the same transaction (it used to be
-- "anywhere before the commit"). The ledger writes both in one statement;
-- a hand-written update that means to append its event afterwards is now
-- refused at once instead of at commit. Nothing that was refused is
-- accepted.
--
-- The planner: the probes into `events` are scalar subqueries (a SubPlan per
-- row, never turned into a join), and `enable_seqscan`/`enable_bitmapscan`
-- are off inside these functions, so even a plan cached while the log was
-- small stays one (job_id, version) index probe per row. The transition
-- tables are tuplestores, which those settings do not touch. Nested loops
-- are off too: a plan cached for a statement of one row would otherwise
-- pair old and new rows of a 500-row statement by a nested loop (measured:
-- 250,000 comparisons, 47-79 ms, where the hash join takes well under 1).

DROP TRIGGER jobs_need_event ON jobledger.jobs;
DROP TRIGGER jobs_update_shape ON jobledger.jobs;
DROP TRIGGER events_link ON jobledger.events;

-- The hash chain: version n's prev_hash is version n-1's hash, written
-- before it (earlier in the same statement counts), version 1 has none.
CREATE FUNCTION jobledger.check_event_links() RETURNS trigger LANGUAGE plpgsql
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_nestloop = off AS $$
DECLARE
    bad record;
BEGIN
    SELECT n.job_id, n.version INTO bad FROM new_events n
    WHERE CASE WHEN n.version = 1 THEN n.prev_hash IS NOT NULL
               ELSE n.prev_hash IS NULL
                    OR (SELECT p.hash FROM jobledger.events p
                        WHERE p.job_id = n.job_id AND p.version = n.version - 1
                          -- Ahead of it in the log, as the row trigger saw it.
                          AND p.position < n.position) IS DISTINCT FROM n.prev_hash END
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF bad.version = 1 THEN
        RAISE EXCEPTION 'first event of job % must not have a prev_hash', bad.job_id;
    END IF;
    RAISE EXCEPTION 'event % of job % does not link to version %', bad.version, bad.job_id, bad.version - 1;
END
$$;

CREATE TRIGGER events_link AFTER INSERT ON jobledger.events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION jobledger.check_event_links();

-- A new row is its job's version 1, next to its `enqueued` event written by
-- this transaction (the conditions of `check_job_has_event`, insert branch).
CREATE FUNCTION jobledger.check_inserted_jobs() RETURNS trigger LANGUAGE plpgsql
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_nestloop = off AS $$
DECLARE
    bad record;
BEGIN
    SELECT n.job_id, n.version, n.state INTO bad FROM new_jobs n
    WHERE (SELECT true FROM jobledger.events e
           WHERE e.job_id = n.job_id AND e.version = n.version
             AND e.txid = pg_current_xact_id()
             AND e.to_state = n.state AND e.reason = n.reason AND e.hash = n.last_hash
             AND e.epoch = n.epoch AND e.token = n.token AND e.attempt = n.attempt
             AND e.run = n.run AND e.recorded_at = n.updated_at
             AND n.version = 1 AND e.prev_hash IS NULL
             AND e.type = 'enqueued' AND e.data ->> 'queue' = n.queue
             AND e.data ->> 'kind' = n.kind
             AND (e.data ->> 'job_key') IS NOT DISTINCT FROM n.job_key
             AND e.data ->> 'payload_digest' = n.payload_digest
             AND e.data -> 'payload' = n.payload
             AND (e.data ->> 'priority')::smallint = n.priority
             AND e.data -> 'policy' = n.policy
             AND (CASE WHEN e.data -> 'workflow' ->> 'role' = 'parent'
                       THEN jsonb_strip_nulls(jsonb_build_object('role', 'parent', 'steps',
                            jsonb_array_length(e.data -> 'workflow' -> 'steps')
                              + CASE WHEN e.data -> 'workflow' ? 'fan_in' THEN 1 ELSE 0 END,
                            'fan_in', e.data -> 'workflow' -> 'fan_in'))
                       ELSE e.data -> 'workflow' END) IS NOT DISTINCT FROM n.workflow) IS NULL
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'jobledger.jobs row of job % (version %, state %) written without its event',
            bad.job_id, bad.version, bad.state
            USING ERRCODE = 'JL001',
                  HINT = 'every change of a job is an event appended in the same transaction';
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_need_event_insert AFTER INSERT ON jobledger.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION jobledger.check_inserted_jobs();

-- An updated row keeps what its job is (`check_job_update`: job id,
-- identity, payload, policy, workflow, admission), moves its version by
-- exactly one, and comes with that version's event from this transaction
-- (`check_job_has_event`, update branch; an annotation leaves the row's
-- time and reason as they were).
CREATE FUNCTION jobledger.check_updated_jobs() RETURNS trigger LANGUAGE plpgsql
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_nestloop = off AS $$
DECLARE
    bad record;
BEGIN
    -- One pass; per row the first problem found: 1 what the job is changed
    -- (a changed job_id leaves a new row without its old one), 2 the
    -- version did not move by one, 3 no such event.
    SELECT n.job_id, n.version, o.version AS old_version, n.state,
           CASE WHEN o.job_id IS NULL
                  OR (n.queue, n.kind, n.job_key, n.epoch, n.payload, n.payload_digest, n.policy, n.priority,
                      n.created_at, n.workflow, n.admission)
                     IS DISTINCT FROM
                     (o.queue, o.kind, o.job_key, o.epoch, o.payload, o.payload_digest, o.policy, o.priority,
                      o.created_at, o.workflow, o.admission) THEN 1
                WHEN n.version <> o.version + 1 THEN 2
                ELSE 3 END AS problem
      INTO bad
      FROM new_jobs n LEFT JOIN old_jobs o USING (job_id)
     WHERE o.job_id IS NULL
        OR (n.queue, n.kind, n.job_key, n.epoch, n.payload, n.payload_digest, n.policy, n.priority,
            n.created_at, n.workflow, n.admission)
           IS DISTINCT FROM
           (o.queue, o.kind, o.job_key, o.epoch, o.payload, o.payload_digest, o.policy, o.priority,
            o.created_at, o.workflow, o.admission)
        OR n.version <> o.version + 1
        OR (SELECT true FROM jobledger.events e
            WHERE e.job_id = n.job_id AND e.version = n.version
              AND e.txid = pg_current_xact_id()
              AND e.to_state = n.state AND e.reason = n.reason AND e.hash = n.last_hash
              AND e.epoch = n.epoch AND e.token = n.token AND e.attempt = n.attempt
              AND e.run = n.run AND e.from_state = o.state
              -- A correction leaves the job as it was, its time too.
              AND CASE WHEN e.type = 'annotated'
                       THEN n.updated_at = o.updated_at AND e.reason = o.reason
                       ELSE e.recorded_at = n.updated_at END) IS NULL
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    ELSIF bad.problem = 1 THEN
        RAISE EXCEPTION 'job % : its identity, payload, policy, workflow and admission never change', bad.job_id
            USING ERRCODE = 'JL001';
    ELSIF bad.problem = 2 THEN
        RAISE EXCEPTION 'job % : version % follows %, not one event', bad.job_id, bad.version, bad.old_version
            USING ERRCODE = 'JL001';
    END IF;
    RAISE EXCEPTION 'jobledger.jobs row of job % (version %, state %) written without its event',
        bad.job_id, bad.version, bad.state
        USING ERRCODE = 'JL001',
              HINT = 'every change of a job is an event appended in the same transaction';
END
$$;

CREATE TRIGGER jobs_need_event_update AFTER UPDATE ON jobledger.jobs
    REFERENCING OLD TABLE AS old_jobs NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION jobledger.check_updated_jobs();

-- The row functions have no trigger left.
DROP FUNCTION jobledger.check_event_link();
DROP FUNCTION jobledger.check_job_update();
DROP FUNCTION jobledger.check_job_has_event();

-- The wake-up trigger on updates joins old and new rows too, and its cached
-- plan had the same nested loop (48 ms for a 499-row sweep of expired
-- leases after a one-row statement in the same session).
ALTER FUNCTION jobledger.notify_updated_jobs() SET enable_nestloop = off;
