//! The audit trail as evidence, as on Postgres: [`SqliteStore::export_audit`] streams
//! the dedup records claimed in a time window, each with its outbox events, in
//! `claimed_at` order (ties by key), in bounded pages, with the record type every SQL
//! store shares ([`idem_core::record::ClaimRecord`]).
//!
//! `claimed_at` is stored as UTC text `YYYY-MM-DDTHH:MM:SS.sssZ` (milliseconds), which
//! sorts as time does; the window's bounds are normalised to that form, and each page
//! after the first seeks the `claimed_at` index from the cursor with a row comparison
//! (`(claimed_at, idempotency_key) > (?, ?)`): the cost of a page does not grow with its
//! position.

use std::collections::HashMap;

use idem_core::record::{
    AuditStats, AuditSummary, BusinessTable, ClaimRecord, DayCounts, OutboxRecord, OutcomeCount,
    Timestamp,
};
use idem_core::tally::FlushId;
use idem_core::{OutcomeCountStore, StoreError};
use sqlx::Row;

use crate::error::{map, SqliteError};
use crate::store::SqliteStore;

/// `t` as the store writes it (`…SS.sssZ`), rounded up to the millisecond, so that
/// `stored >= bound` and `stored < bound` mean the same as on the exact instant.
pub(crate) fn stored_ceil(t: Timestamp) -> String {
    let micros = t.unix_micros();
    let ms = micros.div_euclid(1000) + i64::from(micros.rem_euclid(1000) != 0);
    let text = Timestamp::from_unix_micros(ms * 1000).to_string();
    // "…SS.mmm000Z" → "…SS.mmmZ"
    format!("{}Z", &text[..text.len() - 4])
}

/// A stored timestamp text as a [`Timestamp`] (`None` when it is not RFC 3339).
pub(crate) fn parse_stored(v: Option<String>) -> Option<Timestamp> {
    v.as_deref().and_then(Timestamp::parse_rfc3339)
}

/// A window bound given by the caller.
fn bound(name: &'static str, value: &str) -> Result<Timestamp, SqliteError> {
    Timestamp::parse_rfc3339(value).ok_or_else(|| SqliteError::timestamp(name, value))
}

