-- Issue 15: wake-ups leave the commit's path (src/ledger/wake.rs).
-- A transaction that called NOTIFY holds PostgreSQL's database-wide notify
-- lock from its pre-commit until its commit record is flushed, so these
-- triggers made every write transaction commit one after another: 8 clients
-- inserting a row each reach 14,900 transactions/s here without a NOTIFY
-- and 4,100 with one. The ledger now records what a write wakes and sends
-- it after the commit (its own transactions) or inside the caller's
-- transaction (writes on a caller's connection). Same channels, same
-- payloads.
DROP TRIGGER events_notify ON jobledger.events;
DROP TRIGGER jobs_notify_insert ON jobledger.jobs;
DROP TRIGGER jobs_notify_update ON jobledger.jobs;
DROP FUNCTION jobledger.notify_events();
DROP FUNCTION jobledger.notify_inserted_jobs();
DROP FUNCTION jobledger.notify_updated_jobs();
