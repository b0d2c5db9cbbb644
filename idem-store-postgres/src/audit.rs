//! The audit trail as evidence: [`PgStore::export_audit`] streams the dedup records
//! claimed in a time window, each with its outbox events, in `claimed_at` order and in
//! bounded pages (keyset pagination: never the whole window in memory).

use sqlx::Row;

use crate::error::{map_sqlx, sqlstate, PgError};
use crate::inspect::{ClaimRecord, OutboxRecord, Timestamp};
use crate::store::PgStore;

/// Microseconds since the epoch of a `timestamptz` column, exact (`extract` returns
/// `numeric` on Postgres 14 and later).
fn micros(col: &str) -> String {
    format!("(extract(epoch FROM {col}) * 1000000)::bigint")
}

/// What [`PgStore::export_audit`] wrote.
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

impl PgStore {
    /// Streams every dedup record with `since <= claimed_at < until` to `sink`, oldest
    /// first (ties by key), each with its outbox events in id order, `page_size` claims
    /// per query. `since` and `until` are passed to the server as `$n::timestamptz`
    /// (RFC 3339, e.g. `2026-07-01T00:00:00Z`). Records without a `claimed_at` are not
    /// in any window. Payloads are not read.
    ///
    /// Pages are separate statements: a claim committed during the export with a
    /// `claimed_at` before the cursor is not seen (export a window that has closed).
    ///
    /// # Errors
    /// [`PgError::InvalidTimestamp`] when the server rejects `since` or `until`;
    /// [`PgError::Sink`] when `sink` fails (the export stops there);
    /// [`PgError::Store`] from the database.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_store_postgres::PgStore) -> Result<(), idem_store_postgres::PgError> {
    /// let summary = store
    ///     .export_audit("2026-07-01T00:00:00Z", "2026-08-01T00:00:00Z", 500, |r| {
    ///         println!("{} {:?} {}", r.key, r.award_id, r.events.len());
    ///         Ok(())
    ///     })
    ///     .await?;
    /// eprintln!("{} claims", summary.claims);
    /// # Ok(()) }
    /// ```
    pub async fn export_audit(
        &self,
        since: &str,
        until: &str,
        page_size: usize,
        mut sink: impl FnMut(&ClaimRecord) -> std::io::Result<()>,
    ) -> Result<AuditSummary, PgError> {
        let limit = i64::try_from(page_size.max(1)).unwrap_or(i64::MAX);
        let pm = self.table("processed_messages");
        let ob = self.table("outbox");
        // The cursor is (claimed_at in microseconds, key) of the last exported record.
        let claims_sql = format!(
            "SELECT idempotency_key, award_id, {m} FROM {pm} \
             WHERE claimed_at >= $1::timestamptz AND claimed_at < $2::timestamptz \
               AND ($3::bigint IS NULL OR (claimed_at, idempotency_key) > \
                    (to_timestamp(0) + $3::bigint * interval '1 microsecond', $4::text)) \
             ORDER BY claimed_at, idempotency_key LIMIT $5",
            m = micros("claimed_at"),
        );
        let events_sql = format!(
            "SELECT id, event_id, event_type, subject, idempotency_key, {}, {} FROM {ob} \
             WHERE idempotency_key = ANY($1::text[]) ORDER BY id",
            micros("created_at"),
            micros("published_at"),
        );
        // The bounds first, on their own: a bad one is the caller's error, whatever the
        // state of the tables.
        sqlx::query("SELECT $1::timestamptz, $2::timestamptz")
            .bind(since)
            .bind(until)
            .execute(self.pool())
            .await
            .map_err(|e| timestamp_error(e, since, until))?;
        let mut summary = AuditSummary::default();
        let mut cursor: Option<(i64, String)> = None;
        loop {
            let rows = sqlx::query(&claims_sql)
                .bind(since)
                .bind(until)
                .bind(cursor.as_ref().map(|c| c.0))
                .bind(cursor.as_ref().map(|c| c.1.as_str()))
                .bind(limit)
                .fetch_all(self.pool())
                .await
                .map_err(|e| map_sqlx(e, "export dedup records"))?;
            summary.pages += 1;
            let full = i64::try_from(rows.len()).unwrap_or(i64::MAX) >= limit;
            let mut records = Vec::with_capacity(rows.len());
            for row in rows {
                let micros: Option<i64> = row.try_get(2)?;
                records.push(ClaimRecord {
                    key: row.try_get(0)?,
                    award_id: row.try_get(1)?,
                    claimed_at: micros.map(Timestamp::from_unix_micros),
                    events: Vec::new(),
                });
            }
            let Some(last) = records.last() else { break };
            cursor = Some((
                last.claimed_at.map_or(0, Timestamp::unix_micros),
                last.key.clone(),
            ));
            let keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
            let rows = sqlx::query(&events_sql)
                .bind(&keys)
                .fetch_all(self.pool())
                .await
                .map_err(|e| map_sqlx(e, "export outbox events"))?;
            let index: std::collections::HashMap<String, usize> = records
                .iter()
                .enumerate()
                .map(|(i, r)| (r.key.clone(), i))
                .collect();
            for row in rows {
                let key: String = row.try_get(4)?;
                let created: Option<i64> = row.try_get(5)?;
                let published: Option<i64> = row.try_get(6)?;
                let ev = OutboxRecord {
                    id: row.try_get(0)?,
                    event_id: row.try_get(1)?,
                    event_type: row.try_get(2)?,
                    subject: row.try_get(3)?,
                    created_at: created.map(Timestamp::from_unix_micros),
                    published_at: published.map(Timestamp::from_unix_micros),
                };
                if let Some(&i) = index.get(&key) {
                    records[i].events.push(ev);
                }
            }
            for r in &records {
                sink(r).map_err(PgError::Sink)?;
                summary.claims += 1;
                summary.events += r.events.len() as u64;
            }
            if !full {
                break;
            }
        }
        Ok(summary)
    }
}

/// A data exception (SQLSTATE class 22) on the window's bounds is the caller's bad
/// timestamp; anything else is a store error.
fn timestamp_error(e: sqlx::Error, since: &str, until: &str) -> PgError {
    match sqlstate(&e) {
        Some(code) if code.starts_with("22") => {
            let reason = match &e {
                sqlx::Error::Database(d) => d.message().to_owned(),
                other => other.to_string(),
            };
            // The server's message quotes the bad value; name the likelier one.
            let value = if reason.contains(since) && !since.is_empty() {
                since
            } else if reason.contains(until) && !until.is_empty() {
                until
            } else {
                since
            };
            PgError::InvalidTimestamp {
                value: value.chars().take(80).collect(),
                reason,
            }
        }
        _ => PgError::Store(map_sqlx(e, "export dedup records")),
    }
}
