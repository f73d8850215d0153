-- Least privilege. Roles are cluster-wide (created once, kept); grants are
-- per database. LOGIN so components can connect as them; set passwords or
-- use your pg_hba rules (the test cluster trusts loopback).
--   jobledger_worker  workers, the sweeper, the relay: append events, change
--                     the projection, move reader checkpoints; never update
--                     or delete an event, never purge.
--   jobledger_reader  auditors, dashboards, verify: read only.
--   jobledger_admin   operators: everything the schema allows (purge, replay);
--                     events stay append-only even for it (the trigger).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'jobledger_worker') THEN
        CREATE ROLE jobledger_worker LOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'jobledger_reader') THEN
        CREATE ROLE jobledger_reader LOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'jobledger_admin') THEN
        CREATE ROLE jobledger_admin LOGIN;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA jobledger TO jobledger_worker, jobledger_reader, jobledger_admin;
GRANT SELECT ON ALL TABLES IN SCHEMA jobledger TO jobledger_worker, jobledger_reader, jobledger_admin;

GRANT INSERT ON jobledger.events, jobledger.rejections TO jobledger_worker;
GRANT INSERT, UPDATE ON jobledger.jobs, jobledger.readers, jobledger.kind_policies TO jobledger_worker;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA jobledger TO jobledger_worker, jobledger_admin;

GRANT INSERT, UPDATE, DELETE ON jobledger.jobs, jobledger.readers, jobledger.kind_policies TO jobledger_admin;
GRANT INSERT ON jobledger.events, jobledger.rejections, jobledger.tombstones TO jobledger_admin;

-- Tables later migrations create are readable by all three roles.
ALTER DEFAULT PRIVILEGES IN SCHEMA jobledger
    GRANT SELECT ON TABLES TO jobledger_worker, jobledger_reader, jobledger_admin;
