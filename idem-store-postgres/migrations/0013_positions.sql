-- Log positions kept in the claim's transaction (idem_core::position; every layout).
-- Idempotent. `{schema}` is replaced by the validated, quoted schema name before execution.
--
-- One row per source (`kafka/GROUP/TOPIC`) and partition, for consumers that keep their
-- positions in the store (`?positions=store`):
-- - `next_offset`: every offset below it is done (NULL: taken, nothing recorded yet);
-- - `done`: the offsets at or past `next_offset` whose transactions committed (batches in
--   flight finish out of order), ascending;
-- - `epoch`: the fencing token, raised by one each time a member takes the partition. A
--   claim transaction moves the row only at its member's epoch (in the same UPDATE), so a
--   member that lost the partition commits nothing for it.
-- Read by the member that takes a partition (by primary key) and by `idem inspect`. The
-- updates touch no indexed column: they stay HOT, in the room fillfactor 50 leaves.
CREATE TABLE IF NOT EXISTS {schema}.idem_positions (
    source text NOT NULL,
    partition integer NOT NULL,
    next_offset bigint,
    done bigint[] NOT NULL DEFAULT ARRAY[]::bigint[],
    epoch bigint NOT NULL CHECK (epoch >= 1),
    taken_at timestamptz NOT NULL DEFAULT now(),
    advanced_at timestamptz,
    PRIMARY KEY (source, partition)
) WITH (fillfactor = 50);
