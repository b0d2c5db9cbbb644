-- The store's identity: one row, created once by migrate (an existing one is kept).
-- `store_id` is random (128 bits): unique per database file, unless the file is copied
-- (a restore, a clone), which `session` detects through the front filter's Redis. See
-- README, "Front filter: store identity, restores and clones".
CREATE TABLE IF NOT EXISTS idem_store_identity (
    singleton  INTEGER PRIMARY KEY CHECK (singleton = 1),
    store_id   TEXT NOT NULL,
    session    INTEGER NOT NULL DEFAULT 0,
    rotated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
INSERT OR IGNORE INTO idem_store_identity (singleton, store_id)
VALUES (1, lower(hex(randomblob(16))));
