-- Indexes for retention and inspection (PgConfig::audit_indexes, on by default).
-- Each is maintained on every claim / outbox insert: together they cost about a fifth of
-- the batch throughput. Without them `purge` and `inspect` scan the tables.
-- `{schema}` is replaced by the validated, quoted schema name before execution.

-- Retention scans dedup records by age; `inspect --award-id` looks them up by subject.
CREATE INDEX IF NOT EXISTS processed_messages_claimed_at_idx
    ON {schema}.processed_messages (claimed_at);
CREATE INDEX IF NOT EXISTS processed_messages_award_id_idx
    ON {schema}.processed_messages (award_id);
-- `inspect` finds a key's outbox events.
CREATE INDEX IF NOT EXISTS outbox_idempotency_key_idx
    ON {schema}.outbox (idempotency_key);
