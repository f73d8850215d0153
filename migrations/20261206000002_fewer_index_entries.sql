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
--    only with its first event, in the same statement and with the same
--    epoch (check_inserted_jobs), so two rows with one epoch would need two
--    first events with one epoch, which the index refuses. It is stronger
--    than before, too: an epoch stays taken after its job is purged.
--
-- 2. The four search indexes took an entry for every lease. Leased and
--    cancel-requested jobs are a set bounded by the workers' slots and
--    prefetch, and jobs_leases already holds exactly them (by queue and
--    lease expiry): a search for them reads that index and sorts the few
--    it finds (store::search writes one branch per state with the state
--    spelled out, so the planner sees which index covers which state).
--    Queued and finished jobs, whose sets are unbounded, keep their
--    ordered search indexes.
--
-- Measured with `jobledger bench --only w3 --prefetch 500`, alternating
-- builds: 12,331 and 12,559 jobs/s against 9,526 and 10,004 before
-- (docs/benchmarks.md).

CREATE UNIQUE INDEX events_first_epoch ON jobledger.events (epoch) WHERE version = 1;
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
