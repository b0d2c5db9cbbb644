//! The partitioned layout ([`PgLayout::Partitioned`]): `processed_messages` range-partitioned
//! by `submission_month`, the month written in the message's own submission timestamp.
//!
//! - [`PartitionMonth::of_timestamp`] is the pure function from a submission timestamp to
//!   its month: the calendar month *as written* (`2026-07-31T23:30:00-05:00` is July,
//!   whatever it is in UTC). A timestamp that does not start with a valid `YYYY-MM-DD`
//!   date has no month and is filed under `'-infinity'`, which only the default
//!   partition takes.
//! - [`PgStore::ensure_partitions`] creates the monthly partitions of a window around
//!   the current month ([`PgConfig::partition_months_back`](crate::PgConfig) /
//!   [`partition_months_ahead`](crate::PgConfig)); [`PgStore::migrate`] runs it, and so does
//!   every consumer start that migrates. Rows the default partition holds for a month
//!   being created are moved into the new partition in the same transaction.
//! - [`PgStore::purge`](crate::PgStore::purge) detaches and drops the partitions of months
//!   entirely older than the cutoff (see [`crate::retention`]).
//!
//! Why dedup stays exact: a unique constraint on a partitioned table holds per partition,
//! so it must include the partition key — the primary key is `(idempotency_key,
//! submission_month)`. The timestamp is part of the key's preimage
//! (`sha256(award_id|timestamp|sha256(payload))`), so one key has one timestamp and one
//! month, and every claim of it — the first delivery and every redelivery, whenever it
//! arrives — lands in the same partition and meets the earlier claim in its unique index.
//! Partitioning by `claimed_at` instead would let a redelivery claimed in the next month
//! through.

use crate::config::PgLayout;
use crate::error::{map_sqlx, sqlstate, PgError};
use crate::sql::statement;
use crate::store::PgStore;
use idem_core::ident::Ident;
use idem_core::sql::SqlText;
use idem_core::{sql, StoreError};
use sqlx::{Executor, PgPool};

/// The `submission_month` of a claim whose timestamp has no month (it does not parse, or
/// the pipeline gave none): only the default partition takes it.
pub const UNPARSED_MONTH: &str = "-infinity";

/// The name of the default partition.
pub const DEFAULT_PARTITION: &str = "processed_messages_default";

/// SQLSTATE 23514 (check_violation): the default partition holds rows of a month whose
/// partition is being created.
const CHECK_VIOLATION: &str = "23514";

/// A calendar month: one partition of the partitioned layout.
///
/// ```
/// use idem_store_postgres::PartitionMonth;
/// let m = PartitionMonth::of_timestamp("2026-07-31T23:30:00-05:00").expect("a month");
/// assert_eq!((m.year(), m.month()), (2026, 7));
/// assert_eq!(m.partition_name(), "processed_messages_p202607");
/// assert_eq!(m.plus(6).map(|n| n.first_day()), Some("2027-01-01".to_owned()));
/// assert_eq!(PartitionMonth::of_timestamp("yesterday"), None);
/// assert_eq!(PartitionMonth::of_timestamp("2026-13-01T00:00:00Z"), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PartitionMonth {
    // year * 12 + (month - 1): ordered, and plus() is an addition.
    index: i32,
}

impl PartitionMonth {
    /// The month `month` (1–12) of `year` (1–9999).
    pub fn new(year: i32, month: u32) -> Option<Self> {
        let m = i32::try_from(month).ok()?;
        ((1..=9999).contains(&year) && (1..=12).contains(&m)).then_some(Self {
            index: year * 12 + m - 1,
        })
    }

