//! Inspection: "was this award / key processed, when, under which key, which outbox
//! events" ([`PgStore::inspect_key`], [`PgStore::inspect_subject`]).

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::IdempotencyKey;
use sqlx::Row;

use crate::error::{map_sqlx, PgError};
use crate::store::PgStore;

/// A point in time as Postgres stored it (microseconds since the Unix epoch, UTC).
/// `Display` is RFC 3339 with microseconds, e.g. `2026-07-01T09:00:00.000000Z`.
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

    /// As a [`SystemTime`].
    pub fn to_system_time(self) -> SystemTime {
        let abs = Duration::from_micros(self.unix_micros.unsigned_abs());
        if self.unix_micros >= 0 {
            UNIX_EPOCH + abs
        } else {
            UNIX_EPOCH - abs
        }
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let micros = self.unix_micros.rem_euclid(1_000_000);
        let secs = self.unix_micros.div_euclid(1_000_000);
        let days = secs.div_euclid(86_400);
        let sod = secs.rem_euclid(86_400);
        // Howard Hinnant's civil_from_days.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
            sod / 3600,
            sod % 3600 / 60,
            sod % 60
        )
    }
}

/// One outbox row, as [`PgStore::inspect_key`] shows it (never the payload).
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

/// A dedup record and the outbox events its submission caused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimRecord {
    /// The idempotency key as stored (64 hex for keys written by idem).
    pub key: String,
    /// The award (subject) id stored with the claim.
    pub award_id: Option<String>,
    /// When the claim was made (the transaction's start time).
    pub claimed_at: Option<Timestamp>,
    /// The outbox events written under this key, in id order.
    pub events: Vec<OutboxRecord>,
}

fn ts(micros: Option<i64>) -> Option<Timestamp> {
    micros.map(Timestamp::from_unix_micros)
}

const MICROS: &str = "(extract(epoch FROM {c}) * 1000000)::bigint";

fn micros(col: &str) -> String {
    MICROS.replace("{c}", col)
}

impl PgStore {
    /// The dedup record of `key` with its outbox events, or `None` if `key` was never
    /// claimed (or its record was purged).
    ///
    /// # Errors
    /// [`PgError::Store`] from the database.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_store_postgres::PgStore, key: idem_core::IdempotencyKey) -> Result<(), idem_store_postgres::PgError> {
    /// match store.inspect_key(&key).await? {
    ///     Some(r) => println!("claimed at {:?} for {:?}, {} events", r.claimed_at.map(|t| t.to_string()), r.award_id, r.events.len()),
    ///     None => println!("never processed"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn inspect_key(&self, key: &IdempotencyKey) -> Result<Option<ClaimRecord>, PgError> {
        let mut records = self.records("idempotency_key = $1", &key.to_hex()).await?;
        Ok(records.pop())
    }

    /// Every dedup record of `subject` (an award id), oldest first, each with its outbox
    /// events.
    ///
    /// # Errors
    /// [`PgError::Store`] from the database.
    pub async fn inspect_subject(&self, subject: &str) -> Result<Vec<ClaimRecord>, PgError> {
        self.records("award_id = $1", subject).await
    }

    async fn records(&self, filter: &str, value: &str) -> Result<Vec<ClaimRecord>, PgError> {
        let sql = format!(
            "SELECT idempotency_key, award_id, {} FROM {} WHERE {filter} \
             ORDER BY claimed_at, idempotency_key",
            micros("claimed_at"),
            self.table("processed_messages")
        );
        let rows = sqlx::query(&sql)
            .bind(value)
            .fetch_all(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "inspect dedup records"))?;
        let mut records = Vec::with_capacity(rows.len());
        for row in rows {
            records.push(ClaimRecord {
                key: row.try_get(0)?,
                award_id: row.try_get(1)?,
                claimed_at: ts(row.try_get(2)?),
                events: Vec::new(),
            });
        }
        if records.is_empty() {
            return Ok(records);
        }
        let keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
        let sql = format!(
            "SELECT id, event_id, event_type, subject, idempotency_key, {}, {} FROM {} \
             WHERE idempotency_key = ANY($1::text[]) ORDER BY id",
            micros("created_at"),
            micros("published_at"),
            self.table("outbox")
        );
        let rows = sqlx::query(&sql)
            .bind(&keys)
            .fetch_all(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "inspect outbox events"))?;
        for row in rows {
            let key: String = row.try_get(4)?;
            let ev = OutboxRecord {
                id: row.try_get(0)?,
                event_id: row.try_get(1)?,
                event_type: row.try_get(2)?,
                subject: row.try_get(3)?,
                created_at: ts(row.try_get(5)?),
                published_at: ts(row.try_get(6)?),
            };
            if let Some(r) = records.iter_mut().find(|r| r.key == key) {
                r.events.push(ev);
            }
        }
        Ok(records)
    }
}

#[cfg(test)]
mod tests {
    use super::Timestamp;

    #[test]
    fn timestamps_render_as_rfc3339() {
        assert_eq!(
            Timestamp::from_unix_micros(0).to_string(),
            "1970-01-01T00:00:00.000000Z"
        );
        // 2026-07-01T09:00:00.123456Z
        assert_eq!(
            Timestamp::from_unix_micros(1_782_896_400_123_456).to_string(),
            "2026-07-01T09:00:00.123456Z"
        );
        assert_eq!(
            Timestamp::from_unix_micros(-1).to_string(),
            "1969-12-31T23:59:59.999999Z"
        );
    }
}
