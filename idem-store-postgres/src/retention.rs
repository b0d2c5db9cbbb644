//! Retention: [`PgStore::purge`] deletes dedup records and *published* outbox rows older
//! than a cutoff, in short bounded batches, and refuses to go below a retention floor.

use std::time::Duration;

use crate::error::{map_sqlx, PgError};
pub use idem_core::retention::{
    PurgeOptions, PurgeProgress, PurgeReport, PurgeTable, RetentionFloor, DEFAULT_RETENTION_FLOOR,
};

use crate::inspect::Timestamp;
use crate::sql::statement;
use crate::store::PgStore;
use idem_core::sql;

impl PgStore {
    /// Whether a cutoff `older_than` ago is younger than `floor` ago. Calendar floors are
    /// computed by the server in UTC (`now() AT TIME ZONE 'UTC' - interval 'N years'`), so
    /// a leap day counts and the session's time zone (a daylight-saving hour) does not, as
    /// `RetentionFloor::cutoff` and `idem purge --older-than Ny` count them.
    async fn below_floor(
        &self,
        older_than: Duration,
        floor: RetentionFloor,
    ) -> Result<bool, PgError> {
        match floor {
            RetentionFloor::Exactly(d) => Ok(older_than < d),
            RetentionFloor::Years(years) => {
                let years = i32::try_from(years).unwrap_or(i32::MAX);
                sqlx::query_scalar(
                    "SELECT (now() AT TIME ZONE 'UTC') - make_interval(secs => $1) \
                     > (now() AT TIME ZONE 'UTC') - make_interval(years => $2)",
                )
                .bind(older_than.as_secs_f64())
                .bind(years)
                .fetch_one(self.pool())
                .await
                .map_err(|e| map_sqlx(e, "compare with the retention floor").into())
            }
        }
    }

