//! Log positions kept in the claim's transaction ([`idem_core::position`]): the
//! `idem_positions` table (`migrations/0013_positions.sql`), taken by a member with
//! [`PositionStore::take_position`] and advanced in each claim transaction by
//! [`ClaimTx::advance_positions`](idem_core::ClaimTx::advance_positions).

use async_trait::async_trait;
use idem_core::mutant::{self, Mutant};
use idem_core::position::merge;
use idem_core::sql::SqlText;
use idem_core::{sql, PositionMove, PositionStore, StoreError, StoredPosition, TakenPosition};

use crate::error::map_sqlx;
use crate::sql::statement;
use crate::store::{PgStore, PgTx};

/// Rows per partition (`slot` 0 to 15, `migrations/0013_positions.sql`): a
/// transaction writes the slot of its lowest offset in the partition, so the
/// transactions of one partition in flight at once rarely write the same row.
pub(crate) const SLOTS: i64 = 16;

/// The epoch check of [`advance`]: a row moves only at the move's epoch.
const AT_EPOCH: &str = "AND p.epoch = m.epoch";

/// The offsets a slot row holds in its `done` array ([`idem_core::position::HELD`]);
/// the rest are rows of `idem_position_offsets`.
const HELD: usize = idem_core::position::HELD;

/// One statement for every partition of the transaction's moves: per partition, the
/// slot of its lowest offset takes the member's settled prefix and the offsets. The rows
/// are locked in partition order first (two transactions never wait on each other in
/// opposite orders), each at its move's epoch; a row taken since by another member (a
/// later epoch) is not locked, not moved, and not returned: the caller's transaction is
/// fenced. A slot keeps only the offsets at or past its settled prefix, at most
/// [`HELD`] of them: the transaction's offsets that do not fit are rows of
/// `idem_position_offsets`, and the slot's rows there below its settled prefix go.
fn advance_sql(table: &SqlText, offsets: &SqlText, fenced: bool) -> SqlText {
    let at_epoch = if fenced { AT_EPOCH } else { "" };
    sql!(
        "WITH m AS ( \
            SELECT u.part, u.epoch, max(u.settled) AS settled, array_agg(u.off) AS offsets, \
                   (min(u.off) % {slots})::int2 AS slot \
            FROM unnest($2::int4[], $3::int8[], $4::int8[], $5::int8[]) AS u(part, epoch, settled, off) \
            GROUP BY u.part, u.epoch \
         ), locked AS MATERIALIZED ( \
            SELECT p.partition, p.slot, m.epoch, greatest(p.settled, m.settled) AS settled, m.offsets, \
                   ARRAY(SELECT x FROM unnest(p.done) AS x WHERE x >= greatest(p.settled, m.settled)) AS kept \
            FROM {table} AS p \
            JOIN m ON m.part = p.partition AND m.slot = p.slot {at_epoch} \
            WHERE p.source = $1 ORDER BY p.partition FOR NO KEY UPDATE OF p \
         ), moved AS ( \
            UPDATE {table} AS p SET \
               settled = l.settled, \
               done = CASE WHEN cardinality(l.kept) + cardinality(l.offsets) <= {held} \
                      THEN ARRAY(SELECT DISTINCT x FROM unnest(l.kept || l.offsets) AS x \
                                 WHERE x >= l.settled ORDER BY x) \
                      ELSE l.kept END, \
               advanced_at = now() \
            FROM locked AS l \
            WHERE p.source = $1 AND p.partition = l.partition AND p.slot = l.slot \
            RETURNING p.partition, p.slot, l.epoch, l.settled, l.offsets, p.done \
         ), spilled AS ( \
            INSERT INTO {offsets} (source, partition, slot, off) \
            SELECT $1, v.partition, v.slot, x FROM moved AS v, unnest(v.offsets) AS x \
            WHERE x >= v.settled AND x <> ALL (v.done) \
            ON CONFLICT DO NOTHING \
         ), pruned AS ( \
            DELETE FROM {offsets} AS o USING moved AS v \
            WHERE o.source = $1 AND o.partition = v.partition AND o.slot = v.slot AND o.off < v.settled \
         ) \
         SELECT partition, epoch FROM moved",
        table,
        offsets,
        at_epoch,
        slots = SLOTS,
        held = HELD
    )
}

