-- The submission's identity on each claim (conflict detection). Run by migrate, once:
-- only when processed_messages has no submission_timestamp column yet (SQLite has no
-- ADD COLUMN IF NOT EXISTS), in one transaction.
--
-- A claim records the submission timestamp beside the award id (the subject); the pair is
-- the submission's identity. The same award and timestamp with another payload derives
-- another key, and the unique partial index makes its claim a conflict
-- (ClaimOutcome::Conflict) instead of a second disbursement. The column is nullable and
-- the index partial: claims without an identity (the `process` conflict policy, a
-- pipeline without timestamps) are never in conflict.
ALTER TABLE processed_messages ADD COLUMN submission_timestamp TEXT;
CREATE UNIQUE INDEX IF NOT EXISTS processed_messages_identity
    ON processed_messages (award_id, submission_timestamp)
    WHERE award_id IS NOT NULL AND submission_timestamp IS NOT NULL;
