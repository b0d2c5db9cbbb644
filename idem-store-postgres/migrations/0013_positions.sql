-- Log positions kept in the claim's transaction (idem_core::position; every layout).
-- Idempotent. `{schema}` is replaced by the validated, quoted schema name before execution.
--
-- For consumers that keep their positions in the store (`?positions=store`): per source
-- (`kafka/GROUP/TOPIC`) and partition, `slot` rows 0 to 15. A claim transaction writes
-- the slot of its lowest offset in the partition (offset mod 16), so the transactions of
-- one partition in flight at once write different rows and none waits for another's
-- commit (one row per partition held each transaction's lock through its commit's flush:
-- per-message consumers ran at 0.38x). Each slot row keeps:
-- - `settled`: the highest "every offset below this one is done" a transaction recorded
--   (the member's settled prefix);
-- - `done`: offsets whose transactions committed (those below `settled` are pruned once
--   the slot holds 64). A slot holds at most 64: while a low offset stays undone (a
--   message deferred, a slow batch), the offsets done past it that do not fit are rows of
--   `idem_position_offsets`, one each, so what a transaction writes does not grow with
--   the time the offset stays undone;
-- - `epoch`: the fencing token. A member taking the partition raises the epoch of every
--   slot at once (waiting for the transactions that hold one); a claim transaction moves
--   its slot only at its member's epoch (in the same UPDATE), so a member that lost the
--   partition commits nothing for it.
-- The partition's position is the merge of its slots: from the highest `settled`, past
-- every offset some slot holds done. Read by the member that takes a partition (by
-- primary key, which also folds the slots into slot 0) and by `idem inspect` / `idem
-- purge`. The updates touch no indexed column: they stay HOT, in the room fillfactor 50
-- leaves.
CREATE TABLE IF NOT EXISTS {schema}.idem_positions (
    source text NOT NULL,
    partition integer NOT NULL,
    slot smallint NOT NULL CHECK (slot >= 0),
    settled bigint,
    done bigint[] NOT NULL DEFAULT ARRAY[]::bigint[],
    epoch bigint NOT NULL CHECK (epoch >= 1),
    taken_at timestamptz NOT NULL DEFAULT now(),
    advanced_at timestamptz,
    PRIMARY KEY (source, partition, slot)
) WITH (fillfactor = 50);

-- The done offsets a slot's array has no room for (see `done` above): one row each,
-- written by the claim transaction that did the offset, under its slot row's lock, and
-- deleted by a later transaction of the slot (or a take) once the slot's `settled` passes
-- it. Empty unless an offset stayed undone while more than 64 past it in its slot were
-- done.
CREATE TABLE IF NOT EXISTS {schema}.idem_position_offsets (
    source text NOT NULL,
    partition integer NOT NULL,
    slot smallint NOT NULL,
    off bigint NOT NULL,
    PRIMARY KEY (source, partition, slot, off)
);
