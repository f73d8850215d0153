-- Queued jobs leave the four search indexes, and the search indexes turn
-- ascending (issue 15, W1, W2 and W3).
--
-- An enqueue wrote a queued job into six indexes: the primary key, the
-- claim's jobs_due and the four ordered search indexes (queue, state, kind,
-- reason; migrations 20261202000004 and ...06). The four are led by text
-- columns and cost more to enter than the rest of the row: inserting 1,000
-- queued rows took 53-67 ms with them and 30-32 ms with one ordered index
-- in their place (pgbench, triggers off, docs/benchmarks.md).
--
-- Queued jobs now have one search index of their own, jobs_search_queued,
-- in search order, as leased jobs have since 20261206000002. A search's
-- queued branch walks it newest first and checks queue, kind and reason on
-- the rows it meets (store::search), or reads a queue's due jobs from
-- jobs_due and sorts them, whichever the planner costs lower. The price: a
-- search whose filter matches few of a large queued backlog reads through
-- the backlog, also when it names no state (every state is searched then);
-- a reason no queued job can carry skips them (Reason::may_be_queued).
-- Measured in docs/benchmarks.md. Jobs in every other state
-- keep their four indexes; a job leaves jobs_search_queued at its claim and
-- enters the four when it finishes, as it did.
--
-- The search indexes also turn ascending, walked backwards for the newest
-- first. Keys arrive in ascending order (a job's created_at is its enqueue
-- time, ids are UUIDv7, jobs finish about in enqueue order), and a
-- descending index puts each new key at the left end of its range, where
-- PostgreSQL splits full pages in half: the index stays half empty and
-- every insert lands on a freshly split page. Ascending, new keys go to the
-- right end, which B-tree page splits are made for (the "split after new
-- item" rule). Measured on 100,000 finished jobs: jobs_search_state 724
-- pages against 1,298, and inserting 1,000 of them 15-18 ms against
-- 20-22 ms (docs/benchmarks.md).
--
-- Only the jobs table is locked (the write path locks jobs before events,
-- so this cannot deadlock with a writer); enqueues and claims wait while
-- the six indexes are built (minutes on tens of millions of jobs).
LOCK TABLE jobledger.jobs IN ACCESS EXCLUSIVE MODE;

DROP INDEX jobledger.jobs_search_queue;
DROP INDEX jobledger.jobs_search_state;
DROP INDEX jobledger.jobs_search_kind;
DROP INDEX jobledger.jobs_search_reason;
DROP INDEX jobledger.jobs_search_leased;
CREATE INDEX jobs_search_queue ON jobledger.jobs (queue, state, created_at, job_id)
    WHERE state NOT IN ('queued', 'leased', 'cancel_requested');
CREATE INDEX jobs_search_state ON jobledger.jobs (state, created_at, job_id)
    WHERE state NOT IN ('queued', 'leased', 'cancel_requested');
CREATE INDEX jobs_search_kind ON jobledger.jobs (kind, state, created_at, job_id)
    WHERE state NOT IN ('queued', 'leased', 'cancel_requested');
CREATE INDEX jobs_search_reason ON jobledger.jobs (reason, state, created_at, job_id)
    WHERE state NOT IN ('queued', 'leased', 'cancel_requested');
CREATE INDEX jobs_search_leased ON jobledger.jobs (state, created_at, job_id)
    WHERE state IN ('leased', 'cancel_requested');
CREATE INDEX jobs_search_queued ON jobledger.jobs (created_at, job_id)
    WHERE state = 'queued';
