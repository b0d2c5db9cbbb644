//! The audit record every SQL store reads back the same way: a dedup record (a claim)
//! with the outbox events its submission caused ([`ClaimRecord`], [`OutboxRecord`]), the
//! point in time they carry ([`Timestamp`]), and what an export wrote
//! ([`AuditSummary`]). Plain data, no driver: `idem-store-postgres` and
//! `idem-store-sqlite` return these from `inspect_key`, `inspect_subject` and
//! `export_audit`, so a tool over either store handles one shape.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jiff::civil::{Date, DateTime, Time};
use jiff::SignedDuration;

use crate::error::StoreError;
use crate::ident::{Ident, InvalidIdent};

/// A point in time, UTC, in microseconds since the Unix epoch. `Display` is RFC 3339
/// with microseconds, e.g. `2026-07-01T09:00:00.000000Z` (the calendar is `jiff`'s; an
/// instant beyond its years -9999 to 9999 shows as the nearest end of that range).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp {
    unix_micros: i64,
}

impl Timestamp {
    /// From microseconds since the Unix epoch.
    pub const fn from_unix_micros(unix_micros: i64) -> Self {
        Self { unix_micros }
    }

    /// Microseconds since the Unix epoch.
    pub const fn unix_micros(self) -> i64 {
        self.unix_micros
    }

    /// Now, from the system clock.
    pub fn now() -> Self {
        let micros = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
        Self::from_unix_micros(micros)
    }

    /// As a [`SystemTime`].
    pub fn to_system_time(self) -> SystemTime {
        let abs = Duration::from_micros(self.unix_micros.unsigned_abs());
        if self.unix_micros >= 0 {
            UNIX_EPOCH + abs
        } else {
            UNIX_EPOCH - abs
        }
    }

    /// The UTC calendar date, `(year, month, day)`.
    pub fn date(self) -> (i64, u32, u32) {
        let d = self.civil().date();
        (
            i64::from(d.year()),
            d.month().unsigned_abs().into(),
            d.day().unsigned_abs().into(),
        )
    }

    /// The UTC calendar date as `YYYY-MM-DD`, the name of its day in the outcome tally
    /// and in the audit report.
    ///
    /// ```
    /// use idem_core::record::Timestamp;
    /// let t = Timestamp::parse_rfc3339("2026-07-01T01:30:00+02:00").unwrap();
    /// assert_eq!(t.day(), "2026-06-30");
    /// ```
    pub fn day(self) -> String {
        self.civil().date().to_string()
    }

    /// The start (00:00:00Z) of the UTC day holding this instant.
    pub fn start_of_day(self) -> Self {
        Self::from_unix_micros(self.unix_micros.div_euclid(MICROS_PER_DAY) * MICROS_PER_DAY)
    }

    /// The UTC civil date and time, held to `jiff`'s range (years -9999 to 9999: all
    /// that RFC 3339's four-digit years can write, and more).
    fn civil(self) -> DateTime {
        EPOCH.saturating_add(SignedDuration::from_micros(self.unix_micros))
    }

