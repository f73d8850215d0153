-- Log readers (the Kafka relay, async projections): a durable checkpoint per
-- reader, and a fenced lease so two instances never both advance one
-- checkpoint (a zombie's checkpoint write matches no row).
CREATE TABLE jobledger.readers (
    name          text PRIMARY KEY,
    -- Everything at or before (txid, position), in that order, was handled.
    txid          xid8 NOT NULL DEFAULT '0'::xid8,
    position      bigint NOT NULL DEFAULT 0,
    lease_token   bigint NOT NULL DEFAULT 0,
    lease_holder  text,
    lease_until   timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
