-- idem-store-postgres schema, version 1. Idempotent: every statement is IF NOT EXISTS.
-- `{schema}` is replaced by the validated, quoted schema name before execution.

CREATE SCHEMA IF NOT EXISTS {schema};

-- Keys, event ids, award ids and subjects are compared byte by byte (COLLATE "C", here and
-- in 0005, 0006 and 0010): hex digits and identifiers, whose order no language changes. In
-- a database whose default collation is a language's (en_US.UTF-8, an ICU locale) every
-- index insert would otherwise compare them through it (what that costs: the collation's
-- row of scripts/index-costs). The columns of a table idem did not create (the reference
-- design's, made by another program) keep their collation; equality, which is all idem
-- asks of them, is the same under both.
--
-- The dedup table. Its three columns are the reference's: a table created by another
-- program with exactly these columns is used as it is (CREATE ... IF NOT EXISTS leaves it
-- alone). The claim relies only on the primary key (or any unique index) on the key.
CREATE TABLE IF NOT EXISTS {schema}.processed_messages (
    idempotency_key text COLLATE "C" PRIMARY KEY,
    award_id        text COLLATE "C",
    claimed_at      timestamptz DEFAULT now()
);


-- The transactional outbox. `event_type, payload, created_at` are the reference's columns;
-- the rest are ours. A reference outbox created by another program is upgraded in place
-- by the ADD COLUMN IF NOT EXISTS statements below.
CREATE TABLE IF NOT EXISTS {schema}.outbox (
    id              bigserial PRIMARY KEY,
    event_id        text COLLATE "C",
    event_type      text NOT NULL,
    subject         text COLLATE "C",
    idempotency_key text COLLATE "C",
    payload         jsonb NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz
);

ALTER TABLE {schema}.outbox ADD COLUMN IF NOT EXISTS id bigserial;
ALTER TABLE {schema}.outbox ADD COLUMN IF NOT EXISTS event_id text COLLATE "C";
ALTER TABLE {schema}.outbox ADD COLUMN IF NOT EXISTS subject text COLLATE "C";
ALTER TABLE {schema}.outbox ADD COLUMN IF NOT EXISTS idempotency_key text COLLATE "C";
ALTER TABLE {schema}.outbox ADD COLUMN IF NOT EXISTS published_at timestamptz;
-- Publish failures: an event the broker refuses `max_publish_attempts` times is moved
-- aside (`failed_at` set, `last_error` kept) so that it no longer blocks the outbox's head.
ALTER TABLE {schema}.outbox ADD COLUMN IF NOT EXISTS publish_attempts integer NOT NULL DEFAULT 0;
ALTER TABLE {schema}.outbox ADD COLUMN IF NOT EXISTS last_error text;
ALTER TABLE {schema}.outbox ADD COLUMN IF NOT EXISTS failed_at timestamptz;

-- One row per event id: `ON CONFLICT (event_id) DO NOTHING` needs this unique index.
CREATE UNIQUE INDEX IF NOT EXISTS outbox_event_id_key
    ON {schema}.outbox (event_id);
-- The relay finds unpublished rows through its queue, outbox_pending, and retention finds
-- old rows through a BRIN index on created_at: both in 0010_outbox_pending.sql (no index
-- names published_at, which would make every mark a non-HOT update).
