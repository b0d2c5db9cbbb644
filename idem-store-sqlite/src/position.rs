//! Log positions kept in the claim's transaction ([`idem_core::position`]): the
//! `idem_positions` table (`migrations/0005_positions.sql`). SQLite has one writer at a
//! time (every claim transaction begins `IMMEDIATE`), so a partition's row is read,
//! moved by [`idem_core::position::advance`] and written back inside the transaction.

use async_trait::async_trait;
use idem_core::mutant::{self, Mutant};
use idem_core::position::{advance as advance_position, merge, HELD};
use idem_core::{PositionMove, PositionStore, StoreError, StoredPosition, TakenPosition};
use sqlx::SqliteConnection;

use crate::error::map;
use crate::store::{SqliteStore, SqliteTx};

fn parse_done(text: &str) -> Result<Vec<i64>, StoreError> {
    serde_json::from_str(text).map_err(|e| {
        StoreError::other(
            format!("idem_positions.done is not a JSON array: {e}"),
            false,
        )
    })
}

fn done_text(done: &[i64]) -> String {
    serde_json::to_string(done).unwrap_or_else(|_| "[]".to_owned())
}

/// Moves each partition's row in the transaction, at its move's epoch; a partition whose
/// row is at another epoch (taken by another member since) makes the transaction
/// [`StoreError::Fenced`].
pub(crate) async fn advance(tx: &mut SqliteTx, moves: &[PositionMove]) -> Result<(), StoreError> {
    let Some(first) = moves.first() else {
        return Ok(());
    };
    let source = first.source.clone();
    if let Some(other) = moves.iter().find(|m| m.source != source) {
        return Err(StoreError::Config(format!(
            "one transaction holds positions of two sources ({source} and {})",
            other.source
        )));
    }
    let mut partitions: Vec<i32> = moves.iter().map(|m| m.partition).collect();
    partitions.sort_unstable();
    partitions.dedup();
    let fenced = !mutant::active(Mutant::UnfencedPositions);
    let mut taken = Vec::new();
    for partition in partitions {
        let mine: Vec<&PositionMove> = moves.iter().filter(|m| m.partition == partition).collect();
        if !move_row(tx.conn(), &source, partition, &mine, fenced).await? {
            taken.push(partition);
        }
    }
    if taken.is_empty() {
        Ok(())
    } else {
        Err(StoreError::Fenced {
            source_name: source.to_string(),
            partitions: taken,
        })
    }
}

/// Moves one partition's row; `false` when it is not at the moves' epoch.
async fn move_row(
    conn: &mut SqliteConnection,
    source: &str,
    partition: i32,
    moves: &[&PositionMove],
    fenced: bool,
) -> Result<bool, StoreError> {
    let row: Option<(Option<i64>, String, i64)> = sqlx::query_as(
        "SELECT next_offset, done, epoch FROM idem_positions WHERE source = ? AND partition = ?",
    )
    .bind(source)
    .bind(partition)
    .fetch_optional(&mut *conn)
    .await
    .map_err(|e| map("reading a log position", e))?;
    let Some((next, done, epoch)) = row else {
        return Ok(false);
    };
    if fenced && moves.iter().any(|m| m.epoch != epoch) {
        return Ok(false);
    }
    let settled = moves.iter().map(|m| m.settled_below).max().unwrap_or(0);
    let offsets: Vec<i64> = moves.iter().map(|m| m.offset).collect();
    let (next, mut done) = advance_position(next, &parse_done(&done)?, settled, &offsets);
    // The row keeps the lowest HELD offsets done; the rest are rows of their own.
    let spill = done.split_off(done.len().min(HELD));
    for off in spill {
        sqlx::query(
            "INSERT INTO idem_position_offsets (source, partition, off) VALUES (?, ?, ?) \
             ON CONFLICT DO NOTHING",
        )
        .bind(source)
        .bind(partition)
        .bind(off)
        .execute(&mut *conn)
        .await
        .map_err(|e| map("keeping a done offset", e))?;
    }
    sqlx::query("DELETE FROM idem_position_offsets WHERE source = ? AND partition = ? AND off < ?")
        .bind(source)
        .bind(partition)
        .bind(next)
        .execute(&mut *conn)
        .await
        .map_err(|e| map("pruning the done offsets", e))?;
    sqlx::query(concat!(
        "UPDATE idem_positions SET next_offset = ?, done = ?, advanced_at = ",
        now!(),
        " WHERE source = ? AND partition = ?"
    ))
    .bind(next)
    .bind(done_text(&done))
    .bind(source)
    .bind(partition)
    .execute(&mut *conn)
    .await
    .map_err(|e| map("advancing a log position", e))?;
    Ok(true)
}

/// `idem_positions` (`migrations/0005_positions.sql`).
#[async_trait]
impl PositionStore for SqliteStore {
    /// One autocommitted upsert that raises the epoch (or creates the row at 1) and
    /// returns the row; it waits for the writer's lock, so it follows any claim
    /// transaction in progress.
    async fn take_position(
        &self,
        source: &str,
        partition: i32,
    ) -> Result<TakenPosition, StoreError> {
        let (epoch, next, done): (i64, Option<i64>, String) = sqlx::query_as(concat!(
            "INSERT INTO idem_positions (source, partition, epoch, taken_at) VALUES (?, ?, 1, ",
            now!(),
            ") ON CONFLICT (source, partition) DO UPDATE SET epoch = epoch + 1, taken_at = ",
            now!(),
            " RETURNING epoch, next_offset, done"
        ))
        .bind(source)
        .bind(partition)
        .fetch_one(self.pool())
        .await
        .map_err(|e| map("taking a partition's log position", e))?;
        let (next, done) = self.with_rows(source, partition, next, &done).await?;
        Ok(TakenPosition { epoch, next, done })
    }

    async fn positions(&self, source: &str) -> Result<Vec<StoredPosition>, StoreError> {
        let rows: Vec<(i32, Option<i64>, String, i64)> = sqlx::query_as(
            "SELECT partition, next_offset, done, epoch FROM idem_positions \
             WHERE source = ? ORDER BY partition",
        )
        .bind(source)
        .fetch_all(self.pool())
        .await
        .map_err(|e| map("reading the log positions", e))?;
        let mut out = Vec::with_capacity(rows.len());
        for (partition, next, done, epoch) in rows {
            let (next, done) = self.with_rows(source, partition, next, &done).await?;
            out.push(StoredPosition {
                source: source.to_owned(),
                partition,
                next,
                done,
                epoch,
            });
        }
        Ok(out)
    }
}

impl SqliteStore {
    /// A partition's position: its row's `next_offset` and `done` merged with its rows of
    /// `idem_position_offsets` ([`merge`]).
    async fn with_rows(
        &self,
        source: &str,
        partition: i32,
        next: Option<i64>,
        done: &str,
    ) -> Result<(Option<i64>, Vec<i64>), StoreError> {
        let done = parse_done(done)?;
        let rows: Vec<i64> = sqlx::query_scalar(
            "SELECT off FROM idem_position_offsets WHERE source = ? AND partition = ? ORDER BY off",
        )
        .bind(source)
        .bind(partition)
        .fetch_all(self.pool())
        .await
        .map_err(|e| map("reading the done offsets", e))?;
        if rows.is_empty() {
            return Ok((next, done));
        }
        Ok(match merge([(next, &done[..]), (None, &rows[..])]) {
            Some((next, done)) => (Some(next), done),
            None => (None, Vec::new()),
        })
    }
}
