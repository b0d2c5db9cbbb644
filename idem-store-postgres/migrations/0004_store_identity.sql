-- The store's identity: one row, created once by `idem migrate` (PgStore::migrate).
-- Idempotent: an existing identity is kept. ASCII only (a LATIN1 database must read it). `{schema}` is replaced by the validated,
-- quoted schema name before execution.
--
-- `store_id` is random (128 bits), so two schemas or databases never share one - unless
-- one is a copy of the other (a restore, a clone), which is what `session` detects: every
-- consumer start (and a periodic heartbeat) increments it and registers the new value in
-- the front filter's Redis; a value not above the highest Redis has seen means this
-- store went back in time or is a copy, and the identity is rotated. See README,
-- "Front filter: store identity, restores and clones".
CREATE TABLE IF NOT EXISTS {schema}.idem_store_identity (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    store_id   text NOT NULL,
    session    bigint NOT NULL DEFAULT 0,
    rotated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {schema}.idem_store_identity (singleton, store_id)
VALUES (true, replace(gen_random_uuid()::text, '-', ''))
ON CONFLICT (singleton) DO NOTHING;
