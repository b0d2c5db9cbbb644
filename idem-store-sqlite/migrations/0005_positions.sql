-- Log positions kept in the claim's transaction (idem_core::position; SqliteStore::migrate;
-- idempotent).
--
-- One row per source (`kafka/GROUP/TOPIC`) and partition, for consumers that keep their
-- positions in the store (`?positions=store`): `next_offset`, every offset below it done
-- (NULL: taken, nothing recorded yet); `done`, the offsets past it whose transactions
-- committed (a JSON array, ascending, at most 64: idem_core::position::HELD); `epoch`, the fencing token, raised by one each
-- time a member takes the partition. A claim transaction moves the row only at its
-- member's epoch. SQLite runs one writer at a time, so one row per partition costs no
-- waiting that the database's own lock does not already impose.
CREATE TABLE IF NOT EXISTS idem_positions (
    source TEXT NOT NULL,
    partition INTEGER NOT NULL,
    next_offset INTEGER,
    done TEXT NOT NULL DEFAULT '[]',
    epoch INTEGER NOT NULL CHECK (epoch >= 1),
    taken_at TEXT NOT NULL,
    advanced_at TEXT,
    PRIMARY KEY (source, partition)
) WITHOUT ROWID;

-- The done offsets past `next_offset` that `done` has no room for, one row each: while
-- an offset stays undone, what each claim transaction rewrites stays 64 numbers however
-- many are done after it. A claim transaction deletes the partition's rows below its
-- `next_offset`.
CREATE TABLE IF NOT EXISTS idem_position_offsets (
    source TEXT NOT NULL,
    partition INTEGER NOT NULL,
    off INTEGER NOT NULL,
    PRIMARY KEY (source, partition, off)
) WITHOUT ROWID;
