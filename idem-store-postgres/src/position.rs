//! Log positions kept in the claim's transaction ([`idem_core::position`]): the
//! `idem_positions` table (`migrations/0013_positions.sql`), taken by a member with
//! [`PositionStore::take_position`] and advanced in each claim transaction by
//! [`ClaimTx::advance_positions`](idem_core::ClaimTx::advance_positions).

use async_trait::async_trait;
use idem_core::mutant::{self, Mutant};
use idem_core::sql::SqlText;
use idem_core::{sql, PositionMove, PositionStore, StoreError, StoredPosition, TakenPosition};

use crate::error::map_sqlx;
use crate::sql::statement;
use crate::store::{PgStore, PgTx};

/// The epoch check of [`advance`]: a row moves only at the move's epoch.
const AT_EPOCH: &str = "AND p.epoch = m.epoch";

/// One statement for every partition of the transaction's moves. The rows are locked
/// in partition order first (two transactions of one member never wait on each other
/// in opposite orders), each at its move's epoch; a row taken since by another member
/// (a later epoch) is not locked, not moved, and not returned: the caller's
/// transaction is fenced. `next_offset` moves by [`idem_core::position::advance`]:
/// past the member's settled prefix and every offset now done, never back.
fn advance_sql(table: &SqlText, fenced: bool) -> SqlText {
    let at_epoch = if fenced { AT_EPOCH } else { "" };
    sql!(
        "WITH m AS ( \
            SELECT u.part, u.epoch, max(u.settled) AS settled, array_agg(u.off) AS offsets \
            FROM unnest($2::int4[], $3::int8[], $4::int8[], $5::int8[]) AS u(part, epoch, settled, off) \
            GROUP BY u.part, u.epoch \
         ), locked AS MATERIALIZED ( \
            SELECT p.partition, m.settled, m.offsets FROM {table} AS p \
            JOIN m ON m.part = p.partition {at_epoch} \
            WHERE p.source = $1 ORDER BY p.partition FOR NO KEY UPDATE OF p \
         ) \
         UPDATE {table} AS p SET (next_offset, done, advanced_at) = ( \
            SELECT n.next, ARRAY(SELECT x FROM unnest(s.rest) AS x WHERE x > n.next ORDER BY x), now() \
            FROM (SELECT greatest(coalesce(p.next_offset, l.settled), l.settled) AS base, \
                         ARRAY(SELECT DISTINCT x FROM unnest(p.done || l.offsets) AS x \
                               WHERE x >= greatest(coalesce(p.next_offset, l.settled), l.settled)) AS rest) AS s \
            CROSS JOIN LATERAL (SELECT min(y) AS next \
                                FROM generate_series(s.base, s.base + cardinality(s.rest)) AS y \
                                WHERE y <> ALL (s.rest)) AS n \
         ) \
         FROM locked AS l \
         WHERE p.source = $1 AND p.partition = l.partition \
         RETURNING p.partition",
        table,
        at_epoch
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
    let fenced = !mutant::active(Mutant::UnfencedPositions);
    let text = advance_sql(&table, fenced);
    let parts: Vec<i32> = moves.iter().map(|m| m.partition).collect();
    let epochs: Vec<i64> = moves.iter().map(|m| m.epoch).collect();
    let settled: Vec<i64> = moves.iter().map(|m| m.settled_below).collect();
    let offsets: Vec<i64> = moves.iter().map(|m| m.offset).collect();
    let moved: Vec<i32> = match sqlx::query_scalar(statement(text))
        .bind(source.as_ref())
        .bind(&parts)
        .bind(&epochs)
        .bind(&settled)
        .bind(&offsets)
        .fetch_all(tx.own_conn())
        .await
    {
        Ok(m) => m,
        Err(e) => {
            tx.mark_aborted();
            return Err(map_sqlx(e, "advance the log positions"));
        }
    };
    let mut taken: Vec<i32> = parts.into_iter().filter(|p| !moved.contains(p)).collect();
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

/// `idem_positions` (`migrations/0013_positions.sql`) in the store's schema.
#[async_trait]
impl PositionStore for PgStore {
    /// One autocommitted upsert that raises the epoch (or creates the row at 1) and
    /// returns the row. It waits for the row's lock, held by a transaction that has
    /// advanced it and not ended, so what it returns includes that transaction.
    async fn take_position(
        &self,
        source: &str,
        partition: i32,
    ) -> Result<TakenPosition, StoreError> {
        let table = self.sql_table("idem_positions");
        let text = sql!(
            "INSERT INTO {table} AS p (source, partition, epoch) VALUES ($1, $2, 1) \
             ON CONFLICT (source, partition) DO UPDATE SET epoch = p.epoch + 1, taken_at = now() \
             RETURNING p.epoch, p.next_offset, p.done",
            table
        );
        let (epoch, next, done): (i64, Option<i64>, Vec<i64>) = sqlx::query_as(statement(text))
            .bind(source)
            .bind(partition)
            .fetch_one(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "take a partition's log position"))?;
        Ok(TakenPosition { epoch, next, done })
    }

    async fn positions(&self, source: &str) -> Result<Vec<StoredPosition>, StoreError> {
        let table = self.sql_table("idem_positions");
        let text = sql!(
            "SELECT partition, next_offset, done, epoch FROM {table} \
             WHERE source = $1 ORDER BY partition",
            table
        );
        let rows: Vec<(i32, Option<i64>, Vec<i64>, i64)> = sqlx::query_as(statement(text))
            .bind(source)
            .fetch_all(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "read the log positions"))?;
        Ok(rows
            .into_iter()
            .map(|(partition, next, done, epoch)| StoredPosition {
                source: source.to_owned(),
                partition,
                next,
                done,
                epoch,
            })
            .collect())
    }
}