impl SqliteStore {
    /// Streams every dedup record with `since <= claimed_at < until` to `sink`, oldest
    /// first (ties by key), each with its outbox events in id order, `page_size` claims
    /// per query — as `PgStore::export_audit` does. `since` and `until` are RFC 3339
    /// (`2026-07-01T00:00:00Z`) or a bare date. Payloads are not read.
    ///
    /// # Errors
    /// [`SqliteError::InvalidTimestamp`] for a bound that is not RFC 3339;
    /// [`SqliteError::Sink`] when `sink` fails (the export stops there);
    /// [`SqliteError::Store`] from the database.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_store_sqlite::SqliteStore) -> Result<(), idem_store_sqlite::SqliteError> {
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
    ) -> Result<AuditSummary, SqliteError> {
        let lo = stored_ceil(bound("since", since)?);
        let hi = stored_ceil(bound("until", until)?);
        let limit = i64::try_from(page_size.max(1)).unwrap_or(i64::MAX);
        let mut summary = AuditSummary::default();
        // (claimed_at as stored, key) of the last record exported.
        let mut cursor: Option<(String, String)> = None;
        loop {
            let query = match &cursor {
                None => sqlx::query(
                    "SELECT idempotency_key, award_id, claimed_at FROM processed_messages \
                     WHERE claimed_at >= ?1 AND claimed_at < ?2 \
                     ORDER BY claimed_at, idempotency_key LIMIT ?3",
                )
                .bind(&lo)
                .bind(&hi)
                .bind(limit),
                Some((at, key)) => sqlx::query(
                    "SELECT idempotency_key, award_id, claimed_at FROM processed_messages \
                     WHERE (claimed_at, idempotency_key) > (?1, ?2) AND claimed_at < ?3 \
                     ORDER BY claimed_at, idempotency_key LIMIT ?4",
                )
                .bind(at)
                .bind(key)
                .bind(&hi)
                .bind(limit),
            };
            let rows = query
                .fetch_all(self.pool())
                .await
                .map_err(|e| map("exporting dedup records", e))?;
            summary.pages += 1;
            let full = i64::try_from(rows.len()).unwrap_or(i64::MAX) >= limit;
            let mut page = Vec::with_capacity(rows.len());
            let mut last = None;
            for row in &rows {
                let key: String = row.get(0);
                let at: Option<String> = row.get(2);
                last = Some((at.clone().unwrap_or_default(), key.clone()));
                page.push(ClaimRecord::new(key, row.get(1), parse_stored(at)));
            }
            if page.is_empty() {
                break;
            }
            cursor = last;
            self.attach_events(&mut page).await?;
            for r in &page {
                sink(r).map_err(SqliteError::Sink)?;
                summary.claims += 1;
                summary.events += r.events.len() as u64;
            }
            if !full {
                break;
            }
        }
        Ok(summary)
    }

    /// The claims of `rows` (`idempotency_key, award_id, claimed_at`), in their order,
    /// each with its events.
    pub(crate) async fn claims_with_events(
        &self,
        rows: &[sqlx::sqlite::SqliteRow],
    ) -> Result<Vec<ClaimRecord>, StoreError> {
        let mut page: Vec<ClaimRecord> = rows
            .iter()
            .map(|r| ClaimRecord::new(r.get(0), r.get(1), parse_stored(r.get(2))))
            .collect();
        self.attach_events(&mut page).await?;
        Ok(page)
    }

    /// Fills each record's events (one query for the page, through the key index).
    pub(crate) async fn attach_events(&self, page: &mut [ClaimRecord]) -> Result<(), StoreError> {
        if page.is_empty() {
            return Ok(());
        }
        let keys: Vec<&str> = page.iter().map(|c| c.key.as_str()).collect();
        let keys = json(&keys)?;
        let rows = sqlx::query(
            "SELECT id, event_id, event_type, subject, idempotency_key, created_at, published_at \
             FROM outbox WHERE idempotency_key IN (SELECT value FROM json_each(?1)) ORDER BY id",
        )
        .bind(keys)
        .fetch_all(self.pool())
        .await
        .map_err(|e| map("exporting outbox events", e))?;
        let index: HashMap<String, usize> = page
            .iter()
            .enumerate()
            .map(|(i, c)| (c.key.clone(), i))
            .collect();
        for row in rows {
            let key: String = row.get(4);
            if let Some(&i) = index.get(&key) {
                page[i].events.push(OutboxRecord::new(
                    row.get(0),
                    row.get(1),
                    row.get(2),
                    row.get(3),
                    parse_stored(row.get(5)),
                    parse_stored(row.get(6)),
                ));
            }
        }
        Ok(())
    }
}

/// `v` as the JSON text of a statement parameter (read back with `json_each`).
fn json<T: serde::Serialize + ?Sized>(v: &T) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|e| StoreError::Other {
        message: "encoding a statement parameter as JSON".to_owned(),
        retryable: false,
        source: Some(e.into()),
    })
}

impl SqliteStore {
    /// What an audit report shows of the window `since <= t < until` (RFC 3339), as
    /// `PgStore::audit_stats` does: per UTC day the claims, outbox events written and
    /// published; the window's claims recounted against `business`; retention for a
    /// purge of what is older than `cutoff`; and `sample` dedup records (spread by key)
    /// with their events. Payloads are not read.
    ///
    /// # Errors
    /// [`SqliteError::InvalidTimestamp`] for a bad bound; [`SqliteError::Store`] from
    /// the database (a business table without the named columns included).
    pub async fn audit_stats(
        &self,
        since: &str,
        until: &str,
        business: &BusinessTable,
        cutoff: Timestamp,
        sample: usize,
    ) -> Result<AuditStats, SqliteError> {
        let lo = stored_ceil(bound("since", since)?);
        let hi = stored_ceil(bound("until", until)?);
        let (biz, amount, subject) = (
            &business.table,
            &business.amount_column,
            &business.subject_column,
        );
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        let mut stats = AuditStats::default();

        let rows = sqlx::query(
            "WITH c AS (SELECT substr(claimed_at, 1, 10) AS day, count(*) AS n FROM processed_messages \
                        WHERE claimed_at >= ?1 AND claimed_at < ?2 GROUP BY 1), \
                  e AS (SELECT substr(created_at, 1, 10) AS day, count(*) AS n FROM outbox \
                        WHERE created_at >= ?1 AND created_at < ?2 GROUP BY 1), \
                  p AS (SELECT substr(published_at, 1, 10) AS day, count(*) AS n FROM outbox \
                        WHERE published_at >= ?1 AND published_at < ?2 GROUP BY 1), \
                  d AS (SELECT day FROM c UNION SELECT day FROM e UNION SELECT day FROM p) \
             SELECT d.day, coalesce(c.n, 0), coalesce(e.n, 0), coalesce(p.n, 0) FROM d \
             LEFT JOIN c ON c.day = d.day LEFT JOIN e ON e.day = d.day LEFT JOIN p ON p.day = d.day \
             ORDER BY d.day",
        )
        .bind(&lo)
        .bind(&hi)
        .fetch_all(self.pool())
        .await
        .map_err(|e| map("audit stats per day", e))?;
        for r in rows {
            stats.days.push(DayCounts::new(
                r.get(0),
                n(r.get(1)),
                n(r.get(2)),
                n(r.get(3)),
            ));
        }
        let unpublished: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND created_at >= ?1 AND created_at < ?2",
        )
        .bind(&lo)
        .bind(&hi)
        .fetch_one(self.pool())
        .await
        .map_err(|e| map("audit stats unpublished", e))?;
        stats.unpublished = n(unpublished);

