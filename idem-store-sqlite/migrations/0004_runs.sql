-- The reruns of keys whose earlier runs never settled (SqliteStore::migrate; idempotent).
--
-- One row per key the gate ran again on a delivery that came back unsettled (its process
-- died holding it, or its attempt failed), written and committed before the handler
-- runs (`ClaimStore::note_run`): `runs` counts those reruns. A message that kills its
-- process each time it runs is dead-lettered unrun once its runs reach the attempt limit.
-- The row is removed when the key's delivery settles; a few rows at most, never purged.
CREATE TABLE IF NOT EXISTS idem_runs (
    idempotency_key TEXT PRIMARY KEY,
    runs INTEGER NOT NULL CHECK (runs >= 0),
    last_run_at TEXT NOT NULL
) WITHOUT ROWID;