/// [`advance_sql`] for one move (a transaction of one delivery): its slot row, at its
/// epoch, in one plain UPDATE; the offset is a row of `idem_position_offsets` when the
/// slot has no room for it.
fn advance_one_sql(table: &SqlText, offsets: &SqlText, fenced: bool) -> SqlText {
    let at_epoch = if fenced {
        "AND epoch = $6"
    } else {
        "AND $6::int8 IS NOT NULL"
    };
    // Offsets below the settled prefix are pruned only once the slot holds 64 (they
    // are harmless to the merge, which skips them): most updates append one number.
    // A slot still full after the prune (an offset stays undone) keeps its array and the
    // offset is a row of its own.
    let kept = "ARRAY(SELECT x FROM unnest(done) AS x WHERE x >= greatest(settled, $4))";
    sql!(
        "WITH moved AS ( \
            UPDATE {table} SET \
               settled = greatest(settled, $4), \
               done = CASE WHEN cardinality(done) < {held} THEN done || $5::int8 \
                      WHEN cardinality({kept}) < {held} THEN {kept} || $5::int8 \
                      ELSE {kept} END, \
               advanced_at = now() \
            WHERE source = $1 AND partition = $2 AND slot = $3 {at_epoch} \
            RETURNING partition, settled, $5::int8 = ANY (done) AS held \
         ), spilled AS ( \
            INSERT INTO {offsets} (source, partition, slot, off) \
            SELECT $1, $2, $3, $5 FROM moved WHERE NOT held \
            ON CONFLICT DO NOTHING \
         ), pruned AS ( \
            DELETE FROM {offsets} AS o USING moved AS v \
            WHERE o.source = $1 AND o.partition = $2 AND o.slot = $3 AND o.off < v.settled \
         ) \
         SELECT partition FROM moved",
        table,
        offsets,
        at_epoch,
        kept,
        held = HELD
    )
}

/// Moves each partition's row in `tx` (see [`advance_sql`]).
pub(crate) async fn advance(tx: &mut PgTx, moves: &[PositionMove]) -> Result<(), StoreError> {
    let Some(first) = moves.first() else {
        return Ok(());
    };
    let source = &first.source;
    if let Some(other) = moves.iter().find(|m| m.source != *source) {
        return Err(StoreError::Config(format!(
            "one transaction holds positions of two sources ({source} and {})",
            other.source
        )));
    }
    let table = tx.sql_table("idem_positions");
    let offsets = tx.sql_table("idem_position_offsets");
    let fenced = !mutant::active(Mutant::UnfencedPositions);
    if let [one] = moves {
        let slot = i16::try_from(one.offset.rem_euclid(SLOTS)).unwrap_or(0);
        let (conn, reply) = tx.io();
        let moved: Option<i32> = match reply
            .wait(
                sqlx::query_scalar(statement(advance_one_sql(&table, &offsets, fenced)))
                    .bind(source.as_ref())
                    .bind(one.partition)
                    .bind(slot)
                    .bind(one.settled_below)
                    .bind(one.offset)
                    .bind(one.epoch)
                    .fetch_optional(conn),
            )
            .await
        {
            Ok(m) => m,
            Err(e) => {
                tx.mark_aborted();
                return Err(map_sqlx(e, "advance the log position"));
            }
        };
        return match moved {
            Some(_) => Ok(()),
            None => Err(StoreError::Fenced {
                source_name: source.to_string(),
                partitions: vec![one.partition],
            }),
        };
    }
    let text = advance_sql(&table, &offsets, fenced);
    let parts: Vec<i32> = moves.iter().map(|m| m.partition).collect();
    let epochs: Vec<i64> = moves.iter().map(|m| m.epoch).collect();
    let settled: Vec<i64> = moves.iter().map(|m| m.settled_below).collect();
    let offsets: Vec<i64> = moves.iter().map(|m| m.offset).collect();
    let (conn, reply) = tx.io();
    let moved: Vec<(i32, i64)> = match reply
        .wait(
            sqlx::query_as(statement(text))
                .bind(source.as_ref())
                .bind(&parts)
                .bind(&epochs)
                .bind(&settled)
                .bind(&offsets)
                .fetch_all(conn),
        )
        .await
    {
        Ok(m) => m,
        Err(e) => {
            tx.mark_aborted();
            return Err(map_sqlx(e, "advance the log positions"));
        }
    };
    // A partition moved at one epoch and not at another (deliveries of two of this
    // member's ownerships in one transaction) is fenced too.
    let mut taken: Vec<i32> = moves
        .iter()
        .filter(|m| !moved.contains(&(m.partition, m.epoch)))
        .map(|m| m.partition)
        .collect();
    if taken.is_empty() {
        return Ok(());
    }
    taken.sort_unstable();
    taken.dedup();
    Err(StoreError::Fenced {
        source_name: source.to_string(),
        partitions: taken,
    })
}