    /// On the partitioned layout ([`PgLayout::Partitioned`](crate::PgLayout)) it first
    /// detaches and drops each monthly partition whose month ended at least a day before
    /// the cutoff — a catalog operation, whatever the partition's size — unless one of its
    /// rows was claimed after the cutoff (then the partition is kept whole; see
    /// [`PurgeReport::partitions_kept`]). Rows of the default partition (timestamps that do
    /// not parse, months without a partition) are deleted in batches as below. The floor
    /// is checked first, exactly as on the plain layout.
    ///
    /// Deletes dedup records claimed before `now() - older_than` and published outbox
    /// rows created before it, `batch_size` rows per statement (each statement its own
    /// transaction: no long locks, concurrent consumers keep running). Unpublished outbox
    /// rows are never deleted. `progress` is called after each batch.
    ///
    /// A redelivery of a message whose dedup record has been purged is processed again:
    /// keep `older_than` above the broker's longest redelivery horizon.
    ///
    /// # Errors
    /// [`PgError::BelowRetentionFloor`] when `older_than < floor` and not
    /// `allow_below_floor` (nothing is deleted); [`PgError::Store`] from the database
    /// (batches already deleted stay deleted).
    ///
    /// ```no_run
    /// # async fn demo(store: idem_store_postgres::PgStore) -> Result<(), idem_store_postgres::PgError> {
    /// use std::time::Duration;
    /// use idem_store_postgres::PurgeOptions;
    ///
    /// let opts = PurgeOptions::new(Duration::from_secs(4 * 365 * 86_400)).dry_run(true);
    /// let report = store.purge(&opts, |p| eprintln!("{}: {}", p.table.table_name(), p.rows_so_far)).await?;
    /// println!("would delete {} records and {} events", report.dedup_records, report.outbox_events);
    /// # Ok(()) }
    /// ```
    pub async fn purge(
        &self,
        opts: &PurgeOptions,
        mut progress: impl FnMut(&PurgeProgress),
    ) -> Result<PurgeReport, PgError> {
        if !opts.allow_below_floor && self.below_floor(opts.older_than, opts.floor).await? {
            return Err(PgError::BelowRetentionFloor {
                older_than: opts.older_than,
                floor: opts.floor,
            });
        }
        let batch = i64::try_from(opts.batch_size.max(1)).unwrap_or(i64::MAX);
        // One cutoff for the whole run, computed by the server's clock.
        let cutoff_micros: i64 = sqlx::query_scalar(
            "SELECT (extract(epoch FROM now() - make_interval(secs => $1)) * 1000000)::bigint",
        )
        .bind(opts.older_than.as_secs_f64())
        .fetch_one(self.pool())
        .await
        .map_err(|e| map_sqlx(e, "compute purge cutoff"))?;
        let cutoff_secs = cutoff_micros as f64 / 1e6;
        let pm = self.sql_table("processed_messages");
        let ob = self.sql_table("outbox");
        let pend = self.sql_table("outbox_pending");
        let mut report = PurgeReport::new(Timestamp::from_unix_micros(cutoff_micros), opts.dry_run);
        // Partitioned: whole months first; then only the default partition row by row.
        let dedup_table = if self.layout() == crate::PgLayout::Partitioned {
            let dropped = self.drop_old_partitions(cutoff_secs, opts.dry_run).await?;
            report.partitions_dropped = dropped.dropped;
            report.partitions_kept = dropped.kept;
            report.partition_rows_estimate = dropped.rows_estimate;
            self.sql_table(crate::partition::DEFAULT_PARTITION)
        } else {
            pm
        };
        let targets = [
            (
                PurgeTable::DedupRecords,
                statement(sql!(
                    "SELECT count(*) FROM {dedup_table} WHERE claimed_at < to_timestamp($1)",
                    dedup_table
                )),
                statement(sql!(
                    "DELETE FROM {dedup_table} WHERE idempotency_key IN (SELECT idempotency_key \
                     FROM {dedup_table} WHERE claimed_at < to_timestamp($1) LIMIT $2 \
                     FOR UPDATE SKIP LOCKED)",
                    dedup_table
                )),
            ),
            (
                PurgeTable::OutboxEvents,
                // Never a row still in the relay's queue, whatever its published_at says.
                statement(sql!(
                    "SELECT count(*) FROM {ob} o WHERE o.published_at IS NOT NULL \
                     AND o.created_at < to_timestamp($1) \
                     AND NOT EXISTS (SELECT 1 FROM {pend} p WHERE p.id = o.id)",
                    ob,
                    pend
                )),
                statement(sql!(
                    "DELETE FROM {ob} WHERE id IN (SELECT o.id FROM {ob} o \
                     WHERE o.published_at IS NOT NULL AND o.created_at < to_timestamp($1) \
                     AND NOT EXISTS (SELECT 1 FROM {pend} p WHERE p.id = o.id) \
                     LIMIT $2 FOR UPDATE SKIP LOCKED)",
                    ob,
                    pend
                )),
            ),
        ];
        for (table, count_sql, delete_sql) in &targets {
            let mut total = 0u64;
            if opts.dry_run {
                let n: i64 = sqlx::query_scalar(count_sql.clone())
                    .bind(cutoff_secs)
                    .fetch_one(self.pool())
                    .await
                    .map_err(|e| map_sqlx(e, "count purgeable rows"))?;
                total = u64::try_from(n).unwrap_or(0);
                report.batches += 1;
                progress(&PurgeProgress::new(*table, total, total));
            } else {
                loop {
                    // Each batch its own transaction, marked as the purge path so that
                    // the append-only trigger (PgStore::migrate_append_only) lets its
                    // DELETE through.
                    let mut tx = self
                        .begin_with(
                            sqlx::query("SELECT set_config('idem.purge', 'on', true)"),
                            "begin purge batch",
                            "mark purge transaction",
                        )
                        .await?;
                    let n = sqlx::query(delete_sql.clone())
                        .bind(cutoff_secs)
                        .bind(batch)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| map_sqlx(e, "purge batch"))?
                        .rows_affected();
                    tx.commit()
                        .await
                        .map_err(|e| map_sqlx(e, "commit purge batch"))?;
                    report.batches += 1;
                    total += n;
                    if n > 0 {
                        progress(&PurgeProgress::new(*table, total, n));
                    }
                    if n < batch.unsigned_abs() {
                        break;
                    }
                }
            }
            report.add(*table, total);
        }
        tracing::info!(
            target: "idem::retention",
            schema = self.schema(),
            dedup_records = report.dedup_records,
            partitions_dropped = report.partitions_dropped.len(),
            outbox_events = report.outbox_events,
            dry_run = report.dry_run,
            "purge finished"
        );
        Ok(report)
    }
}
