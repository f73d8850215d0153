-- Issue 14: the log as a Merkle tree, and signed checkpoints (docs/audit.md).

-- This ledger's name in every signed tree head, so a signature over one
-- ledger's log can never be presented as another's. Drawn once.
CREATE TABLE jobledger.ledger_identity (
    log_id     uuid PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now(),
    one        boolean NOT NULL DEFAULT true UNIQUE CHECK (one)
);
INSERT INTO jobledger.ledger_identity (log_id) VALUES (gen_random_uuid());

-- The tree's leaves in blocks of 256, in log order ((txid, position) below
-- the horizon, the order every log reader follows): block b holds leaves
-- [256 b, 256 b + 256). Kept by the checkpointer (a fenced log reader named
-- `merkle`) in the transaction that moves its checkpoint, so a block is
-- written once and whole. `leaves` are the 256 leaf hashes (32 bytes each,
-- concatenated), `root` the RFC 6962 root over them. The blocks are an
-- index, not the truth: a proof is checked against the events themselves
-- and a signed root, so a rewritten block is caught like a rewritten event.
CREATE TABLE jobledger.merkle_blocks (
    block         bigint PRIMARY KEY CHECK (block >= 0),
    last_txid     xid8 NOT NULL,
    last_position bigint NOT NULL,
    positions     bigint[] NOT NULL CHECK (cardinality(positions) = 256),
    leaves        bytea NOT NULL CHECK (length(leaves) = 256 * 32),
    root          bytea NOT NULL CHECK (length(root) = 32)
);
CREATE UNIQUE INDEX merkle_blocks_last ON jobledger.merkle_blocks (last_txid, last_position);

CREATE TRIGGER merkle_blocks_no_update BEFORE UPDATE OR DELETE ON jobledger.merkle_blocks
    FOR EACH ROW EXECUTE FUNCTION jobledger.refuse_event_change();
CREATE TRIGGER merkle_blocks_no_truncate BEFORE TRUNCATE ON jobledger.merkle_blocks
    FOR EACH STATEMENT EXECUTE FUNCTION jobledger.refuse_event_change();

GRANT SELECT ON jobledger.ledger_identity, jobledger.merkle_blocks
    TO jobledger_worker, jobledger_reader, jobledger_admin;
GRANT INSERT ON jobledger.merkle_blocks TO jobledger_worker, jobledger_admin;