        let sql = idem_core::sql!(
            "WITH c AS (SELECT idempotency_key FROM processed_messages WHERE claimed_at >= ?1 AND claimed_at < ?2), \
                  d AS (SELECT b.idempotency_key AS k, count(*) AS n, sum(b.{amount}) AS s \
                        FROM {biz} b JOIN c ON c.idempotency_key = b.idempotency_key GROUP BY 1) \
             SELECT (SELECT count(*) FROM c), coalesce(sum(n), 0), \
                    CAST(round(coalesce(sum(s), 0)) AS INTEGER), \
                    (SELECT count(*) FROM c) - count(*), coalesce(sum(n > 1), 0), \
                    (SELECT count(*) FROM {biz} b WHERE NOT EXISTS \
                        (SELECT 1 FROM processed_messages p WHERE p.idempotency_key = b.idempotency_key)), \
                    (SELECT count(*) FROM (SELECT b.{subject} FROM {biz} b JOIN c ON c.idempotency_key = b.idempotency_key \
                        GROUP BY 1 HAVING count(*) > 1)) \
             FROM d",
            amount,
            biz,
            subject
        );
        let r = sqlx::query(crate::sql::statement(sql))
            .bind(&lo)
            .bind(&hi)
            .fetch_one(self.pool())
            .await
            .map_err(|e| map("reconciling claims with the business table", e))?;
        // The business table is the team's: a column of another type than expected is an
        // error naming it, never a panic.
        let get = |i: usize| {
            r.try_get::<i64, _>(i)
                .map_err(|e| map("reconciling claims with the business table", e))
        };
        let rec = &mut stats.reconciliation;
        rec.claims = n(get(0)?);
        rec.rows = n(get(1)?);
        rec.amount_total = get(2)?;
        rec.claims_without_row = n(get(3)?);
        rec.claims_with_several_rows = n(get(4)?);
        rec.rows_without_claim = n(get(5)?);
        rec.subjects_with_several_rows = n(get(6)?);

        let cut = stored_ceil(cutoff);
        let r = sqlx::query(
            "SELECT (SELECT min(claimed_at) FROM processed_messages), \
                    (SELECT count(*) FROM processed_messages), \
                    (SELECT count(*) FROM processed_messages WHERE claimed_at < ?1), \
                    (SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND created_at < ?1)",
        )
        .bind(&cut)
        .fetch_one(self.pool())
        .await
        .map_err(|e| map("retention status", e))?;
        let ret = &mut stats.retention;
        ret.oldest_claim = parse_stored(r.get(0));
        ret.all_claims = n(r.get(1));
        ret.cutoff = Some(cutoff);
        ret.purgeable_claims = n(r.get(2));
        ret.purgeable_events = n(r.get(3));

        stats.outcomes = self.outcome_counts(since, until).await?;

