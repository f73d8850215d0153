-- Job search by kind or by reason code alone (the review found a search for
-- a kind no job has reading every row of every state): an index led by
-- each, like the queue's. Each costs one entry per transition
-- (docs/benchmarks.md has W3 with them).
CREATE INDEX jobs_search_kind ON jobledger.jobs (kind, state, created_at DESC, job_id DESC);
CREATE INDEX jobs_search_reason ON jobledger.jobs (reason, state, created_at DESC, job_id DESC);
