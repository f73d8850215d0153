-- Issue 15, W1: a single enqueue outside a caller's transaction wakes
-- workers and log readers after its commit instead of in it.
--
-- A transaction that calls pg_notify holds PostgreSQL's one notify lock
-- from its pre-commit until its commit record is flushed, so notifying
-- transactions cannot share a flush. Measured here (pgbench, 8 clients, one
-- row per transaction): an insert that also notifies 2,270-2,850
-- transactions/s; the insert and then the notify in a transaction of its
-- own 5,050-5,800; the insert alone 8,070. Every enqueue notified, so no
-- number of clients could enqueue faster than the disk flushes one by one.
--
-- The enqueue's statement sets `jobledger.wake_after_commit` to its own
-- statement_timestamp(), and the two insert-time triggers send nothing when
-- the setting names the statement they fire for. So the switch holds for
-- that one statement: a later statement of the same transaction, or a value
-- set for a role or a database, names another time, and its triggers notify
-- as before. The ledger sends the same notifications in the next statement,
-- after the commit, also when the caller stops waiting
-- (ledger::context, store::jobs::wake). A
-- session that sets the switch itself in the statement of its own write (a
-- DO block, a multi-statement simple query) silences that write's wake-ups,
-- nothing else: wake-ups are hints, the polls find the jobs. A
-- process that dies between the two loses the wake-up, not the job:
-- workers find it at their next poll, log readers at theirs. Every other
-- write, and every enqueue inside a caller's transaction, notifies in its
-- transaction as before.

CREATE OR REPLACE FUNCTION jobledger.notify_events() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('jobledger.wake_after_commit', true) = statement_timestamp()::text THEN
        RETURN NULL;
    END IF;
    PERFORM pg_notify('jobledger_events', '');
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION jobledger.notify_inserted_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('jobledger.wake_after_commit', true) = statement_timestamp()::text THEN
        RETURN NULL;
    END IF;
    PERFORM pg_notify('jobledger_queued', q.queue)
    FROM (SELECT DISTINCT queue FROM new_jobs WHERE state = 'queued') q;
    RETURN NULL;
END
$$;
