-- Issue 14: every stored event carries the schema version its data was
-- written in (docs/schema.md). Rows from before this column are version 1,
-- and so is any row a writer of an older jobledger appends during an
-- upgrade (it does not name the column): the default says what they are.
-- The version is under the hash from version 2 on (domain::digest).
ALTER TABLE jobledger.events ADD COLUMN schema smallint NOT NULL DEFAULT 1 CHECK (schema >= 1);
GRANT INSERT (schema) ON jobledger.events TO jobledger_worker, jobledger_admin;
