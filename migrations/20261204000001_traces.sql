-- Issue 16: traces that follow a job. Both columns are telemetry, NULL
-- when tracing is off, and adding them is a catalogue change only (no
-- table rewrite).
--
-- jobs.traceparent: the W3C trace context of the span that enqueued the
-- job, copied from its `enqueued` event (where it is under the hash), so a
-- claim continues the job's trace without reading the log.
ALTER TABLE jobledger.jobs ADD COLUMN traceparent text;
-- events.trace: the trace context of the span that wrote the event. Not
-- under the hash and never exported: it names the span, not the history.
-- The relay sends it as the `traceparent` header, so a consumer's span is a
-- child of the write that made the event.
ALTER TABLE jobledger.events ADD COLUMN trace text;
GRANT INSERT (trace) ON jobledger.events TO jobledger_worker, jobledger_admin;
