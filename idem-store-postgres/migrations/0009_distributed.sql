-- The distributed layout (PgLayout::Distributed, `idem migrate --layout distributed`):
-- processed_messages, disbursements and outbox keyed so that Citus can distribute all three
-- by the award id, colocated, and run each message's transaction on one shard
-- (docs/scale.md, "Past one machine: Citus"). Applied *instead of* the processed_messages
-- and outbox of 0001 - it runs first, so 0001's CREATE TABLE / CREATE INDEX IF NOT EXISTS
-- statements find these tables and these index names and leave them alone - and never on
-- the other layouts. Plain Postgres runs it as it is (that is how it is tested); the Citus
-- step, create_distributed_table, is 0009_distributed_citus.sql, run only when the citus
-- extension is installed. Idempotent. `{schema}` is replaced by the validated, quoted
-- schema name before execution.
--
-- Citus requires every unique index of a distributed table (its primary key included) to
-- contain the distribution column, as partitioning requires the partition key:
--
-- - processed_messages, distributed by award_id: primary key (award_id, idempotency_key),
--   award_id NOT NULL, the claim's target `ON CONFLICT (award_id, idempotency_key)`. The
--   award id is the first field of the key's preimage (sha256(award_id|timestamp|...)), so
--   one key has one award id: every claim of it - the first delivery and each redelivery -
--   meets the earlier one in the same unique index (on Citus, the same shard), and dedup is
--   exactly what it is on the plain table. The identity index of 0006, (award_id,
--   submission_timestamp), already starts with award_id.
-- - disbursements, distributed by award_id: primary key (award_id, idempotency_key), one
--   disbursement per submission. The grant pipeline's table (its reference columns), made
--   here because it must be keyed - and, on Citus, distributed - with the other two;
--   idem-grant's CREATE TABLE IF NOT EXISTS then finds it.
-- - outbox, distributed by subject (the grant handler's subject is the award id): primary
--   key (subject, id), event ids unique per subject (subject, event_id), the enqueue's
--   target `ON CONFLICT (subject, event_id)`. An event id is derived from the key, and the
--   subject from the same message, so one event id has one subject. `id` stays a bigserial:
--   unique per shard only on Citus, which is all the relay needs (it orders per subject, and
--   a subject lives on one shard). The relay's scan index on (id) is not unique here.
--
-- Not shared with consumers in other languages: their `ON CONFLICT (idempotency_key)` and
-- `ON CONFLICT (event_id)` need unique indexes on those columns alone.

CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {schema}.processed_messages (
    idempotency_key text NOT NULL,
    award_id        text NOT NULL,
    claimed_at      timestamptz DEFAULT now(),
    PRIMARY KEY (award_id, idempotency_key)
);

CREATE TABLE IF NOT EXISTS {schema}.disbursements (
    award_id        text NOT NULL,
    amount_cents    bigint NOT NULL CHECK (amount_cents >= 0),
    idempotency_key text NOT NULL,
    PRIMARY KEY (award_id, idempotency_key)
);

CREATE TABLE IF NOT EXISTS {schema}.outbox (
    id              bigserial NOT NULL,
    event_id        text,
    event_type      text NOT NULL,
    subject         text NOT NULL,
    idempotency_key text,
    payload         jsonb NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    PRIMARY KEY (subject, id)
);

-- Under 0001's name, so that its CREATE UNIQUE INDEX IF NOT EXISTS statement (on
-- (event_id)) finds it and creates nothing.
CREATE UNIQUE INDEX IF NOT EXISTS outbox_event_id_key
    ON {schema}.outbox (subject, event_id);
-- The relay marks rows by id: the primary key leads with subject, so an index on id alone
-- (not unique: on Citus, ids are unique per shard only).
CREATE INDEX IF NOT EXISTS outbox_id_idx ON {schema}.outbox (id);

-- The relay's queue (0010_outbox_pending.sql), keyed by its distribution column too, and
-- under 0010's index name so that 0010 creates no second (subject, id) index; the lease
-- walks it in id order.
CREATE TABLE IF NOT EXISTS {schema}.outbox_pending (
    id      bigint NOT NULL,
    subject text NOT NULL,
    CONSTRAINT outbox_pending_subject_idx PRIMARY KEY (subject, id)
);
CREATE INDEX IF NOT EXISTS outbox_pending_id_idx ON {schema}.outbox_pending (id);
