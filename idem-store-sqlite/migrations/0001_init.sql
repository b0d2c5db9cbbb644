-- idem: the embedded store's tables. Idempotent: safe to run on every start.
CREATE TABLE IF NOT EXISTS processed_messages (
    idempotency_key TEXT PRIMARY KEY,
    award_id        TEXT,
    claimed_at      TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE INDEX IF NOT EXISTS processed_messages_award_id ON processed_messages (award_id);
CREATE INDEX IF NOT EXISTS processed_messages_claimed_at ON processed_messages (claimed_at);

CREATE TABLE IF NOT EXISTS outbox (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id        TEXT NOT NULL UNIQUE,
    event_type      TEXT NOT NULL,
    subject         TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    payload         TEXT NOT NULL CHECK (json_valid(payload)),
    created_at      TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    published_at    TEXT
);
CREATE INDEX IF NOT EXISTS outbox_unpublished ON outbox (id) WHERE published_at IS NULL;
CREATE INDEX IF NOT EXISTS outbox_key ON outbox (idempotency_key);