    /// Parses RFC 3339 (`2026-07-01T09:00:00Z`, `…T09:00:00.123456+02:00`, a space or
    /// `t` for `T`, `z` for `Z`), or a bare date `2026-07-01` (its midnight UTC).
    /// Fractions beyond microseconds are truncated; a leap second (`:60`) is the next
    /// minute's first. The shape is checked here (stricter than `jiff`'s own parser,
    /// which also takes `+0200`, `T09` or a bracketed zone); dates and calendar
    /// arithmetic are `jiff`'s.
    ///
    /// ```
    /// use idem_core::record::Timestamp;
    /// let t = Timestamp::parse_rfc3339("2026-07-01T11:00:00.5+02:00").unwrap();
    /// assert_eq!(t.to_string(), "2026-07-01T09:00:00.500000Z");
    /// assert_eq!(Timestamp::parse_rfc3339("2026-07-01").unwrap().to_string(), "2026-07-01T00:00:00.000000Z");
    /// assert!(Timestamp::parse_rfc3339("2026-02-30T00:00:00Z").is_none());
    /// ```
    pub fn parse_rfc3339(s: &str) -> Option<Self> {
        let b = s.as_bytes();
        let num = |r: std::ops::Range<usize>| -> Option<i16> {
            let part = b.get(r)?;
            if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
                return None;
            }
            std::str::from_utf8(part).ok()?.parse().ok()
        };
        let two = |r: std::ops::Range<usize>| num(r).and_then(|n| i8::try_from(n).ok());
        if b.len() < 10 || b[4] != b'-' || b[7] != b'-' {
            return None;
        }
        let date = Date::new(num(0..4)?, two(5..7)?, two(8..10)?).ok()?;
        if b.len() == 10 {
            return Self::from_civil(date.to_datetime(Time::midnight()), 0);
        }
        if b.len() < 20 || !matches!(b[10], b'T' | b't' | b' ') || b[13] != b':' || b[16] != b':' {
            return None;
        }
        let (hh, mm, ss) = (two(11..13)?, two(14..16)?, two(17..19)?);
        // A leap second is accepted as 59 plus one second.
        let leap = i8::from(ss == 60);
        let time = Time::new(hh, mm, ss - leap, 0).ok()?;
        let mut i = 19;
        let mut micros = 0i64;
        if b[i] == b'.' {
            i += 1;
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            if i == start {
                return None;
            }
            let frac = &s[start..i.min(start + 6)];
            micros = frac.parse::<i64>().ok()? * 10i64.pow(6 - frac.len() as u32);
        }
        let offset_secs = match &b[i..] {
            [b'Z' | b'z'] => 0,
            [sign @ (b'+' | b'-'), _, _, b':', _, _] => {
                let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
                if oh > 23 || om > 59 {
                    return None;
                }
                let o = i64::from(oh) * 3600 + i64::from(om) * 60;
                if *sign == b'+' {
                    o
                } else {
                    -o
                }
            }
            _ => return None,
        };
        let t = Self::from_civil(date.to_datetime(time), i64::from(leap) - offset_secs)?;
        Some(Self::from_unix_micros(t.unix_micros + micros))
    }

    /// The same UTC civil time `years` calendar years earlier (a 29 February goes to the
    /// 28th in a year without one, as Postgres and SQLite count); the earliest instant
    /// when that is out of range.
    pub fn years_earlier(self, years: u32) -> Self {
        self.civil()
            .checked_sub(jiff::Span::new().years(i64::from(years)))
            .ok()
            .and_then(|dt| Self::from_civil(dt, 0))
            .unwrap_or(Self::from_unix_micros(i64::MIN))
    }

    /// The instant of the UTC civil time `dt`, plus `secs` seconds.
    fn from_civil(dt: DateTime, secs: i64) -> Option<Self> {
        let since_epoch = dt.duration_since(EPOCH) + SignedDuration::from_secs(secs);
        i64::try_from(since_epoch.as_micros())
            .ok()
            .map(Self::from_unix_micros)
    }
}

/// Microseconds in a UTC day (Unix time has no leap seconds).
const MICROS_PER_DAY: i64 = 86_400_000_000;

/// The Unix epoch as a UTC civil time.
const EPOCH: DateTime = jiff::civil::datetime(1970, 1, 1, 0, 0, 0, 0);

impl fmt::Display for Timestamp {
    /// RFC 3339, UTC, microseconds: `2026-07-01T09:00:00.000000Z`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.6}Z", self.civil())
    }
}

/// One outbox row of a dedup record (never its payload).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxRecord {
    /// The row id (publication order).
    pub id: i64,
    /// The deterministic event id (64 hex), if the row has one.
    pub event_id: Option<String>,
    /// The event type, e.g. `disbursement.recorded`.
    pub event_type: String,
    /// The subject (award id).
    pub subject: Option<String>,
    /// When the event was written.
    pub created_at: Option<Timestamp>,
    /// When the relay marked it published (`None`: not yet).
    pub published_at: Option<Timestamp>,
}

impl OutboxRecord {
    /// An outbox row as a store read it.
    pub fn new(
        id: i64,
        event_id: Option<String>,
        event_type: String,
        subject: Option<String>,
        created_at: Option<Timestamp>,
        published_at: Option<Timestamp>,
    ) -> Self {
        Self {
            id,
            event_id,
            event_type,
            subject,
            created_at,
            published_at,
        }
    }
}

