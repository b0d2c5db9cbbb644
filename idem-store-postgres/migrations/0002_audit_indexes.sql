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
-- `inspect` finds a key's outbox events.
CREATE INDEX IF NOT EXISTS outbox_idempotency_key_idx
    ON {schema}.outbox (idempotency_key);
