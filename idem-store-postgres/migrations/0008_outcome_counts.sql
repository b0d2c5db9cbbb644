-- The outcome tally (PgStore::migrate; both layouts). Idempotent. `{schema}` is replaced
-- by the validated, quoted schema name before execution.
--
-- How many deliveries of each UTC day ended with each outcome (`processed`, `duplicate`,
-- `conflict`, `rejected`, `deferred`, `failed`) and, for a dead letter, each reason code
-- (`not_json`, `attempts_exhausted`, `conflict`, ...; '' for the other outcomes). Counted
-- in memory by the consumer (idem_core::tally::OutcomeTally) and added here every second
-- and at exit, one upsert per flush (`count = count + EXCLUDED.count`), so that the audit
-- report can show duplicates suppressed and dead letters, which leave no other row in the
-- store. Operational counts: a crash loses at most the counts since the last flush; the
-- claims and business rows stay the exact evidence, the dead letters themselves are in
-- the broker's dead-letter queue. A few rows per day: retention never needs to purge it.
CREATE TABLE IF NOT EXISTS {schema}.idem_outcome_counts (
    day date NOT NULL,
    outcome text NOT NULL,
    reason text NOT NULL DEFAULT '',
    count bigint NOT NULL DEFAULT 0 CHECK (count >= 0),
    PRIMARY KEY (day, outcome, reason)
);

-- The flushes already added, one row per tally (a consumer process): the highest flush
-- sequence number of that tally applied so far. A flush adds its counts only when its
-- sequence number is above the row's, in the same statement that records it, so a flush
-- whose outcome was unknown (dropped by a timeout, the connection broken after the
-- commit) and that is tried again with the same id is added once. A tally sends its
-- flushes in order, each until it succeeds, so the highest one applied tells them all.
-- Rows of tallies not heard from for 30 days are removed by the first flush of a new one.
CREATE TABLE IF NOT EXISTS {schema}.idem_outcome_flushes (
    writer     text PRIMARY KEY,
    seq        bigint NOT NULL,
    flushed_at timestamptz NOT NULL DEFAULT now()
);
