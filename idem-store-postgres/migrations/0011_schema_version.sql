-- The record of the last migration run (PgStore::migrate; every layout). Idempotent.
-- `{schema}` is replaced by the validated, quoted schema name before execution.
--
-- `script_md5` is the md5 of the whole script `migrate` ran (this file included), written
-- in the migration's own transaction. A later `migrate` (every consumer start runs one)
-- that finds its own script's md5 here, and every table, index, column and trigger the
-- script creates in the catalog, runs no DDL at all: DDL takes locks that queue the
-- claim writers behind any open transaction on the tables, even when it changes nothing.
-- A new version of the scripts has another md5 and runs them once.
CREATE TABLE IF NOT EXISTS {schema}.idem_migrations (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    script_md5  text NOT NULL,
    migrated_at timestamptz NOT NULL DEFAULT now()
);
