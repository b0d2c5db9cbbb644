-- The outcome tally (SqliteStore::migrate). Idempotent.
--
-- How many deliveries of each UTC day (`YYYY-MM-DD`) ended with each outcome
-- (`processed`, `duplicate`, `conflict`, `rejected`, `deferred`, `failed`) and, for a dead
-- letter, each reason code ('' for the other outcomes). Counted in memory by the consumer
-- (idem_core::tally::OutcomeTally) and added here every second and at exit, one upsert per
-- flush (`count = count + excluded.count`). Operational counts: a crash loses at most the
-- counts since the last flush; the claims and business rows stay the exact evidence.
CREATE TABLE IF NOT EXISTS idem_outcome_counts (
    day TEXT NOT NULL,
    outcome TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    count INTEGER NOT NULL DEFAULT 0 CHECK (count >= 0),
    PRIMARY KEY (day, outcome, reason)
) WITHOUT ROWID;

-- The flushes already added, one row per tally (a consumer process): the highest flush
-- sequence number of that tally applied so far (`flushed_at` in UTC, RFC 3339). A flush
-- adds its counts only when it raises its tally's row, in the same transaction, so a
-- flush whose outcome was unknown (a timeout dropped it while SQLite went on and
-- committed) and that is sent again with the same id adds nothing the second time.
-- Rows of tallies not heard from for 30 days are removed by the first flush of a new one.
CREATE TABLE IF NOT EXISTS idem_outcome_flushes (
    writer TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    flushed_at TEXT NOT NULL
) WITHOUT ROWID;
