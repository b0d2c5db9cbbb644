//! Retention, as on Postgres: [`SqliteStore::purge`] deletes dedup records and
//! *published* outbox rows older than a cutoff, in short bounded batches, and refuses to
//! go below a retention floor. The options and the report are the types every SQL store
//! shares ([`idem_core::retention`]).

use std::time::Duration;

use idem_core::record::Timestamp;
use idem_core::retention::{PurgeOptions, PurgeProgress, PurgeReport, PurgeTable, RetentionFloor};

use crate::error::{map, SqliteError};
use crate::store::SqliteStore;

impl SqliteStore {
    /// The purge's cutoff (`now - older_than`) and the floor's instant (`now - floor`), as
    /// stored text, from one reading of SQLite's clock. A calendar floor is counted by
    /// SQLite's date functions (`'-N years'`), so a leap day counts, as on Postgres.
    async fn cutoff_and_floor(
        &self,
        older_than: Duration,
        floor: RetentionFloor,
    ) -> Result<(String, String), SqliteError> {
        let floor = match floor {
            RetentionFloor::Years(n) => format!("-{n} years"),
            RetentionFloor::Exactly(d) => format!("-{:.3} seconds", d.as_secs_f64()),
        };
        sqlx::query_as(
            "SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?1), \
                    strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?2)",
        )
        .bind(format!("-{:.3} seconds", older_than.as_secs_f64()))
        .bind(floor)
        .fetch_one(self.pool())
        .await
        .map_err(|e| map("computing the purge cutoff", e).into())
    }

    /// Deletes dedup records claimed before `now - older_than` and published outbox rows
    /// created before it, `batch_size` rows per statement, each statement its own short
    /// write transaction (consumers wait for the write lock one batch at a time, never
    /// for the whole purge). Unpublished outbox rows are never deleted. `progress` is
    /// called after each batch. The business rows are the application's and are kept.
    ///
    /// A redelivery of a message whose dedup record has been purged is processed again:
    /// keep `older_than` above the broker's longest redelivery horizon.
    ///
    /// # Errors
    /// [`SqliteError::BelowRetentionFloor`] when `older_than < floor` and not
    /// `allow_below_floor` (nothing is deleted); [`SqliteError::Store`] from the database
    /// (batches already deleted stay deleted).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use idem_store_sqlite::{PurgeOptions, SqliteConfig, SqliteError, SqliteStore};
    ///
    /// let dir = tempfile::tempdir()?;
    /// let store = SqliteStore::connect(dir.path().join("idem.db").to_str().unwrap(), SqliteConfig::default()).await?;
    /// store.migrate().await?;
    /// // Four years back: above the default floor of three calendar years.
    /// let report = store.purge(&PurgeOptions::new(Duration::from_secs(4 * 366 * 86_400)), |_| {}).await?;
    /// assert_eq!((report.dedup_records, report.outbox_events), (0, 0));
    /// // A month back is below the floor: refused, nothing deleted.
    /// let month = PurgeOptions::new(Duration::from_secs(30 * 86_400));
    /// assert!(matches!(store.purge(&month, |_| {}).await, Err(SqliteError::BelowRetentionFloor { .. })));
    /// # Ok(()) }
    /// ```
    pub async fn purge(
        &self,
        opts: &PurgeOptions,
        mut progress: impl FnMut(&PurgeProgress),
    ) -> Result<PurgeReport, SqliteError> {
        // One cutoff for the whole run, in the stored text form (compared as text, which
        // sorts as time does).
        let (stored, floor) = self.cutoff_and_floor(opts.older_than, opts.floor).await?;
        let cutoff = Timestamp::parse_rfc3339(&stored).unwrap_or_else(Timestamp::now);
        if !opts.allow_below_floor && stored > floor {
            return Err(SqliteError::BelowRetentionFloor {
                older_than: opts.older_than,
                floor: opts.floor,
            });
        }
        let batch = i64::try_from(opts.batch_size.max(1)).unwrap_or(i64::MAX);
        let mut report = PurgeReport::new(cutoff, opts.dry_run);
        let targets = [
            (
                PurgeTable::DedupRecords,
                "SELECT count(*) FROM processed_messages WHERE claimed_at < ?1",
                "DELETE FROM processed_messages WHERE idempotency_key IN (SELECT idempotency_key \
                 FROM processed_messages WHERE claimed_at < ?1 LIMIT ?2)",
            ),
            (
                PurgeTable::OutboxEvents,
                "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND created_at < ?1",
                "DELETE FROM outbox WHERE id IN (SELECT id FROM outbox \
                 WHERE published_at IS NOT NULL AND created_at < ?1 LIMIT ?2)",
            ),
        ];
        for (table, count_sql, delete_sql) in targets {
            let mut total = 0u64;
            if opts.dry_run {
                let n: i64 = sqlx::query_scalar(count_sql)
                    .bind(&stored)
                    .fetch_one(self.pool())
                    .await
                    .map_err(|e| map("counting purgeable rows", e))?;
                total = u64::try_from(n).unwrap_or(0);
                report.batches += 1;
                progress(&PurgeProgress::new(table, total, total));
            } else {
                loop {
                    let mut tx = self
                        .pool()
                        .begin_with("BEGIN IMMEDIATE")
                        .await
                        .map_err(|e| map("beginning a purge batch", e))?;
                    let n = sqlx::query(delete_sql)
                        .bind(&stored)
                        .bind(batch)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| map("purging a batch", e))?
                        .rows_affected();
                    tx.commit()
                        .await
                        .map_err(|e| map("committing a purge batch", e))?;
                    report.batches += 1;
                    total += n;
                    if n > 0 {
                        progress(&PurgeProgress::new(table, total, n));
                    }
                    if n < batch.unsigned_abs() {
                        break;
                    }
                }
            }
            report.add(table, total);
        }
        tracing::info!(
            target: "idem::retention",
            dedup_records = report.dedup_records,
            outbox_events = report.outbox_events,
            dry_run = report.dry_run,
            "purge finished"
        );
        Ok(report)
    }
}
