//! Retention: [`PgStore::purge`] deletes dedup records and *published* outbox rows older
//! than a cutoff, in short bounded batches, and refuses to go below a retention floor.

use std::time::Duration;

use crate::error::{map_sqlx, PgError};
use crate::inspect::Timestamp;
use crate::store::PgStore;
use crate::sql::statement;
use idem_core::sql;

/// The age below which records are not purged without an explicit override.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetentionFloor {
    /// Calendar years, counted by the server (`now() - interval 'N years'`), so leap
    /// days count: three years back from 2028-03-01 is 2025-03-01, 1096 days.
    Years(u32),
    /// An exact duration.
    Exactly(Duration),
}

impl From<Duration> for RetentionFloor {
    fn from(d: Duration) -> Self {
        Self::Exactly(d)
    }
}

impl std::fmt::Display for RetentionFloor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Years(n) => write!(f, "interval '{n} years'"),
            Self::Exactly(d) => write!(f, "{d:?}"),
        }
    }
}

/// Three calendar years (`interval '3 years'`, leap days included): the record retention
/// of 2 CFR §200.334.
pub const DEFAULT_RETENTION_FLOOR: RetentionFloor = RetentionFloor::Years(3);

/// What [`PgStore::purge`] deletes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeOptions {
    /// Delete records older than this (claimed, or created and published, before
    /// `now() - older_than`).
    pub older_than: Duration,
    /// The retention floor; default [`DEFAULT_RETENTION_FLOOR`]. A purge with
    /// `older_than` below it is refused unless `allow_below_floor`.
    pub floor: RetentionFloor,
    /// Explicitly allows `older_than` below `floor`.
    pub allow_below_floor: bool,
    /// Rows deleted per statement (each its own short transaction). Default 1000.
    pub batch_size: usize,
    /// Only count what would be deleted.
    pub dry_run: bool,
}

impl PurgeOptions {
    /// Options deleting records older than `older_than`, with the default floor and
    /// batch size.
    pub fn new(older_than: Duration) -> Self {
        Self {
            older_than,
            floor: DEFAULT_RETENTION_FLOOR,
            allow_below_floor: false,
            batch_size: 1000,
            dry_run: false,
        }
    }

    /// Sets [`floor`](PurgeOptions::floor).
    #[must_use]
    pub fn with_floor(mut self, floor: impl Into<RetentionFloor>) -> Self {
        self.floor = floor.into();
        self
    }

    /// Sets [`allow_below_floor`](PurgeOptions::allow_below_floor).
    #[must_use]
    pub fn allow_below_floor(mut self, allow: bool) -> Self {
        self.allow_below_floor = allow;
        self
    }

    /// Sets [`batch_size`](PurgeOptions::batch_size) (at least 1).
    #[must_use]
    pub fn with_batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// Sets [`dry_run`](PurgeOptions::dry_run).
    #[must_use]
    pub fn dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self
    }
}

impl Default for PurgeOptions {
    /// Purges nothing younger than four years of 366 days (above the default floor).
    fn default() -> Self {
        Self::new(Duration::from_secs(4 * 366 * 86_400))
    }
}

/// Which table a [`PurgeProgress`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PurgeTable {
    /// `processed_messages`.
    DedupRecords,
    /// `outbox` (published rows only).
    OutboxEvents,
}

impl PurgeTable {
    /// The table's name.
    pub fn table_name(self) -> &'static str {
        match self {
            Self::DedupRecords => "processed_messages",
            Self::OutboxEvents => "outbox",
        }
    }
}

/// Reported after each batch (and once per table in a dry run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeProgress {
    /// The table.
    pub table: PurgeTable,
    /// Rows deleted (or, in a dry run, counted) in this table so far.
    pub rows_so_far: u64,
    /// Rows of this batch.
    pub batch_rows: u64,
}

/// What a purge did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Records older than this were purged.
    pub cutoff: Timestamp,
    /// Dedup records deleted (or that would be, in a dry run).
    pub dedup_records: u64,
    /// Published outbox rows deleted (or that would be).
    pub outbox_events: u64,
    /// Whether this was a dry run (nothing deleted).
    pub dry_run: bool,
    /// Batches (statements) run.
    pub batches: u64,
    /// Partitioned layout: the monthly partitions of `processed_messages` dropped whole
    /// (or that would be, in a dry run). Their rows are not in
    /// [`dedup_records`](PurgeReport::dedup_records), which counts rows deleted one by
    /// one (from the default partition).
    pub partitions_dropped: Vec<String>,
    /// Partitioned layout: old partitions kept because a row of theirs was claimed after
    /// the cutoff (a late message with an old timestamp); a later purge drops them.
    pub partitions_kept: Vec<String>,
    /// The planner's estimate of the rows in the dropped partitions (`pg_class.reltuples`;
    /// 0 for a partition never analysed): counting them exactly would read them all.
    pub partition_rows_estimate: u64,
}

impl PgStore {
    /// Whether a cutoff `older_than` ago is younger than `floor` ago. Calendar floors are
    /// computed by the server (`now() - interval 'N years'`), so a leap day counts.
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
                    "SELECT now() - make_interval(secs => $1) > now() - make_interval(years => $2)",
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
        let mut report = PurgeReport {
            cutoff: Timestamp::from_unix_micros(cutoff_micros),
            dedup_records: 0,
            outbox_events: 0,
            dry_run: opts.dry_run,
            batches: 0,
            partitions_dropped: Vec::new(),
            partitions_kept: Vec::new(),
            partition_rows_estimate: 0,
        };
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
                statement(sql!(
                    "SELECT count(*) FROM {ob} WHERE published_at IS NOT NULL \
                     AND created_at < to_timestamp($1)",
                    ob
                )),
                statement(sql!(
                    "DELETE FROM {ob} WHERE id IN (SELECT id FROM {ob} \
                     WHERE published_at IS NOT NULL AND created_at < to_timestamp($1) \
                     LIMIT $2 FOR UPDATE SKIP LOCKED)",
                    ob
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
                progress(&PurgeProgress {
                    table: *table,
                    rows_so_far: total,
                    batch_rows: total,
                });
            } else {
                loop {
                    // Each batch its own transaction, marked as the purge path so that
                    // the append-only trigger (PgStore::migrate_append_only) lets its
                    // DELETE through.
                    let mut tx = self
                        .pool()
                        .begin()
                        .await
                        .map_err(|e| map_sqlx(e, "begin purge batch"))?;
                    sqlx::query("SELECT set_config('idem.purge', 'on', true)")
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| map_sqlx(e, "mark purge transaction"))?;
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
                        progress(&PurgeProgress {
                            table: *table,
                            rows_so_far: total,
                            batch_rows: n,
                        });
                    }
                    if n < batch.unsigned_abs() {
                        break;
                    }
                }
            }
            match table {
                PurgeTable::DedupRecords => report.dedup_records = total,
                PurgeTable::OutboxEvents => report.outbox_events = total,
            }
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