        if sample > 0 {
            // Keys are hashes: their order is a spread sample.
            let rows = sqlx::query(
                "SELECT idempotency_key, award_id, claimed_at FROM processed_messages \
                 WHERE claimed_at >= ?1 AND claimed_at < ?2 ORDER BY idempotency_key LIMIT ?3",
            )
            .bind(&lo)
            .bind(&hi)
            .bind(i64::try_from(sample).unwrap_or(i64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(|e| map("audit sample", e))?;
            stats.sample = self.claims_with_events(&rows).await?;
        }
        Ok(stats)
    }
}

impl SqliteStore {
    /// Adds `counts` to the outcome tally (`idem_outcome_counts`, created by
    /// [`migrate`](SqliteStore::migrate)) in one statement, as `PgStore::add_outcome_counts`
    /// does: `INSERT … ON CONFLICT (day, outcome, reason) DO UPDATE SET count = count +
    /// excluded.count`, the rows passed as one JSON parameter. Counts of one row given
    /// twice add up; so do concurrent calls. Days are `YYYY-MM-DD` (UTC). See
    /// [`idem_core::tally`] for what the counts mean. Each call adds: a tally's flushes,
    /// which may be sent again, go through
    /// [`add_outcome_counts_once`](SqliteStore::add_outcome_counts_once).
    ///
    /// # Errors
    /// A store error from the database (the table missing included); a count above
    /// `i64::MAX` or a day that is not `YYYY-MM-DD` is [`StoreError::Config`]. Nothing is
    /// added then.
    pub async fn add_outcome_counts(&self, counts: &[OutcomeCount]) -> Result<(), StoreError> {
        self.write_outcome_counts(None, counts).await
    }

    /// Adds `counts` as [`add_outcome_counts`](SqliteStore::add_outcome_counts) does, once
    /// per `flush` (the [`OutcomeCountStore`] contract): in one `BEGIN IMMEDIATE`
    /// transaction, the writer's row of `idem_outcome_flushes` is raised to the flush's
    /// sequence number, and the counts are added only if it was below. A flush dropped by
    /// its caller's timeout that the database still commits, and that is then sent again,
    /// adds once. The first flush of a writer also removes the rows of writers not heard
    /// from for 30 days.
    ///
    /// # Errors
    /// As [`add_outcome_counts`](SqliteStore::add_outcome_counts).
    pub async fn add_outcome_counts_once(
        &self,
        flush: &FlushId,
        counts: &[OutcomeCount],
    ) -> Result<(), StoreError> {
        self.write_outcome_counts(Some(flush), counts).await
    }

    async fn write_outcome_counts(
        &self,
        flush: Option<&FlushId>,
        counts: &[OutcomeCount],
    ) -> Result<(), StoreError> {
        if counts.is_empty() {
            return Ok(());
        }
        let mut rows = Vec::with_capacity(counts.len());
        for c in counts {
            let n = c.stored_count()?;
            // Days sort as text: keep them in one form.
            if c.day.len() != 10 || Timestamp::parse_rfc3339(&c.day).is_none() {
                return Err(StoreError::Config(format!(
                    "outcome count day {:?} is not YYYY-MM-DD",
                    c.day
                )));
            }
            rows.push((c.day.as_str(), c.outcome.as_str(), c.reason.as_str(), n));
        }
        let rows = json(&rows)?;
        let mut tx = self
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| map("adding outcome counts", e))?;
        if let Some(f) = flush {
            let seq = f.stored_seq()?;
            if seq == 1 {
                sqlx::query(
                    "DELETE FROM idem_outcome_flushes \
                     WHERE flushed_at < strftime('%Y-%m-%dT%H:%M:%SZ', 'now', '-30 days')",
                )
                .execute(&mut *tx)
                .await
                .map_err(|e| map("removing old outcome flushes", e))?;
            }
            let raised = sqlx::query(
                "INSERT INTO idem_outcome_flushes (writer, seq, flushed_at) \
                 VALUES (?1, ?2, strftime('%Y-%m-%dT%H:%M:%SZ', 'now')) \
                 ON CONFLICT (writer) DO UPDATE \
                 SET seq = excluded.seq, flushed_at = excluded.flushed_at \
                 WHERE seq < excluded.seq",
            )
            .bind(f.writer())
            .bind(seq)
            .execute(&mut *tx)
            .await
            .map_err(|e| map("recording the outcome flush", e))?
            .rows_affected();
            if raised == 0 {
                // Applied before: its counts are in the table already.
                tx.rollback()
                    .await
                    .map_err(|e| map("adding outcome counts", e))?;
                return Ok(());
            }
        }
        sqlx::query(
            "INSERT INTO idem_outcome_counts (day, outcome, reason, count) \
             SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), \
                    json_extract(value, '$[2]'), sum(json_extract(value, '$[3]')) \
             FROM json_each(?1) WHERE true GROUP BY 1, 2, 3 ORDER BY 1, 2, 3 \
             ON CONFLICT (day, outcome, reason) DO UPDATE SET count = count + excluded.count",
        )
        .bind(rows)
        .execute(&mut *tx)
        .await
        .map_err(|e| map("adding outcome counts", e))?;
        tx.commit()
            .await
            .map_err(|e| map("adding outcome counts", e))?;
        Ok(())
    }

