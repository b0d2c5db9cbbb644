//! Retention, shared by the SQL stores: what a purge deletes ([`PurgeOptions`]), the
//! floor it never goes below ([`RetentionFloor`]), and what it reports ([`PurgeReport`],
//! [`PurgeProgress`]). `idem_store_postgres::PgStore::purge` and
//! `idem_store_sqlite::SqliteStore::purge` take and return these.
//!
//! ```
//! use std::time::Duration;
//! use idem_core::retention::{PurgeOptions, RetentionFloor, DEFAULT_RETENTION_FLOOR};
//!
//! let opts = PurgeOptions::new(Duration::from_secs(30 * 86_400)).dry_run(true);
//! assert_eq!(opts.floor, DEFAULT_RETENTION_FLOOR);
//! assert_eq!(RetentionFloor::Years(3).to_string(), "interval '3 years'");
//! ```

use std::time::Duration;

use crate::record::Timestamp;

/// The age below which records are not purged without an explicit override.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetentionFloor {
    /// Calendar years, counted by the server (`now() - interval 'N years'` on Postgres, `datetime('now', '-N years')` on SQLite), so leap
    /// days count: three years back from 2028-03-01 is 2025-03-01, 1096 days.
    Years(u32),
    /// An exact duration.
    Exactly(Duration),
}

impl RetentionFloor {
    /// The instant a floor reaches back to from `now`: calendar years counted in UTC (a
    /// 29 February goes back to the 28th where the year has none, as on the servers), an
    /// exact duration subtracted.
    ///
    /// ```
    /// use idem_core::record::Timestamp;
    /// use idem_core::retention::RetentionFloor;
    /// let now = Timestamp::parse_rfc3339("2028-03-01T12:00:00Z").unwrap();
    /// let cutoff = RetentionFloor::Years(3).cutoff(now);
    /// assert_eq!(Some(cutoff), Timestamp::parse_rfc3339("2025-03-01T12:00:00Z"));
    /// ```
    pub fn cutoff(self, now: Timestamp) -> Timestamp {
        let micros = now.unix_micros();
        match self {
            Self::Years(n) => now.years_earlier(n),
            Self::Exactly(d) => Timestamp::from_unix_micros(
                micros.saturating_sub(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)),
            ),
        }
    }

    /// The floor in words: `3 calendar years`, or the exact duration.
    pub fn describe(self) -> String {
        match self {
            Self::Years(1) => "1 calendar year".to_owned(),
            Self::Years(n) => format!("{n} calendar years"),
            Self::Exactly(d) => format!("{d:?}"),
        }
    }
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

/// What a store's `purge` deletes.
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
    /// Postgres, partitioned layout: the monthly partitions of `processed_messages` dropped whole
    /// (or that would be, in a dry run). Their rows are not in
    /// [`dedup_records`](PurgeReport::dedup_records), which counts rows deleted one by
    /// one (from the default partition).
    pub partitions_dropped: Vec<String>,
    /// Postgres, partitioned layout: old partitions kept because a row of theirs was claimed after
    /// the cutoff (a late message with an old timestamp); a later purge drops them.
    pub partitions_kept: Vec<String>,
    /// The planner's estimate of the rows in the dropped partitions (`pg_class.reltuples`;
    /// 0 for a partition never analysed): counting them exactly would read them all.
    pub partition_rows_estimate: u64,
}

impl PurgeProgress {
    /// `batch_rows` more rows of `table`, `rows_so_far` in all.
    pub fn new(table: PurgeTable, rows_so_far: u64, batch_rows: u64) -> Self {
        Self {
            table,
            rows_so_far,
            batch_rows,
        }
    }
}

impl PurgeReport {
    /// An empty report of a purge up to `cutoff` (nothing counted yet), for a store to
    /// fill in.
    pub fn new(cutoff: Timestamp, dry_run: bool) -> Self {
        Self {
            cutoff,
            dedup_records: 0,
            outbox_events: 0,
            dry_run,
            batches: 0,
            partitions_dropped: Vec::new(),
            partitions_kept: Vec::new(),
            partition_rows_estimate: 0,
        }
    }

    /// Adds `n` rows deleted (or counted) in `table`.
    pub fn add(&mut self, table: PurgeTable, n: u64) {
        match table {
            PurgeTable::DedupRecords => self.dedup_records += n,
            PurgeTable::OutboxEvents => self.outbox_events += n,
        }
    }
}
