-- The consumer's own tables, in its own database. Idempotent: applied at
-- start-up by `jobledger_consumers::schema::install`.
CREATE SCHEMA IF NOT EXISTS jobledger_consumer;

-- Per consumer group and message key: the highest generation applied.
CREATE TABLE IF NOT EXISTS jobledger_consumer.fences (
    grp         text NOT NULL,
    key         text NOT NULL,
    epoch       bigint NOT NULL,
    token       bigint NOT NULL,
    version     bigint NOT NULL,
    job_id      uuid,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (grp, key)
);

-- Messages that could not be decoded: kept with their raw bytes, never dropped.
CREATE TABLE IF NOT EXISTS jobledger_consumer.dead_letters (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    grp         text NOT NULL,
    topic       text NOT NULL,
    partition   integer NOT NULL,
    "offset"    bigint NOT NULL,
    key         bytea,
    payload     bytea,
    headers     jsonb NOT NULL,
    error       text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (grp, topic, partition, "offset")
);

-- The status mirror: every job's latest state as seen by this consumer.
CREATE TABLE IF NOT EXISTS jobledger_consumer.status_mirror (
    job_id      uuid PRIMARY KEY,
    job_key     text,
    queue       text,
    state       text NOT NULL,
    reason      text NOT NULL,
    epoch       bigint NOT NULL,
    token       bigint NOT NULL,
    version     bigint NOT NULL,
    position    bigint NOT NULL,
    updated_at  timestamptz NOT NULL
);

-- The audit log sink: an append-only copy of every event with its hash.
CREATE TABLE IF NOT EXISTS jobledger_consumer.audit_log (
    job_id      uuid NOT NULL,
    version     bigint NOT NULL,
    position    bigint NOT NULL,
    hash        text NOT NULL,
    prev_hash   text,
    body        jsonb NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, version)
);

CREATE OR REPLACE FUNCTION jobledger_consumer.refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'jobledger_consumer.audit_log is append-only: % refused', TG_OP;
END
$$;

DROP TRIGGER IF EXISTS audit_log_append_only ON jobledger_consumer.audit_log;
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON jobledger_consumer.audit_log
    FOR EACH ROW EXECUTE FUNCTION jobledger_consumer.refuse_change();

-- Where the consumer is, per (group, topic, partition): the next offset to
-- apply, written in the transaction that applies the message. Offsets live
-- here, not in the broker's group coordinator: a consumer killed mid-message
-- resumes exactly after the last committed one, and no group rebalance is
-- needed (a tansu group stalls after members are killed; see
-- docs/reliability.md).
CREATE TABLE IF NOT EXISTS jobledger_consumer.offsets (
    grp         text NOT NULL,
    topic       text NOT NULL,
    partition   integer NOT NULL,
    next_offset bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (grp, topic, partition)
);