    /// The outcome tally of every UTC day that overlaps `since <= t < until` (RFC 3339 or
    /// a bare date), ordered by day, outcome and reason; `None` when the database has no
    /// `idem_outcome_counts` table (`migrate` has not run on it).
    ///
    /// # Errors
    /// [`SqliteError::InvalidTimestamp`] for a bad bound; [`SqliteError::Store`] from
    /// the database.
    pub async fn outcome_counts(
        &self,
        since: &str,
        until: &str,
    ) -> Result<Option<Vec<OutcomeCount>>, SqliteError> {
        let lo = bound("since", since)?.day();
        let until = bound("until", until)?;
        // The last day that starts before `until`.
        let hi = Timestamp::from_unix_micros(until.unix_micros() - 1).day();
        let exists: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'idem_outcome_counts'",
        )
        .fetch_one(self.pool())
        .await
        .map_err(|e| map("looking for the outcome table", e))?;
        if exists == 0 {
            return Ok(None);
        }
        let rows = sqlx::query(
            "SELECT day, outcome, reason, count FROM idem_outcome_counts \
             WHERE day >= ?1 AND day <= ?2 ORDER BY day, outcome, reason",
        )
        .bind(&lo)
        .bind(&hi)
        .fetch_all(self.pool())
        .await
        .map_err(|e| map("reading outcome counts", e))?;
        Ok(Some(
            rows.iter()
                .map(|r| {
                    OutcomeCount::new(
                        r.get::<String, _>(0),
                        r.get::<String, _>(1),
                        r.get::<String, _>(2),
                        u64::try_from(r.get::<i64, _>(3)).unwrap_or(0),
                    )
                })
                .collect(),
        ))
    }
}

#[idem_core::async_trait]
impl OutcomeCountStore for SqliteStore {
    async fn add_outcome_counts(
        &self,
        flush: &FlushId,
        counts: &[OutcomeCount],
    ) -> Result<(), StoreError> {
        SqliteStore::add_outcome_counts_once(self, flush, counts).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_round_up_to_the_stored_millisecond() {
        let t = |s| Timestamp::parse_rfc3339(s).unwrap();
        assert_eq!(
            stored_ceil(t("2026-07-01T09:00:00Z")),
            "2026-07-01T09:00:00.000Z"
        );
        assert_eq!(
            stored_ceil(t("2026-07-01T09:00:00.1234Z")),
            "2026-07-01T09:00:00.124Z"
        );
        assert_eq!(
            stored_ceil(t("2026-07-01T09:00:00.999500Z")),
            "2026-07-01T09:00:01.000Z"
        );
        assert_eq!(
            stored_ceil(t("2026-07-01T11:00:00.123+02:00")),
            "2026-07-01T09:00:00.123Z"
        );
    }

    /// The stored text is SQLite's own (`strftime('%Y-%m-%dT%H:%M:%fZ', …)`, what the
    /// store writes), byte for byte: over years 0000-9999, and for now.
    #[tokio::test]
    async fn bounds_are_written_as_sqlite_writes_timestamps() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:")
            .await
            .expect("in-memory SQLite");
        let sqlite = |secs: i64, ms: i64| {
            let pool = pool.clone();
            async move {
                let text: String = sqlx::query_scalar(
                    "SELECT strftime('%Y-%m-%dT%H:%M:%fZ', ?1, 'unixepoch', ?2)",
                )
                .bind(secs)
                .bind(format!("+{}.{:03} seconds", ms / 1000, ms % 1000))
                .fetch_one(&pool)
                .await
                .expect("strftime");
                text
            }
        };
        let first = -62_167_219_200i64; // 0000-01-01T00:00:00Z
        let last = 253_402_300_799i64; // 9999-12-31T23:59:59Z
        let mut secs = first;
        let mut n = 0;
        while secs <= last {
            let ms = (secs.rem_euclid(997) * 7) % 1000;
            let stored = sqlite(secs, ms).await;
            let t = Timestamp::from_unix_micros(secs * 1_000_000 + ms * 1000);
            assert_eq!(stored_ceil(t), stored, "{secs} s + {ms} ms");
            assert_eq!(parse_stored(Some(stored.clone())), Some(t), "{stored}");
            secs += 3_652 * 86_400 + 4_321;
            n += 1;
        }
        assert!(n > 900, "{n}");
        let now: String = sqlx::query_scalar("SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now')")
            .fetch_one(&pool)
            .await
            .expect("now");
        let t = parse_stored(Some(now.clone())).expect("SQLite's now parses");
        assert_eq!(stored_ceil(t), now);
    }

