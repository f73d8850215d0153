-- Issue 11 (steps against W3): a workflow parent's row is updated once per
-- step end (running -> running, reason step_finished), ten times in a few
-- milliseconds for a ten-step workflow. Such an update can be HOT (no new
-- entry in any of the table's indexes) only when no indexed column changes,
-- and `updated_at` changes on every event: it was indexed for ended jobs
-- only (purge and batch replay by time), yet any index naming a column
-- makes every change of that column non-HOT. The ended jobs' time is now
-- its own generated column, NULL while a job is open, so an open job's
-- update leaves it alone. It is computed by the database from the row
-- (never written by anyone), so it can never disagree with `updated_at`.
-- Upgrading rewrites the table and its indexes under an exclusive lock (a
-- stored generated column is computed for every row): seconds per few
-- hundred thousand jobs. Run `jobledger migrate` before starting the new
-- version's workers (docs/CHANGELOG: Upgrading). `ended_at` is the time of
-- the job's last event while it is ended, exactly as `updated_at` was for
-- the queries that now read it.
--
-- Room on each page for the new version of a row: a HOT update must find it
-- on the same page (pruning reclaims the dead versions of the chain). Set
-- first, so the rewrite below packs existing rows with it too.
ALTER TABLE jobledger.jobs SET (fillfactor = 85);

ALTER TABLE jobledger.jobs ADD COLUMN ended_at timestamptz
    GENERATED ALWAYS AS (CASE WHEN state IN ('succeeded', 'cancelled', 'dead') THEN updated_at END) STORED;

DROP INDEX jobledger.jobs_terminal;
CREATE INDEX jobs_terminal ON jobledger.jobs (ended_at) WHERE state IN ('succeeded', 'cancelled', 'dead');
DROP INDEX jobledger.jobs_dead_reason;
CREATE INDEX jobs_dead_reason ON jobledger.jobs (reason, ended_at) WHERE state = 'dead';
