-- Job search (`GET /v1/jobs`, the console): newest first by enqueue time,
-- answered from these two indexes, one descent per state (see
-- store::search). Both include `state`, which every transition changes, so
-- each costs one index entry per transition: measured in docs/benchmarks.md.
CREATE INDEX jobs_search_queue ON jobledger.jobs (queue, state, created_at DESC, job_id DESC);
CREATE INDEX jobs_search_state ON jobledger.jobs (state, created_at DESC, job_id DESC);
