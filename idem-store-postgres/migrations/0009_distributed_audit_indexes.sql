-- The audit indexes of the distributed layout (PgLayout::Distributed with
-- PgConfig::audit_indexes, on by default), run instead of 0002. The same indexes, except that
-- the lookup by award id needs none of its own (the primary key (award_id, idempotency_key)
-- leads with it) and the lookup by key does: `inspect --key`, the audit report's
-- reconciliation and the purge's batches find claims by idempotency_key alone. None of them
-- is unique, so Citus takes them on a distributed table as they are. `{schema}` is replaced
-- by the validated, quoted schema name before execution.

CREATE INDEX IF NOT EXISTS processed_messages_claimed_at_idx
    ON {schema}.processed_messages (claimed_at);
CREATE INDEX IF NOT EXISTS processed_messages_idempotency_key_idx
    ON {schema}.processed_messages (idempotency_key);
CREATE INDEX IF NOT EXISTS outbox_idempotency_key_idx
    ON {schema}.outbox (idempotency_key);