/// `idem_positions` and `idem_position_offsets` (`migrations/0013_positions.sql`) in the
/// store's schema.
#[async_trait]
impl PositionStore for PgStore {
    /// One transaction: an upsert raises the epoch of every slot of the partition
    /// (creating them at 1), waiting for any transaction that holds one of them, and
    /// returns them; with the partition's offset rows they are folded
    /// ([`idem_core::position::merge`]) into slot 0, which takes the lowest
    /// [`HELD`](idem_core::position::HELD)
    /// offsets the slots held (the rest of those become offset rows), and the others
    /// are emptied, so they never hold more than what happened since. Offset rows below
    /// the position go.
    async fn take_position(
        &self,
        source: &str,
        partition: i32,
    ) -> Result<TakenPosition, StoreError> {
        let table = self.sql_table("idem_positions");
        let offsets = self.sql_table("idem_position_offsets");
        let bump = sql!(
            "INSERT INTO {table} AS p (source, partition, slot, epoch) \
             SELECT $1, $2, s::int2, 1 FROM generate_series(0, {last}) AS s ORDER BY s \
             ON CONFLICT (source, partition, slot) DO UPDATE SET epoch = p.epoch + 1, taken_at = now() \
             RETURNING p.epoch, p.settled, p.done",
            table,
            last = SLOTS - 1
        );
        let spilled = sql!(
            "SELECT off FROM {offsets} WHERE source = $1 AND partition = $2",
            offsets
        );
        let fold = sql!(
            "WITH f AS ( \
                UPDATE {table} SET settled = $3, \
                   done = CASE WHEN slot = 0 THEN $4::int8[] ELSE ARRAY[]::int8[] END \
                WHERE source = $1 AND partition = $2 \
             ), spill AS ( \
                INSERT INTO {offsets} (source, partition, slot, off) \
                SELECT $1, $2, 0, x FROM unnest($5::int8[]) AS x ON CONFLICT DO NOTHING \
             ) \
             DELETE FROM {offsets} WHERE source = $1 AND partition = $2 AND off < $3",
            table,
            offsets
        );
        let take = async {
            let mut tx = self.pool().begin().await?;
            let slots: Vec<(i64, Option<i64>, Vec<i64>)> = sqlx::query_as(statement(bump))
                .bind(source)
                .bind(partition)
                .fetch_all(&mut *tx)
                .await?;
            let rows: Vec<i64> = sqlx::query_scalar(statement(spilled))
                .bind(source)
                .bind(partition)
                .fetch_all(&mut *tx)
                .await?;
            let epoch = slots.iter().map(|s| s.0).max().unwrap_or(1);
            let merged = merge(
                slots
                    .iter()
                    .map(|(_, settled, done)| (*settled, &done[..]))
                    .chain(std::iter::once((None, &rows[..]))),
            );
            if let Some((next, done)) = &merged {
                // The slots' offsets still done past the position: the lowest stay in
                // slot 0's array, the rest become rows beside those already rows.
                let mut held: Vec<i64> = slots
                    .iter()
                    .flat_map(|(_, _, d)| d.iter().copied())
                    .filter(|o| done.binary_search(o).is_ok())
                    .collect();
                held.sort_unstable();
                held.dedup();
                let spill = held.split_off(held.len().min(HELD));
                sqlx::query(statement(fold))
                    .bind(source)
                    .bind(partition)
                    .bind(next)
                    .bind(&held)
                    .bind(&spill)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            Ok::<_, sqlx::Error>(TakenPosition {
                epoch,
                next: merged.as_ref().map(|m| m.0),
                done: merged.map(|m| m.1).unwrap_or_default(),
            })
        };
        take.await
            .map_err(|e| map_sqlx(e, "take a partition's log position"))
    }

    async fn positions(&self, source: &str) -> Result<Vec<StoredPosition>, StoreError> {
        let table = self.sql_table("idem_positions");
        let offsets = self.sql_table("idem_position_offsets");
        // Each partition's slots, with its offset rows as one array more (slot -1).
        let text = sql!(
            "SELECT partition, slot, settled, done, epoch FROM {table} WHERE source = $1 \
             UNION ALL \
             SELECT partition, -1::int2, NULL::int8, array_agg(off), NULL::int8 FROM {offsets} \
             WHERE source = $1 GROUP BY partition \
             ORDER BY 1, 2",
            table,
            offsets
        );
        type Row = (i32, i16, Option<i64>, Vec<i64>, Option<i64>);
        let rows: Vec<Row> = sqlx::query_as(statement(text))
            .bind(source)
            .fetch_all(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "read the log positions"))?;
        let mut out: Vec<StoredPosition> = Vec::new();
        for part in rows.chunk_by(|a, b| a.0 == b.0) {
            // Offset rows of a partition without slot rows (none is written without
            // one) say nothing on their own.
            let Some(epoch) = part.iter().filter_map(|r| r.4).max() else {
                continue;
            };
            let merged = merge(
                part.iter()
                    .map(|(_, _, settled, done, _)| (*settled, &done[..])),
            );
            out.push(StoredPosition {
                source: source.to_owned(),
                partition: part[0].0,
                next: merged.as_ref().map(|m| m.0),
                done: merged.map(|m| m.1).unwrap_or_default(),
                epoch,
            });
        }
        Ok(out)
    }
}