/// A dedup record and the outbox events its submission caused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimRecord {
    /// The idempotency key as stored (64 hex for keys written by idem).
    pub key: String,
    /// The award (subject) id stored with the claim.
    pub award_id: Option<String>,
    /// When the claim was made.
    pub claimed_at: Option<Timestamp>,
    /// The outbox events written under this key, in id order.
    pub events: Vec<OutboxRecord>,
}

impl ClaimRecord {
    /// A dedup record as a store read it, with no events yet.
    pub fn new(key: String, award_id: Option<String>, claimed_at: Option<Timestamp>) -> Self {
        Self {
            key,
            award_id,
            claimed_at,
            events: Vec::new(),
        }
    }
}

/// What an `export_audit` wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct AuditSummary {
    /// Dedup records (claims) exported.
    pub claims: u64,
    /// Outbox events exported with them.
    pub events: u64,
    /// Pages (claim queries) run.
    pub pages: u64,
}

/// A business table reconciled against the claims by [`AuditStats`]: its rows carry the
/// idempotency key that caused them, an amount and a subject (for the grant pipeline:
/// `disbursements(award_id, amount_cents, idempotency_key)`). Names are checked to be
/// plain identifiers before they reach SQL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BusinessTable {
    /// The table.
    pub table: Ident,
    /// Its amount column (an integer).
    pub amount_column: Ident,
    /// Its subject column (award id).
    pub subject_column: Ident,
}

impl BusinessTable {
    /// A table with these columns (`idempotency_key` is always the key column).
    ///
    /// # Errors
    /// [`InvalidIdent`] for the first name that is not a plain identifier
    /// (`[A-Za-z_][A-Za-z0-9_]{0,62}`).
    pub fn new(
        table: &str,
        amount_column: &str,
        subject_column: &str,
    ) -> Result<Self, InvalidIdent> {
        Ok(Self {
            table: Ident::new(table)?,
            amount_column: Ident::new(amount_column)?,
            subject_column: Ident::new(subject_column)?,
        })
    }

    /// The grant pipeline's `disbursements(award_id, amount_cents, idempotency_key)`.
    pub fn disbursements() -> Self {
        Self {
            table: Ident::from_static("disbursements"),
            amount_column: Ident::from_static("amount_cents"),
            subject_column: Ident::from_static("award_id"),
        }
    }
}

/// What one UTC day of an audit window holds in the store.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DayCounts {
    /// The day, `YYYY-MM-DD` (UTC).
    pub day: String,
    /// Dedup records claimed that day (submissions processed).
    pub claims: u64,
    /// Outbox events written that day.
    pub events: u64,
    /// Outbox events published that day.
    pub published: u64,
}

impl DayCounts {
    /// One day's counts.
    pub fn new(day: String, claims: u64, events: u64, published: u64) -> Self {
        Self {
            day,
            claims,
            events,
            published,
        }
    }
}

/// The claims of a window recounted against the business table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Reconciliation {
    /// Dedup records claimed in the window.
    pub claims: u64,
    /// Business rows whose key is one of those claims.
    pub rows: u64,
    /// The sum of their amounts.
    pub amount_total: i64,
    /// Claims of the window with no business row.
    pub claims_without_row: u64,
    /// Claims of the window with more than one business row.
    pub claims_with_several_rows: u64,
    /// Business rows (any time) whose key has no dedup record (purged or never claimed).
    pub rows_without_claim: u64,
    /// Subjects (award ids) with more than one business row among the window's claims.
    pub subjects_with_several_rows: u64,
}

impl Reconciliation {
    /// Whether the business table and the claims agree: one row per claim, none without
    /// a claim.
    pub fn agrees(&self) -> bool {
        self.claims == self.rows
            && self.claims_without_row == 0
            && self.claims_with_several_rows == 0
            && self.rows_without_claim == 0
    }
}

/// Retention as the store stands.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RetentionStatus {
    /// The oldest dedup record's claim time (`None`: no records).
    pub oldest_claim: Option<Timestamp>,
    /// Dedup records in the store, all time.
    pub all_claims: u64,
    /// The cutoff the counts below are for (records older than it).
    pub cutoff: Option<Timestamp>,
    /// Dedup records a purge at the cutoff would remove.
    pub purgeable_claims: u64,
    /// Published outbox events a purge at the cutoff would remove.
    pub purgeable_events: u64,
}

