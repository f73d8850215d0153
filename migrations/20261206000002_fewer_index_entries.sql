-- Fewer index entries per transition (issue 15, the tuned drain).
--
-- A state change of a job can never be a HOT update (the state is in the
-- indexes), so each one inserts a new entry into every index whose
-- predicate the new row meets: a claim and a completion made about seven
-- each. Two sets of them carried no information a query needs:
--
-- 1. jobs_epoch_key, a unique index over every row version of every job,
--    guarded a value that never changes after the insert (check_updated_jobs
--    refuses any change to a job's identity, epoch included). The same
--    guarantee now sits on the log, where the epoch is written once: a
--    unique index over the epochs of first events. A jobs row is inserted
--    only with its first event, written by the same statement or earlier in
--    the same transaction, with the same epoch (check_inserted_jobs), so
--    two rows with one epoch would need two
--    first events with one epoch, which the index refuses. It is stronger
--    than before, too: an epoch stays taken after its job is purged.
--
-- 2. The four search indexes took four entries for every lease. Leased and
--    cancel-requested jobs now have one search index of their own,
--    jobs_search_leased (below), and the four leave them out
--    (store::search writes one branch per state with the state spelled
--    out, so the planner sees which index covers which state). Queued and
--    finished jobs keep their four ordered search indexes. Counting rows
--    by state (the gauges) loses its index-only scan and reads the table:
--    it read a whole index before, so still one pass over all jobs.
--
-- Measured with `jobledger bench --only w3 --prefetch 500`, alternating
-- builds: 12,331 and 12,559 jobs/s against 9,526 and 10,004 before
-- (docs/benchmarks.md).

-- Lock order: jobs, then events, as every write path takes them (review: the
-- other order deadlocked with a writer arriving during the events index
-- build, and on a big log the migration was the one aborted). A log that
-- already holds two first events with one epoch (only a forged event can
-- make one: the ledger never writes it) stops this migration at the unique
-- index with the epoch named; `jobledger verify` tells which job is forged.
LOCK TABLE jobledger.jobs IN ACCESS EXCLUSIVE MODE;
ALTER TABLE jobledger.jobs DROP CONSTRAINT jobs_epoch_key;

DROP INDEX jobledger.jobs_search_queue;
DROP INDEX jobledger.jobs_search_state;
DROP INDEX jobledger.jobs_search_kind;
DROP INDEX jobledger.jobs_search_reason;
CREATE INDEX jobs_search_queue ON jobledger.jobs (queue, state, created_at DESC, job_id DESC)
    WHERE state NOT IN ('leased', 'cancel_requested');
CREATE INDEX jobs_search_state ON jobledger.jobs (state, created_at DESC, job_id DESC)
    WHERE state NOT IN ('leased', 'cancel_requested');
CREATE INDEX jobs_search_kind ON jobledger.jobs (kind, state, created_at DESC, job_id DESC)
    WHERE state NOT IN ('leased', 'cancel_requested');
CREATE INDEX jobs_search_reason ON jobledger.jobs (reason, state, created_at DESC, job_id DESC)
    WHERE state NOT IN ('leased', 'cancel_requested');
-- The leases in search order, one entry per claim instead of four: a
-- search's leased branch walks it newest first and stops after its limit
-- (review: reading all of jobs_leases and sorting cost 39-78 ms a page at
-- 20,000 leases), filters on queue, kind or reason checked on the way.
CREATE INDEX jobs_search_leased ON jobledger.jobs (state, created_at DESC, job_id DESC)
    WHERE state IN ('leased', 'cancel_requested');

CREATE UNIQUE INDEX events_first_epoch ON jobledger.events (epoch) WHERE version = 1;
