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
-- `inspect --award-id` looks claims up by subject. The identity index
-- (0006_claim_identity.sql) leads with `award_id` and holds every row: it serves that
-- lookup, and the index of earlier versions is dropped. Only a schema whose identity index
-- is still partial (made by an earlier version and not swapped yet) keeps one.
DO $award$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index
               WHERE indexrelid = to_regclass('{schema}.processed_messages_identity_key')
                 AND indpred IS NOT NULL) THEN
        CREATE INDEX IF NOT EXISTS processed_messages_award_id_idx
            ON {schema}.processed_messages (award_id);
    ELSE
        DROP INDEX IF EXISTS {schema}.processed_messages_award_id_idx;
    END IF;
END
$award$;
-- `inspect` and `audit export` find a key's outbox events (`idempotency_key = ANY(...)`):
-- equality only, so a hash index, whose entry is a 4-byte hash code where a btree's holds
-- the 64-character key: about a third of the WAL of the btree's entry and a quarter of its
-- size, so it stays in memory at depth (docs/performance.md, `scripts/index-costs`). A
-- schema made by an earlier version keeps its btree `outbox_idempotency_key_idx` (building
-- an index here would hold the outbox's writers for as long as the build takes) until the
-- hash index has been built beside it without blocking them:
--   CREATE INDEX CONCURRENTLY outbox_idempotency_key_hash
--       ON <schema>.outbox USING hash (idempotency_key);
-- the next `migrate` then drops the btree (docs/stores.md). An invalid hash index (a
-- concurrent build that failed) replaces nothing: drop it and build it again.
DO $events$
BEGIN
    IF to_regclass('{schema}.outbox_idempotency_key_idx') IS NULL THEN
        CREATE INDEX IF NOT EXISTS outbox_idempotency_key_hash
            ON {schema}.outbox USING hash (idempotency_key);
    ELSIF EXISTS (SELECT 1 FROM pg_index
                  WHERE indexrelid = to_regclass('{schema}.outbox_idempotency_key_hash')
                    AND indisvalid) THEN
        DROP INDEX {schema}.outbox_idempotency_key_idx;
    END IF;
END
$events$;
