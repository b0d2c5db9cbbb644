-- The submission's identity on each claim (conflict detection, PgStore::migrate; both
-- layouts). Idempotent. `{schema}` is replaced by the validated, quoted schema name and
-- `{partition_key}` by `, submission_month` on the partitioned layout (nothing on the plain
-- one) before execution.
--
-- A claim records the submission timestamp beside the award id (the subject). The pair is
-- the submission's identity: the same award and timestamp with another payload (an amount
-- changed, fields reordered, a space added) derives another key, and the unique
-- index below makes its claim a conflict (`ClaimOutcome::Conflict`) instead of a second
-- disbursement. The index is what serialises two concurrent claims of one identity: the
-- second `INSERT ... ON CONFLICT DO NOTHING` waits on it until the first commits (then
-- conflict) or rolls back (then claimed) - a lookup before the insert would let both in.
--
-- The column is nullable: the reference consumer, which inserts only (idempotency_key,
-- award_id), shares the table unchanged, and so do claims made under the `process` conflict
-- policy. Their rows have no identity and are never in conflict: a unique index treats
-- NULLs as distinct, so a row with a NULL timestamp conflicts with none. (Earlier versions
-- made the index partial, `WHERE award_id IS NOT NULL AND submission_timestamp IS NOT
-- NULL`, to the same effect.)
--
-- The index also serves every lookup by award id (`idem inspect --award-id`): it leads
-- with `award_id` and, being whole, holds every row, so no index of its own on `award_id`
-- is kept (0002_audit_indexes.sql): one index entry less per claim.
--
-- A unique index on a partitioned table must contain the partition key. The month is a
-- function of the timestamp, so one identity always has one month, and uniqueness of
-- (award_id, submission_timestamp, submission_month) is uniqueness of the identity.
--
-- On a large existing table the index build takes a lock that blocks claims while it runs;
-- build it beforehand with CREATE UNIQUE INDEX CONCURRENTLY under the same name (plain
-- layout) to avoid that.
--
-- A schema made by an earlier version has the partial index. To replace it without
-- blocking claims (plain layout), build the whole one beside it first:
--   CREATE UNIQUE INDEX CONCURRENTLY processed_messages_identity_full
--       ON <schema>.processed_messages (award_id, submission_timestamp);
-- and the next `idem migrate` swaps them (drops the partial index, renames the new one,
-- then 0002 drops the `award_id` index): catalog changes only, each lock held for an
-- instant. Until then the partial index and the `award_id` index stay as they are.

ALTER TABLE {schema}.processed_messages ADD COLUMN IF NOT EXISTS submission_timestamp text COLLATE "C";

-- The swap. An index under that name that cannot take the place of the identity index (a
-- build that failed, left invalid; another definition; nothing to replace) is dropped
-- with a warning: it would only cost every claim an index entry.
DO $swap$
BEGIN
    IF to_regclass('{schema}.processed_messages_identity_full') IS NULL THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_index i
               WHERE i.indexrelid = to_regclass('{schema}.processed_messages_identity_full')
                 AND i.indisvalid AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL
                 AND (SELECT array_agg(a.attname ORDER BY k.ord)
                      FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
                      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum)
                     = ARRAY['award_id', 'submission_timestamp']::name[])
       AND EXISTS (SELECT 1 FROM pg_index
                   WHERE indexrelid = to_regclass('{schema}.processed_messages_identity_key')
                     AND indpred IS NOT NULL) THEN
        DROP INDEX {schema}.processed_messages_identity_key;
        ALTER INDEX {schema}.processed_messages_identity_full
            RENAME TO processed_messages_identity_key;
    ELSE
        RAISE WARNING 'idem migrate: dropped processed_messages_identity_full: not a valid unique index on (award_id, submission_timestamp) that could replace a partial identity index';
        DROP INDEX {schema}.processed_messages_identity_full;
    END IF;
END
$swap$;

CREATE UNIQUE INDEX IF NOT EXISTS processed_messages_identity_key
    ON {schema}.processed_messages (award_id, submission_timestamp{partition_key});
