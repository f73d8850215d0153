-- Issue 12: bearer tokens for `jobledger serve`. Only a SHA-256 of each
-- token is kept (tokens are 32 random bytes, so a fast hash is enough: there
-- is nothing to brute-force); the token itself is shown once, at creation.
CREATE TABLE jobledger.api_tokens (
    name        text PRIMARY KEY CHECK (name <> '' AND length(name) <= 200),
    role        text NOT NULL CHECK (role IN ('reader', 'worker', 'operator', 'admin')),
    token_hash  text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    revoked_at  timestamptz
);

-- Not for workers and readers: the hashes are no secret to brute-force, but
-- who holds which role is the administrator's business.
REVOKE ALL ON jobledger.api_tokens FROM jobledger_worker, jobledger_reader;
GRANT SELECT, INSERT, UPDATE ON jobledger.api_tokens TO jobledger_admin;
