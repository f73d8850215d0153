-- Queue pause and resume (issue 12): each an operator's recorded action in
-- an append-only, hash-chained stream per queue (domain::queue), and the
-- state it leaves in jobledger.queues, written in the same transaction.
-- A claim leases nothing from a queue whose row says paused.
CREATE TABLE jobledger.queue_events (
    queue        text NOT NULL,
    version      bigint NOT NULL,
    action       text NOT NULL CHECK (action IN ('paused', 'resumed')),
    actor        text NOT NULL,
    reason       text NOT NULL,
    recorded_at  timestamptz NOT NULL,
    prev_hash    text,
    hash         text NOT NULL,
    PRIMARY KEY (queue, version)
);
CREATE TRIGGER queue_events_no_update BEFORE UPDATE OR DELETE ON jobledger.queue_events
    FOR EACH ROW EXECUTE FUNCTION jobledger.refuse_event_change();
CREATE TRIGGER queue_events_no_truncate BEFORE TRUNCATE ON jobledger.queue_events
    FOR EACH STATEMENT EXECUTE FUNCTION jobledger.refuse_event_change();

CREATE TABLE jobledger.queues (
    queue        text PRIMARY KEY,
    paused       boolean NOT NULL,
    paused_at    timestamptz,
    paused_by    text,
    reason       text,
    version      bigint NOT NULL,
    last_hash    text NOT NULL
);

GRANT SELECT ON jobledger.queue_events, jobledger.queues TO jobledger_worker, jobledger_reader, jobledger_admin;
GRANT INSERT ON jobledger.queue_events TO jobledger_admin;
GRANT INSERT, UPDATE ON jobledger.queues TO jobledger_admin;
