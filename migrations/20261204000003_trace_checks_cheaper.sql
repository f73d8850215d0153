-- Issue 16: the same W3C shape as 20261204000002, checked at a third to a
-- sixth of the cost. PostgreSQL's regex engine spends 4.5 to 8 µs on the
-- bounded repeats ([0-9a-f]{32}), and a CHECK runs on every insert of an
-- event and every update of a job's row (four times per job in a drain):
-- 18 to 32 µs of PostgreSQL's time per traced job.
-- Length 55, dashes at 3, 36 and 53, and nothing but lower-case hex between
-- them (three groups of hex, so no other dash) is exactly the old pattern.
-- NOT VALID, as before: new rows are checked, old ones are not scanned.
ALTER TABLE jobledger.events DROP CONSTRAINT events_trace_w3c;
ALTER TABLE jobledger.events ADD CONSTRAINT events_trace_w3c
    CHECK (length(trace) = 55 AND substr(trace, 36, 1) = '-' AND substr(trace, 53, 1) = '-'
           AND trace ~ '^00-[0-9a-f]+-[0-9a-f]+-[0-9a-f]+$') NOT VALID;
ALTER TABLE jobledger.jobs DROP CONSTRAINT jobs_traceparent_w3c;
ALTER TABLE jobledger.jobs ADD CONSTRAINT jobs_traceparent_w3c
    CHECK (length(traceparent) = 55 AND substr(traceparent, 36, 1) = '-' AND substr(traceparent, 53, 1) = '-'
           AND traceparent ~ '^00-[0-9a-f]+-[0-9a-f]+-[0-9a-f]+$') NOT VALID;
