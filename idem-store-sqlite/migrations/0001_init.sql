-- idem: the embedded store's tables. Idempotent: safe to run on every start.
--
-- A claim records the submission timestamp beside the award id (the subject); the pair is
-- the submission's identity. The same award and timestamp with another payload derives
-- another key, and the unique partial index makes its claim a conflict
-- (ClaimOutcome::Conflict) instead of a second disbursement. The column is nullable and
-- the index partial: claims without an identity (the `process` conflict policy, a
-- pipeline without timestamps, another program's consumer sharing the table) are never in
-- conflict. A `processed_messages` made by another program with only the reference
-- columns is given the column by SqliteStore::migrate before this script runs.
CREATE TABLE IF NOT EXISTS processed_messages (
    idempotency_key      TEXT PRIMARY KEY,
    award_id             TEXT,
    claimed_at           TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    submission_timestamp TEXT
);
CREATE INDEX IF NOT EXISTS processed_messages_award_id ON processed_messages (award_id);
CREATE INDEX IF NOT EXISTS processed_messages_claimed_at ON processed_messages (claimed_at);
CREATE UNIQUE INDEX IF NOT EXISTS processed_messages_identity
    ON processed_messages (award_id, submission_timestamp)
    WHERE award_id IS NOT NULL AND submission_timestamp IS NOT NULL;

-- The relay's columns: publish failures (`publish_attempts`, `last_error`, `failed_at`: an
-- event the broker refuses `max_publish_attempts` times is moved aside), its lease
-- (`lease_token`, `leased_until`, src/source.rs) and `traceparent`, each event's W3C trace
-- context (idem_core::trace; NULL for an untraced event).
CREATE TABLE IF NOT EXISTS outbox (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id         TEXT NOT NULL UNIQUE,
    event_type       TEXT NOT NULL,
    subject          TEXT NOT NULL,
    idempotency_key  TEXT NOT NULL,
    payload          TEXT NOT NULL CHECK (json_valid(payload)),
    created_at       TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    published_at     TEXT,
    publish_attempts INTEGER NOT NULL DEFAULT 0,
    last_error       TEXT,
    failed_at        TEXT,
    lease_token      TEXT,
    leased_until     INTEGER,
    traceparent      TEXT
);
CREATE INDEX IF NOT EXISTS outbox_unpublished ON outbox (id) WHERE published_at IS NULL;
CREATE INDEX IF NOT EXISTS outbox_unpublished_subject ON outbox (subject, id) WHERE published_at IS NULL;
CREATE INDEX IF NOT EXISTS outbox_key ON outbox (idempotency_key);
