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
-- NULLs as distinct, so a row with a NULL timestamp conflicts with none.
--
-- The index also serves every lookup by award id (`idem inspect --award-id`): it leads
-- with `award_id` and, being whole, holds every row, so no index of its own on `award_id`
-- is made (0002_audit_indexes.sql): one index entry less per claim.
--
-- A unique index on a partitioned table must contain the partition key. The month is a
-- function of the timestamp, so one identity always has one month, and uniqueness of
-- (award_id, submission_timestamp, submission_month) is uniqueness of the identity.
--
-- On a large existing table (the reference design's, made by another program) the index
-- build takes a lock that blocks claims while it runs; build it beforehand with CREATE
-- UNIQUE INDEX CONCURRENTLY under the same name (plain layout) to avoid that.

ALTER TABLE {schema}.processed_messages ADD COLUMN IF NOT EXISTS submission_timestamp text COLLATE "C";

CREATE UNIQUE INDEX IF NOT EXISTS processed_messages_identity_key
    ON {schema}.processed_messages (award_id, submission_timestamp{partition_key});
