-- Two mends of 20261205000001 (the statement checks), in a migration of
-- their own: that one had landed, and sqlx refuses a database whose applied
-- migration changed (found on reread; the mends were first made in place).
--
-- 1. The hash-chain link also requires version n-1 ahead of version n in
--    the log, as the row trigger saw it: versions n and n+1 inserted by one
--    statement with n+1 first in the log were accepted
--    (tests/tamper.rs::database_refuses_a_broken_chain_link). This reads
--    log order from `position`, an identity with the default CACHE 1, so
--    positions come out in the order rows are inserted; a sequence cache
--    above 1 would hand out positions out of order across sessions and this
--    check would refuse correctly linked events.
-- 2. The wake-up trigger on updates joins old and new rows too, and its
--    cached plan had the same nested loop (48 ms for a 499-row sweep of
--    expired leases after a one-row statement in the same session).

CREATE OR REPLACE FUNCTION jobledger.check_event_links() RETURNS trigger LANGUAGE plpgsql
    SET enable_seqscan = off SET enable_bitmapscan = off SET enable_nestloop = off AS $$
DECLARE
    bad record;
BEGIN
    SELECT n.job_id, n.version INTO bad FROM new_events n
    WHERE CASE WHEN n.version = 1 THEN n.prev_hash IS NOT NULL
               ELSE n.prev_hash IS NULL
                    OR (SELECT p.hash FROM jobledger.events p
                        WHERE p.job_id = n.job_id AND p.version = n.version - 1
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

ALTER FUNCTION jobledger.notify_updated_jobs() SET enable_nestloop = off;
