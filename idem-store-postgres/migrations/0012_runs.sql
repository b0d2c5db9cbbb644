-- The reruns of keys whose earlier runs never settled (PgStore::migrate; every layout).
-- Idempotent. `{schema}` is replaced by the validated, quoted schema name before execution.
--
-- One row per key the gate ran again on a delivery that came back unsettled (its process
-- died holding it, or its attempt failed), upserted and committed on a connection of its
-- own before the handler runs (`ClaimStore::note_run`): `runs` counts those reruns. A
-- message that kills its process each time it runs is dead-lettered unrun once its runs
-- reach the attempt limit; the neighbours that only sat in the dying process's buffer
-- never started, so they are not counted. The row is deleted when the key's delivery
-- settles: a handful of rows at any time, no index but the key, nothing to purge.
CREATE TABLE IF NOT EXISTS {schema}.idem_runs (
    idempotency_key text PRIMARY KEY,
    runs integer NOT NULL CHECK (runs >= 0),
    last_run_at timestamptz NOT NULL DEFAULT now()
);