    /// The month written in a submission timestamp: the string must start with a date
    /// `YYYY-MM-DD` (year 0001–9999, month 01–12, day 01–31) followed by nothing, `T`,
    /// `t` or a space. The offset is not applied: the month is the one written, which
    /// makes it a pure function of the string (and so of the idempotency key).
    pub fn of_timestamp(timestamp: &str) -> Option<Self> {
        let b = timestamp.as_bytes();
        let digits = |r: std::ops::Range<usize>| -> Option<u32> {
            let s = b.get(r)?;
            if s.iter().all(u8::is_ascii_digit) {
                Some(s.iter().fold(0, |n, d| n * 10 + u32::from(d - b'0')))
            } else {
                None
            }
        };
        let year = digits(0..4)?;
        let month = digits(5..7)?;
        let day = digits(8..10)?;
        if b.get(4) != Some(&b'-') || b.get(7) != Some(&b'-') || !(1..=31).contains(&day) {
            return None;
        }
        if !matches!(b.get(10), None | Some(b'T' | b't' | b' ')) {
            return None;
        }
        Self::new(i32::try_from(year).ok()?, month)
    }

    /// The year.
    pub fn year(self) -> i32 {
        self.index.div_euclid(12)
    }

    /// The month, 1–12.
    pub fn month(self) -> u32 {
        self.index.rem_euclid(12).unsigned_abs() + 1
    }

    /// The month `n` months later (earlier when negative), if within years 1–9999.
    pub fn plus(self, n: i32) -> Option<Self> {
        let index = self.index.checked_add(n)?;
        let m = Self { index };
        (1..=9999).contains(&m.year()).then_some(m)
    }

    /// Its first day, `YYYY-MM-01` (the partition's lower bound).
    pub fn first_day(self) -> String {
        format!("{:04}-{:02}-01", self.year(), self.month())
    }

    /// Its first day as an SQL expression, `make_date(YYYY, MM, 1)` (the partition's
    /// lower bound), written from integers.
    fn first_day_sql(self) -> SqlText {
        sql!("make_date({y}, {m}, 1)", y = self.year(), m = self.month())
    }

    /// The first day of the next month as an SQL expression (the partition's upper
    /// bound, exclusive).
    fn end_day_sql(self) -> SqlText {
        Self {
            index: self.index + 1,
        }
        .first_day_sql()
    }

    /// [`partition_name`](Self::partition_name) as an identifier.
    fn partition_ident(self) -> Result<Ident, StoreError> {
        Ident::new(&self.partition_name()).map_err(|e| StoreError::other(e.to_string(), false))
    }

    /// The partition's table name, `processed_messages_pYYYYMM`.
    pub fn partition_name(self) -> String {
        format!("processed_messages_p{:04}{:02}", self.year(), self.month())
    }

    /// The month of a partition named by [`partition_name`](Self::partition_name).
    pub fn from_partition_name(name: &str) -> Option<Self> {
        let digits = name.strip_prefix("processed_messages_p")?;
        if digits.len() != 6 || !digits.bytes().all(|d| d.is_ascii_digit()) {
            return None;
        }
        Self::new(digits[..4].parse().ok()?, digits[4..].parse().ok()?)
    }
}

impl std::fmt::Display for PartitionMonth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:04}-{:02}", self.year(), self.month())
    }
}

/// The `submission_month` value bound for a claim (`YYYY-MM-01` or [`UNPARSED_MONTH`]).
pub(crate) fn month_value(timestamp: Option<&str>) -> String {
    timestamp
        .and_then(PartitionMonth::of_timestamp)
        .map_or_else(|| UNPARSED_MONTH.to_owned(), PartitionMonth::first_day)
}

/// The layout of `schema.processed_messages`, or `None` when it does not exist: a
/// partitioned table is [`PgLayout::Partitioned`]; a plain table whose primary key holds
/// `award_id` is [`PgLayout::Distributed`] (`migrations/0009_distributed.sql`, the same on
/// plain Postgres and on Citus); any other is [`PgLayout::Plain`].
pub(crate) async fn detect_layout(
    pool: &PgPool,
    schema: &str,
) -> Result<Option<PgLayout>, StoreError> {
    let found: Option<(String, bool)> = sqlx::query_as(
        "SELECT c.relkind::text, EXISTS (SELECT 1 FROM pg_index i \
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey) \
           WHERE i.indrelid = c.oid AND i.indisprimary AND a.attname = 'award_id') \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = 'processed_messages'",
    )
    .bind(schema)
    .fetch_optional(pool)
    .await
    .map_err(|e| map_sqlx(e, "read the layout of processed_messages"))?;
    Ok(found.map(|(kind, keyed_by_award)| {
        if kind == "p" {
            PgLayout::Partitioned
        } else if keyed_by_award {
            PgLayout::Distributed
        } else {
            PgLayout::Plain
        }
    }))
}

