-- The partitioned layout of processed_messages (PgLayout::Partitioned, `idem migrate
-- --layout partitioned`). Applied *instead of* the processed_messages of 0001 - it runs
-- first, so 0001's `CREATE TABLE IF NOT EXISTS processed_messages` finds this table and
-- leaves it alone - and never on the default (plain) layout. Idempotent. `{schema}` is
-- replaced by the validated, quoted schema name before execution.
--
-- The partition key is the month written in the message's own submission timestamp,
-- never the claim time: a redelivery is claimed at another time but carries the same
-- timestamp. A unique constraint on a partitioned table must contain the partition key,
-- so the primary key is (idempotency_key, submission_month) and the claim's target is
-- `ON CONFLICT (idempotency_key, submission_month)`. The timestamp is part of the key's
-- preimage, so one key has one month: all its claims meet in one partition's unique
-- index, and dedup is exactly what it is on the plain table.
--
-- Monthly partitions (processed_messages_pYYYYMM) are created by PgStore::ensure_partitions
-- (run by `migrate` and at consumer start). Timestamps that do not parse
-- (submission_month = '-infinity') and months without a partition go to the default
-- partition.
--
-- Not shared with the reference consumer: its `ON CONFLICT (idempotency_key)` needs a
-- unique index on the key alone, which a partitioned table cannot have (use the plain
-- layout for a table shared with consumers in other languages).

CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {schema}.processed_messages (
    idempotency_key  text COLLATE "C" NOT NULL,
    award_id         text COLLATE "C",
    claimed_at       timestamptz DEFAULT now(),
    submission_month date NOT NULL,
    PRIMARY KEY (idempotency_key, submission_month)
) PARTITION BY RANGE (submission_month);

CREATE TABLE IF NOT EXISTS {schema}.processed_messages_default
    PARTITION OF {schema}.processed_messages DEFAULT;
