-- Indexes for retention and inspection (PgConfig::audit_indexes, on by default).
-- Each is maintained on every claim / outbox insert: together they cost about a fifth of
-- the batch throughput. Without them `purge` and `inspect` scan the tables.
-- `{schema}` is replaced by the validated, quoted schema name before execution.

-- Every index here is kept up on every claim or outbox insert; each names the queries
-- that need it.
--
-- Retention (`purge`: the count and batched deletes below a cutoff), `audit export` (a
-- keyset scan in (claimed_at, idempotency_key) order) and `audit report` (claims in a
-- period) read the claims by age. A BRIN index would do for the first, not for the ordered
-- keyset scan.
CREATE INDEX IF NOT EXISTS processed_messages_claimed_at_idx
    ON {schema}.processed_messages (claimed_at);
-- `inspect --award-id` looks claims up by subject through the identity index
-- (0006_claim_identity.sql), which leads with `award_id` and holds every row: no index of
-- its own.
--
-- `inspect` and `audit export` find a key's outbox events (`idempotency_key = ANY(...)`):
-- equality only, so a hash index, whose entry is a 4-byte hash code where a btree's holds
-- the 64-character key: about a third of the WAL of the btree's entry and a quarter of its
-- size, so it stays in memory at depth (docs/performance.md, `scripts/index-costs`).
CREATE INDEX IF NOT EXISTS outbox_idempotency_key_hash
    ON {schema}.outbox USING hash (idempotency_key);