/// What dropping old partitions did (see [`PgStore::purge`](crate::PgStore::purge)).
#[derive(Debug, Default)]
pub(crate) struct DroppedPartitions {
    pub(crate) dropped: Vec<String>,
    pub(crate) kept: Vec<String>,
    pub(crate) rows_estimate: u64,
}

impl PgStore {
    /// The layout this store's claims are written for: the one found at
    /// [`connect`](PgStore::connect), else [`PgConfig::layout`](crate::PgConfig::layout).
    pub fn layout(&self) -> PgLayout {
        self.shared().layout
    }

    /// The monthly partitions of `processed_messages` (not the default one), oldest
    /// first. Empty on the plain layout.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn partitions(&self) -> Result<Vec<PartitionMonth>, StoreError> {
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = to_regclass($1)",
        )
        .bind(self.table("processed_messages"))
        .fetch_all(self.pool())
        .await
        .map_err(|e| map_sqlx(e, "list partitions"))?;
        let mut months: Vec<PartitionMonth> = names
            .iter()
            .filter_map(|n| PartitionMonth::from_partition_name(n))
            .collect();
        months.sort_unstable();
        Ok(months)
    }

    /// Creates the monthly partitions from [`PgConfig::partition_months_back`] months
    /// before the server's current month (UTC) to [`PgConfig::partition_months_ahead`]
    /// after it, those missing only; returns the names created. Does nothing on the plain
    /// layout. Run by [`migrate`](PgStore::migrate).
    ///
    /// [`PgConfig::partition_months_back`]: crate::PgConfig::partition_months_back
    /// [`PgConfig::partition_months_ahead`]: crate::PgConfig::partition_months_ahead
    ///
    /// # Errors
    /// [`StoreError`] from the database (a lock not obtained within 5 s included: a
    /// partition is created under a brief exclusive lock of `processed_messages`).
    pub async fn ensure_partitions(&self) -> Result<Vec<String>, StoreError> {
        if self.layout() != PgLayout::Partitioned {
            return Ok(Vec::new());
        }
        let (year, month): (i32, i32) = sqlx::query_as(
            "SELECT extract(year FROM now() AT TIME ZONE 'UTC')::int, \
                    extract(month FROM now() AT TIME ZONE 'UTC')::int",
        )
        .fetch_one(self.pool())
        .await
        .map_err(|e| map_sqlx(e, "read the current month"))?;
        let now = PartitionMonth::new(year, month.unsigned_abs())
            .ok_or_else(|| StoreError::Config(format!("the server's month {year}-{month}")))?;
        let back = i32::try_from(self.config().partition_months_back).unwrap_or(1200);
        let ahead = i32::try_from(self.config().partition_months_ahead).unwrap_or(1200);
        let first = now.plus(-back).unwrap_or(now);
        let last = now.plus(ahead).unwrap_or(now);
        self.create_partitions(first, last).await
    }

    /// Creates the monthly partitions `first..=last` that are missing; returns the names
    /// created. Rows that the default partition holds for one of these months (claims
    /// made while its partition did not exist) are moved into it, in the transaction that
    /// creates it, so every claim of a key stays in one partition.
    ///
    /// # Errors
    /// [`StoreError::Config`] on the plain layout; [`StoreError`] from the database.
    pub async fn create_partitions(
        &self,
        first: PartitionMonth,
        last: PartitionMonth,
    ) -> Result<Vec<String>, StoreError> {
        if self.layout() != PgLayout::Partitioned {
            return Err(StoreError::Config(format!(
                "processed_messages is not partitioned (the {} layout)",
                self.layout()
            )));
        }
        let existing = self.partitions().await?;
        let mut created = Vec::new();
        let mut m = first;
        while m <= last {
            if !existing.contains(&m) && self.create_partition(m).await? {
                created.push(m.partition_name());
            }
            match m.plus(1) {
                Some(n) => m = n,
                None => break,
            }
        }
        if !created.is_empty() {
            tracing::info!(
                target: "idem::partitions",
                schema = self.schema(),
                created = created.len(),
                "created monthly partitions of processed_messages"
            );
        }
        Ok(created)
    }

    /// Creates one month's partition; `false` when it already existed. When
    /// `processed_messages` is append-only ([`PgStore::migrate_append_only`]), the new
    /// partition gets the guard against `TRUNCATE` in the same transaction (the row
    /// triggers of the parent reach it by themselves).
    async fn create_partition(&self, m: PartitionMonth) -> Result<bool, StoreError> {
        let pm = self.sql_table("processed_messages");
        let part = self.shared().table_ident(&m.partition_ident()?);
        let default = self.sql_table(DEFAULT_PARTITION);
        let (from, to) = (m.first_day_sql(), m.end_day_sql());
        let create = sql!(
            "CREATE TABLE IF NOT EXISTS {part} PARTITION OF {pm} FOR VALUES FROM ({from}) TO ({to})",
            part,
            pm,
            from,
            to
        );
        let mut tx = self.ddl_tx().await?;
        let (exists, guarded): (bool, bool) = sqlx::query_as(
            "SELECT to_regclass($1) IS NOT NULL, EXISTS (SELECT 1 FROM pg_trigger \
               WHERE tgrelid = to_regclass($2) AND tgname = $3)",
        )
        .bind(part.as_str())
        .bind(pm.as_str())
        .bind(crate::migrate::TRUNCATE_GUARD)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| map_sqlx(e, "look up partition"))?;
        if exists {
            tx.rollback()
                .await
                .map_err(|e| map_sqlx(e, "end partition check"))?;
            return Ok(false);
        }
        let guard = if guarded {
            self.truncate_guard_sql(&part)
        } else {
            SqlText::new()
        };
        match tx
            .execute(statement(sql!("{create}; {guard}", create, guard)))
            .await
        {
            Ok(_) => {
                tx.commit()
                    .await
                    .map_err(|e| map_sqlx(e, "commit partition"))?;
                return Ok(true);
            }
            Err(e) if sqlstate(&e).as_deref() == Some(CHECK_VIOLATION) => {
                let _ = tx.rollback().await;
            }
            Err(e) => return Err(map_sqlx(e, "create partition")),
        }
        // The default partition holds rows of this month: take it out, create the
        // month's partition, move the rows through the parent (they are routed to the new
        // partition), delete them from the default partition and put it back — one
        // transaction, so no claim sees the month in two places. Every column moves: the
        // list is read from the catalog (the parent's columns, quoted with quote_ident)
        // when the rows move, so a column added later (the identity's
        // `submission_timestamp` was one) can never be left behind — a claim that lost
        // its identity would no longer meet a conflicting resubmission.
        let mut tx = self.ddl_tx().await?;
        let script = sql!(
            "SELECT set_config('idem.purge', 'on', true); \
             ALTER TABLE {pm} DETACH PARTITION {default}; \
             {create}; \
             {guard} \
             DO $idem_move$ \
             DECLARE cols text; \
             BEGIN \
               SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) INTO cols \
               FROM pg_attribute a \
               WHERE a.attrelid = '{pm}'::regclass AND a.attnum > 0 \
                 AND NOT a.attisdropped AND a.attgenerated = ''; \
               EXECUTE 'INSERT INTO {pm} (' || cols || ') OVERRIDING SYSTEM VALUE SELECT ' \
                 || cols || ' FROM {default} \
                 WHERE submission_month >= {from} AND submission_month < {to}'; \
             END \
             $idem_move$; \
             DELETE FROM {default} \
               WHERE submission_month >= {from} AND submission_month < {to}; \
             ALTER TABLE {pm} ATTACH PARTITION {default} DEFAULT;",
            pm,
            default,
            create,
            guard,
            from,
            to
        );
        tx.execute(statement(script))
            .await
            .map_err(|e| map_sqlx(e, "create partition and move its rows from the default"))?;
        tx.commit()
            .await
            .map_err(|e| map_sqlx(e, "commit partition"))?;
        Ok(true)
    }

    /// `CREATE TRIGGER` of the append-only guard against `TRUNCATE` on `table` (a
    /// partition of `processed_messages`), ending with `;`.
    fn truncate_guard_sql(&self, table: &SqlText) -> SqlText {
        let schema = &self.shared().schema;
        let trigger = crate::migrate::TRUNCATE_GUARD;
        sql!(
            "CREATE TRIGGER {trigger} BEFORE TRUNCATE ON {table} FOR EACH STATEMENT \
             EXECUTE FUNCTION {schema}.idem_processed_messages_append_only();",
            trigger,
            table,
            schema
        )
    }

    /// A transaction for partition DDL: the migration's advisory lock (so concurrent
    /// `migrate`s and consumer starts do not race) and a 5 s lock timeout (DDL waits for
    /// running claims, and claims queue behind it).
    async fn ddl_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
        self.begin_with(
            sqlx::query(
                "SELECT pg_advisory_xact_lock(hashtext($1)), set_config('lock_timeout', '5s', true)",
            )
            .bind(format!("idem-migrate.{}", self.schema())),
            "begin partition DDL",
            "lock for partition DDL",
        )
        .await
    }

    /// Detaches and drops the monthly partitions whose month ended at least a day before
    /// the cutoff (the day covers any offset a timestamp was written in), unless one of
    /// their rows was claimed at or after the cutoff (a late message with an old
    /// timestamp, which a broker may still redeliver): such a partition is kept whole.
    /// The check runs after the detach, in the same transaction, so no claim can slip in
    /// between. In a dry run nothing is detached.
    pub(crate) async fn drop_old_partitions(
        &self,
        cutoff_secs: f64,
        dry_run: bool,
    ) -> Result<DroppedPartitions, PgError> {
        let (year, month): (i32, i32) = sqlx::query_as(
            "SELECT extract(year FROM (to_timestamp($1) - interval '1 day') AT TIME ZONE 'UTC')::int, \
                    extract(month FROM (to_timestamp($1) - interval '1 day') AT TIME ZONE 'UTC')::int",
        )
        .bind(cutoff_secs)
        .fetch_one(self.pool())
        .await
        .map_err(|e| map_sqlx(e, "compute the cutoff month"))?;
        let mut out = DroppedPartitions::default();
        let Some(cutoff_month) = PartitionMonth::new(year, month.unsigned_abs()) else {
            // A cutoff before year 1: nothing is that old.
            return Ok(out);
        };
        let pm = self.sql_table("processed_messages");
        for m in self.partitions().await? {
            if m >= cutoff_month {
                break;
            }
            let name = m.partition_name();
            let part = self.shared().table_ident(&m.partition_ident()?);
            // The newest claim, read from the end of the partition's `claimed_at` index
            // (one index probe whatever the partition's size; an `EXISTS … WHERE
            // claimed_at >= …` on a freshly detached partition without statistics was
            // planned as a scan of every row: 70 ms per 250,000 rows).
            let late_sql = sql!(
                "SELECT coalesce(max(claimed_at) >= to_timestamp($1), false) FROM {part}",
                part
            );
            let estimate_sql =
                "SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass($1)";
            let mut tx = self
                .begin_with(
                    sqlx::query("SELECT set_config('lock_timeout', '2s', true)"),
                    "begin partition drop",
                    "set lock timeout",
                )
                .await?;
            if !dry_run {
                tx.execute(statement(sql!(
                    "ALTER TABLE {pm} DETACH PARTITION {part}",
                    pm,
                    part
                )))
                .await
                .map_err(|e| map_sqlx(e, "detach partition"))?;
            }
            let late: bool = sqlx::query_scalar(statement(late_sql))
                .bind(cutoff_secs)
                .fetch_one(&mut *tx)
                .await
                .map_err(|e| map_sqlx(e, "check partition for late claims"))?;
            if late {
                let _ = tx.rollback().await;
                tracing::warn!(
                    target: "idem::retention",
                    schema = self.schema(),
                    partition = %name,
                    "partition kept: it holds claims made after the cutoff"
                );
                out.kept.push(name);
                continue;
            }
            let rows: i64 = sqlx::query_scalar(estimate_sql)
                .bind(part.as_str())
                .fetch_one(&mut *tx)
                .await
                .map_err(|e| map_sqlx(e, "estimate partition rows"))?;
            if dry_run {
                let _ = tx.rollback().await;
            } else {
                tx.execute(statement(sql!("DROP TABLE {part}", part)))
                    .await
                    .map_err(|e| map_sqlx(e, "drop partition"))?;
                tx.commit()
                    .await
                    .map_err(|e| map_sqlx(e, "commit partition drop"))?;
            }
            out.rows_estimate += rows.unsigned_abs();
            out.dropped.push(name);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn months_are_read_as_written() {
        let m = |s| PartitionMonth::of_timestamp(s).map(|m| m.to_string());
        assert_eq!(m("2026-07-01T09:00:00Z").as_deref(), Some("2026-07"));
        assert_eq!(m("2026-07-31T23:30:00-05:00").as_deref(), Some("2026-07"));
        assert_eq!(m("2026-12-01").as_deref(), Some("2026-12"));
        assert_eq!(m("2026-12-01 10:00").as_deref(), Some("2026-12"));
        assert_eq!(m("0001-01-01T00:00:00Z").as_deref(), Some("0001-01"));
        for bad in [
            "",
            "2026",
            "2026-07",
            "2026-7-01T",
            "2026-00-01",
            "2026-13-01",
            "2026-07-00",
            "2026-07-32",
            "0000-01-01",
            "2026/07/01",
            "2026-07-01X",
            "+2026-07-01",
            "١٢٣٤-07-01",
        ] {
            assert_eq!(m(bad), None, "{bad:?}");
        }
        assert_eq!(month_value(Some("2026-07-01T09:00:00Z")), "2026-07-01");
        assert_eq!(month_value(Some("soon")), UNPARSED_MONTH);
        assert_eq!(month_value(None), UNPARSED_MONTH);
    }

    #[test]
    fn month_arithmetic_and_names() {
        let m = PartitionMonth::new(2026, 12).expect("month");
        assert_eq!(m.plus(1).map(|n| n.to_string()).as_deref(), Some("2027-01"));
        assert_eq!(
            m.plus(-12).map(|n| n.to_string()).as_deref(),
            Some("2025-12")
        );
        assert_eq!(m.first_day_sql().as_str(), "make_date(2026, 12, 1)");
        assert_eq!(m.end_day_sql().as_str(), "make_date(2027, 1, 1)");
        assert_eq!(
            m.partition_ident().map(|i| i.quoted()).ok().as_deref(),
            Some("\"processed_messages_p202612\"")
        );
        assert_eq!(
            PartitionMonth::from_partition_name(&m.partition_name()),
            Some(m)
        );
        assert_eq!(
            PartitionMonth::from_partition_name("processed_messages_default"),
            None
        );
        assert_eq!(
            PartitionMonth::from_partition_name("processed_messages_p20261"),
            None
        );
        assert_eq!(PartitionMonth::new(10_000, 1), None);
        assert_eq!(PartitionMonth::new(2026, 0), None);
        assert_eq!(PartitionMonth::new(9999, 12).and_then(|m| m.plus(1)), None);
    }
}