/// How many deliveries of one UTC day ended with one outcome (and, for a dead letter, one
/// reason code): a row of a store's outcome tally (`idem_outcome_counts`), written by
/// `OutcomeTally` flushes and read back by `audit_stats`.
///
/// These are operational counts, not evidence: see [`crate::tally`] for what they are
/// exact about and what they are not.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub struct OutcomeCount {
    /// The UTC day, `YYYY-MM-DD`.
    pub day: String,
    /// The outcome ([`OutcomeKind::as_str`](crate::OutcomeKind::as_str): `processed`,
    /// `duplicate`, `conflict`, `rejected`, `deferred`, `failed`).
    pub outcome: String,
    /// The dead-letter reason code (`not_json`, `attempts_exhausted`, `conflict`, …) of a
    /// `rejected` or `conflict` outcome; empty for the others.
    pub reason: String,
    /// How many.
    pub count: u64,
}

impl OutcomeCount {
    /// One count.
    pub fn new(
        day: impl Into<String>,
        outcome: impl Into<String>,
        reason: impl Into<String>,
        count: u64,
    ) -> Self {
        Self {
            day: day.into(),
            outcome: outcome.into(),
            reason: reason.into(),
            count,
        }
    }

    /// Whether the delivery counted was dead-lettered (`rejected` or `conflict`).
    pub fn is_dead_letter(&self) -> bool {
        self.outcome == "rejected" || self.outcome == "conflict"
    }

    /// The count as a store writes it (a signed 64-bit integer).
    ///
    /// # Errors
    /// [`StoreError::Config`] for a count above `i64::MAX`.
    pub fn stored_count(&self) -> Result<i64, StoreError> {
        i64::try_from(self.count).map_err(|_| {
            StoreError::Config(format!("an outcome count of {} is too large", self.count))
        })
    }
}

/// A store's identity as last read (`idem_store_identity`): a random id created by the
/// store's `migrate`, and a session counter. A front filter scopes its marks to the id;
/// `idem-store-postgres` and `idem-store-sqlite` return it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreIdentity {
    /// 32 lowercase hex characters, random, unique per store (a Postgres schema, an
    /// SQLite database file) unless the store was copied.
    pub store_id: String,
    /// The session counter.
    pub session: i64,
}

impl StoreIdentity {
    /// The identity `store_id` at session `session`.
    pub fn new(store_id: impl Into<String>, session: i64) -> Self {
        Self {
            store_id: store_id.into(),
            session,
        }
    }

    /// The error of a store whose identity table has no row: [`StoreError::Config`],
    /// telling to run `idem migrate`.
    pub fn missing() -> StoreError {
        StoreError::Config(
            "the store has no identity row (idem_store_identity): run `idem migrate`".into(),
        )
    }
}

/// What an audit report shows of a window, read by a store's `audit_stats`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct AuditStats {
    /// Per UTC day with any activity, in order.
    pub days: Vec<DayCounts>,
    /// The outcome tally of every UTC day that overlaps the window (whole days), ordered
    /// by day, outcome and reason; `None` when the store has no outcome table (a database
    /// not migrated since it was added).
    pub outcomes: Option<Vec<OutcomeCount>>,
    /// Outbox events written in the window and not yet published.
    pub unpublished: u64,
    /// The claims recounted against the business table.
    pub reconciliation: Reconciliation,
    /// Retention.
    pub retention: RetentionStatus,
    /// A sample of the window's dedup records (spread by key), with their events.
    pub sample: Vec<ClaimRecord>,
}

#[cfg(test)]
mod tests {
    use super::Timestamp;

    /// The hand-written calendar `jiff` replaced (Howard Hinnant's civil_from_days), kept
    /// here as the oracle the stored text must stay byte-identical to.
    fn reference(unix_micros: i64) -> String {
        let micros = unix_micros.rem_euclid(1_000_000);
        let secs = unix_micros.div_euclid(1_000_000);
        let z = secs.div_euclid(86_400) + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        let sod = secs.rem_euclid(86_400);
        format!(
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
            sod / 3600,
            sod % 3600 / 60,
            sod % 60
        )
    }