    /// A team's business table reconciles whatever its amount column holds: `REAL`
    /// amounts sum rounded to an integer (as Postgres's `::bigint`), text as SQLite sums
    /// it — never a panic (a `REAL` column was one: the report decoded the sum as an
    /// integer and unwrapped).
    #[tokio::test]
    async fn a_business_table_of_real_or_text_amounts_reconciles_or_is_an_error() {
        use idem_core::{ClaimMeta, ClaimStore as _, ClaimTx as _, IdempotencyKey};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("audit.db");
        let store = crate::SqliteStore::connect(path.to_str().expect("utf-8"), Default::default())
            .await
            .expect("open");
        store.migrate().await.expect("migrate");
        sqlx::raw_sql(
            "CREATE TABLE orders (order_id TEXT, amount REAL, idempotency_key TEXT); \
             CREATE TABLE notes (order_id TEXT, amount TEXT, idempotency_key TEXT);",
        )
        .execute(store.pool())
        .await
        .expect("tables");
        for (i, amount) in [(1, 1.25), (2, 2.5)] {
            let key = IdempotencyKey::derive(&format!("O-{i}"), "-", b"{}").expect("key");
            let mut tx = store.begin().await.expect("begin");
            tx.claim(&key, &ClaimMeta::new(format!("O-{i}")))
                .await
                .expect("claim");
            tx.commit().await.expect("commit");
            sqlx::query("INSERT INTO orders VALUES (?1, ?2, ?3), (?1, 'x', ?3)")
                .bind(format!("O-{i}"))
                .bind(amount)
                .bind(key.to_hex())
                .execute(store.pool())
                .await
                .expect("order");
            sqlx::query("INSERT INTO notes VALUES (?1, 'twelve', ?2)")
                .bind(format!("O-{i}"))
                .bind(key.to_hex())
                .execute(store.pool())
                .await
                .expect("note");
        }
        sqlx::query("DELETE FROM orders WHERE amount = 'x'")
            .execute(store.pool())
            .await
            .expect("delete");
        let (since, until) = ("2000-01-01T00:00:00Z", "2999-01-01T00:00:00Z");
        let cutoff = Timestamp::parse_rfc3339("2000-01-01T00:00:00Z").expect("cutoff");
        let orders = BusinessTable::new("orders", "amount", "order_id").expect("names");
        let stats = store
            .audit_stats(since, until, &orders, cutoff, 0)
            .await
            .expect("REAL amounts reconcile");
        assert_eq!(stats.reconciliation.rows, 2);
        assert_eq!(stats.reconciliation.amount_total, 4, "round(1.25 + 2.5)");
        // SQLite's sum() reads text that is not a number as 0 (a STRICT table refuses
        // such a row in the first place).
        let notes = BusinessTable::new("notes", "amount", "order_id").expect("names");
        let stats = store
            .audit_stats(since, until, &notes, cutoff, 0)
            .await
            .expect("text amounts reconcile as SQLite sums them");
        assert_eq!(
            (stats.reconciliation.rows, stats.reconciliation.amount_total),
            (2, 0)
        );
    }
}
