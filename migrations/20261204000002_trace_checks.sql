-- Issue 16: only a W3C trace context (version 00, lower-case hex) may be
-- stored as one. The relay sends `events.trace` on as a Kafka header, so a
-- role that may insert events must not be able to publish anything else
-- under that name. NOT VALID: every existing row is NULL or ours, and
-- checking them would hold the log's lock for a scan of the whole table;
-- new rows are checked all the same.
ALTER TABLE jobledger.events ADD CONSTRAINT events_trace_w3c
    CHECK (trace ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$') NOT VALID;
ALTER TABLE jobledger.jobs ADD CONSTRAINT jobs_traceparent_w3c
    CHECK (traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$') NOT VALID;