    #[test]
    fn the_text_is_byte_identical_to_the_hand_written_calendar_for_years_0_to_9999() {
        let first = -62_167_219_200_000_000i64; // 0000-01-01T00:00:00Z
        let last = 253_402_300_799_999_999i64; // 9999-12-31T23:59:59.999999Z
        assert_eq!(
            Timestamp::from_unix_micros(first).to_string(),
            "0000-01-01T00:00:00.000000Z"
        );
        assert_eq!(
            Timestamp::from_unix_micros(last).to_string(),
            "9999-12-31T23:59:59.999999Z"
        );
        // Every 13th day (all weekdays, months and leap rules), at a time of day that moves.
        let step = 13 * 86_400_000_000 + 3_723_456_789;
        let mut micros = first;
        let mut n = 0;
        while micros <= last {
            let t = Timestamp::from_unix_micros(micros);
            let text = t.to_string();
            assert_eq!(text, reference(micros));
            assert_eq!(Timestamp::parse_rfc3339(&text), Some(t), "{text}");
            assert_eq!(t.day(), text[..10]);
            let (y, m, d) = t.date();
            assert_eq!(format!("{y:04}-{m:02}-{d:02}"), text[..10]);
            micros += step;
            n += 1;
        }
        assert!(n > 280_000, "{n}");
    }

    #[test]
    fn leap_seconds_offsets_and_fractions_parse_as_before() {
        let p = |s| Timestamp::parse_rfc3339(s).map(|t| t.to_string());
        assert_eq!(
            p("2016-12-31T23:59:60Z").as_deref(),
            Some("2017-01-01T00:00:00.000000Z")
        );
        assert_eq!(
            p("0000-01-01T00:30:00+01:00").as_deref(),
            Some("-000001-12-31T23:30:00.000000Z")
        );
        assert_eq!(
            p("9999-12-31T23:59:59.123456789z").as_deref(),
            Some("9999-12-31T23:59:59.123456Z")
        );
        assert_eq!(
            p("9999-12-31").as_deref(),
            Some("9999-12-31T00:00:00.000000Z")
        );
        assert_eq!(
            p("2026-07-01t09:00:00.1-23:59").as_deref(),
            Some("2026-07-02T08:59:00.100000Z")
        );
        for bad in [
            "2026-07-01T09:00:00+24:00",
            "2026-07-01T09:00:61Z",
            "2026-07-01T09:60:00Z",
            "2026-07-01T09:00:00+02",
            "2026-07-01T09:00Z",
            "2026-07-01T09:00:00Z[UTC]",
            "+02026-07-01T09:00:00Z",
            "2026-7-01",
            "2026-07-01T09:00:00,5Z",
        ] {
            assert_eq!(Timestamp::parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn timestamps_render_as_rfc3339() {
        assert_eq!(
            Timestamp::from_unix_micros(0).to_string(),
            "1970-01-01T00:00:00.000000Z"
        );
        assert_eq!(
            Timestamp::from_unix_micros(1_782_896_400_123_456).to_string(),
            "2026-07-01T09:00:00.123456Z"
        );
        assert_eq!(
            Timestamp::from_unix_micros(-1).to_string(),
            "1969-12-31T23:59:59.999999Z"
        );
    }

    #[test]
    fn rfc3339_parses_back_what_display_writes() {
        for micros in [
            0,
            1_782_896_400_123_456,
            -1,
            951_782_400_000_000,
            4_107_542_399_999_999,
        ] {
            let t = Timestamp::from_unix_micros(micros);
            assert_eq!(Timestamp::parse_rfc3339(&t.to_string()), Some(t), "{t}");
        }
        assert_eq!(
            Timestamp::parse_rfc3339("2026-07-01 09:00:00.123Z").map(|t| t.to_string()),
            Some("2026-07-01T09:00:00.123000Z".into())
        );
        assert_eq!(
            Timestamp::parse_rfc3339("2026-07-01T04:00:00-05:00").map(|t| t.to_string()),
            Some("2026-07-01T09:00:00.000000Z".into())
        );
        assert_eq!(
            Timestamp::parse_rfc3339("2024-02-29").map(|t| t.date()),
            Some((2024, 2, 29))
        );
        for bad in [
            "",
            "yesterday",
            "2026-13-01T09:00:00Z",
            "2026-07-01T09:00:00",
            "2026-07-01T09:00:00.Z",
            "2026-07-01T25:00:00Z",
            "2026-07-01T09:00:00+0200",
            "2025-02-29",
            "2026-07-32",
        ] {
            assert_eq!(Timestamp::parse_rfc3339(bad), None, "{bad}");
        }
    }
}
