//! The audit trail as evidence: [`PgStore::export_audit`] streams the dedup records
//! claimed in a time window, each with its outbox events, in `claimed_at` order and in
//! bounded pages (keyset pagination: never the whole window in memory).
//!
//! Each page is an index seek: the first page and the next ones are two SQL texts, and a
//! next page's only condition on the cursor is the row comparison
//! `(claimed_at, idempotency_key) > ($3::timestamptz, $4)`, which the `claimed_at`
//! index answers by seeking to the cursor (a generic plan included: there is no
//! "cursor IS NULL OR …" for it to filter through). The cost of a page does not grow
//! with its position in the window.

use sqlx::Row;

use crate::error::{map_sqlx, sqlstate, PgError};
use crate::inspect::{ClaimRecord, OutboxRecord, Timestamp};
use crate::sql::statement;
use crate::store::PgStore;
use idem_core::record::{AuditStats, BusinessTable, DayCounts, OutcomeCount};
use idem_core::sql::SqlText;
use idem_core::tally::FlushId;
use idem_core::{sql, OutcomeCountStore, StoreError};

/// The statement timeout of one outcome-tally flush ([`PgStore::add_outcome_counts_once`]):
/// under the consumer's 5 s bound on a flush, so that the server ends a flush its caller
/// gave up on (and the pool gets its connection back) within seconds.
pub const OUTCOME_FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(4);

/// Microseconds since the epoch of a `timestamptz` column, exact (`extract` returns
/// `numeric` on Postgres 14 and later).
pub(crate) fn micros(col: &'static str) -> SqlText {
    sql!("(extract(epoch FROM {col}) * 1000000)::bigint", col)
}

/// What [`PgStore::export_audit`] wrote (shared with every SQL store).
pub use idem_core::record::AuditSummary;

impl PgStore {
    /// The SQL text of one page of [`export_audit`](PgStore::export_audit), for checking
    /// its plan with `EXPLAIN`. The first page takes `($1 since, $2 until, $3 limit)`;
    /// the next ones `($1 cursor claimed_at as RFC 3339 text, $2 cursor key, $3 until,
    /// $4 limit)` and seek the `claimed_at` index from the cursor (two texts, so that no
    /// generic plan has to filter an "is this the first page" condition).
    pub fn export_page_sql(&self, first: bool) -> SqlText {
        let pm = self.sql_table("processed_messages");
        let m = micros("claimed_at");
        if first {
            sql!(
                "SELECT idempotency_key, award_id, {m} FROM {pm} \
                 WHERE claimed_at >= $1::timestamptz AND claimed_at < $2::timestamptz \
                 ORDER BY claimed_at, idempotency_key LIMIT $3",
                m,
                pm
            )
        } else {
            sql!(
                "SELECT idempotency_key, award_id, {m} FROM {pm} \
                 WHERE (claimed_at, idempotency_key) > ($1::timestamptz, $2::text) \
                   AND claimed_at < $3::timestamptz \
                 ORDER BY claimed_at, idempotency_key LIMIT $4",
                m,
                pm
            )
        }
    }

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
        let ob = self.sql_table("outbox");
        let (first_sql, next_sql) = (
            statement(self.export_page_sql(true)),
            statement(self.export_page_sql(false)),
        );
        let events_sql = statement(sql!(
            "SELECT id, event_id, event_type, subject, idempotency_key, {c}, {p} FROM {ob} \
             WHERE idempotency_key = ANY($1::text[]) ORDER BY id",
            c = micros("created_at"),
            p = micros("published_at"),
            ob,
        ));
        // The bounds first, on their own: a bad one is the caller's error, whatever the
        // state of the tables.
        self.check_bounds(since, until).await?;
        let mut summary = AuditSummary::default();
        let mut cursor: Option<(Timestamp, String)> = None;
        loop {
            let query = match &cursor {
                None => sqlx::query(first_sql.clone())
                    .bind(since)
                    .bind(until)
                    .bind(limit),
                Some((at, key)) => sqlx::query(next_sql.clone())
                    .bind(at.to_string())
                    .bind(key.as_str())
                    .bind(until)
                    .bind(limit),
            };
            let rows = query
                .fetch_all(self.pool())
                .await
                .map_err(|e| map_sqlx(e, "export dedup records"))?;
            summary.pages += 1;
            let full = i64::try_from(rows.len()).unwrap_or(i64::MAX) >= limit;
            let mut records = Vec::with_capacity(rows.len());
            for row in rows {
                let micros: Option<i64> = row.try_get(2)?;
                records.push(ClaimRecord::new(
                    row.try_get(0)?,
                    row.try_get(1)?,
                    micros.map(Timestamp::from_unix_micros),
                ));
            }
            let Some(last) = records.last() else { break };
            // The window only holds records with a `claimed_at`.
            cursor = Some((
                last.claimed_at.unwrap_or(Timestamp::from_unix_micros(0)),
                last.key.clone(),
            ));
            let keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
            let rows = sqlx::query(events_sql.clone())
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
                let ev = OutboxRecord::new(
                    row.try_get(0)?,
                    row.try_get(1)?,
                    row.try_get(2)?,
                    row.try_get(3)?,
                    created.map(Timestamp::from_unix_micros),
                    published.map(Timestamp::from_unix_micros),
                );
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

impl PgStore {
    /// What an audit report shows of the window `since <= t < until` (RFC 3339): per
    /// UTC day the claims, outbox events written and published; the window's claims
    /// recounted against `business` (one row per claim, none without one); retention as
    /// it stands for a purge of what is older than `cutoff`; and `sample` of the
    /// window's dedup records (spread by key) with their events. Payloads are not read.
    ///
    /// # Errors
    /// [`PgError::InvalidTimestamp`] for a bad bound; [`PgError::Store`] from the
    /// database (a business table without the named columns included).
    pub async fn audit_stats(
        &self,
        since: &str,
        until: &str,
        business: &BusinessTable,
        cutoff: Timestamp,
        sample: usize,
    ) -> Result<AuditStats, PgError> {
        self.check_bounds(since, until).await?;
        let pm = self.sql_table("processed_messages");
        let ob = self.sql_table("outbox");
        let biz = self.shared().table_ident(&business.table);
        let (amount, subject) = (&business.amount_column, &business.subject_column);
        let store = |what: &'static str| move |e: sqlx::Error| PgError::Store(map_sqlx(e, what));
        let mut stats = AuditStats::default();

        let day = |col: &'static str| sql!("to_char({col} AT TIME ZONE 'UTC', 'YYYY-MM-DD')", col);
        let text = sql!(
            "WITH c AS (SELECT {dc} AS day, count(*) AS n FROM {pm} \
                        WHERE claimed_at >= $1::timestamptz AND claimed_at < $2::timestamptz GROUP BY 1), \
                  e AS (SELECT {de} AS day, count(*) AS n FROM {ob} \
                        WHERE created_at >= $1::timestamptz AND created_at < $2::timestamptz GROUP BY 1), \
                  p AS (SELECT {dp} AS day, count(*) AS n FROM {ob} \
                        WHERE published_at >= $1::timestamptz AND published_at < $2::timestamptz GROUP BY 1) \
             SELECT day, coalesce(c.n, 0), coalesce(e.n, 0), coalesce(p.n, 0) \
             FROM c FULL JOIN e USING (day) FULL JOIN p USING (day) ORDER BY day",
            dc = day("claimed_at"),
            de = day("created_at"),
            dp = day("published_at"),
            pm,
            ob,
        );
        let rows = sqlx::query(statement(text))
            .bind(since)
            .bind(until)
            .fetch_all(self.pool())
            .await
            .map_err(store("audit stats per day"))?;
        for r in rows {
            let n = |i: usize| count(&r, i);
            stats
                .days
                .push(DayCounts::new(r.try_get(0)?, n(1)?, n(2)?, n(3)?));
        }
        let unpublished: i64 = sqlx::query_scalar(statement(sql!(
            "SELECT count(*) FROM {ob} WHERE published_at IS NULL \
             AND created_at >= $1::timestamptz AND created_at < $2::timestamptz",
            ob
        )))
        .bind(since)
        .bind(until)
        .fetch_one(self.pool())
        .await
        .map_err(store("audit stats unpublished"))?;
        stats.unpublished = u64::try_from(unpublished).unwrap_or(0);

        let text = sql!(
            "WITH c AS (SELECT idempotency_key FROM {pm} \
                        WHERE claimed_at >= $1::timestamptz AND claimed_at < $2::timestamptz), \
                  d AS (SELECT b.idempotency_key, count(*) AS n, sum(b.{amount})::bigint AS s \
                        FROM {biz} b JOIN c USING (idempotency_key) GROUP BY 1) \
             SELECT (SELECT count(*) FROM c), coalesce(sum(n), 0)::bigint, coalesce(sum(s), 0)::bigint, \
                    (SELECT count(*) FROM c) - count(*), count(*) FILTER (WHERE n > 1), \
                    (SELECT count(*) FROM {biz} b WHERE NOT EXISTS \
                        (SELECT 1 FROM {pm} p WHERE p.idempotency_key = b.idempotency_key)), \
                    (SELECT count(*) FROM (SELECT b.{subject} FROM {biz} b JOIN c USING (idempotency_key) \
                        GROUP BY 1 HAVING count(*) > 1) s) \
             FROM d",
            pm,
            amount,
            biz,
            subject
        );
        let r = sqlx::query(statement(text))
            .bind(since)
            .bind(until)
            .fetch_one(self.pool())
            .await
            .map_err(store("reconcile claims with the business table"))?;
        let n = |i: usize| count(&r, i);
        let rec = &mut stats.reconciliation;
        rec.claims = n(0)?;
        rec.rows = n(1)?;
        rec.amount_total = r.try_get(2)?;
        rec.claims_without_row = n(3)?;
        rec.claims_with_several_rows = n(4)?;
        rec.rows_without_claim = n(5)?;
        rec.subjects_with_several_rows = n(6)?;

        let cut = cutoff.to_string();
        let r = sqlx::query(statement(sql!(
            "SELECT (SELECT {m} FROM {pm} ORDER BY claimed_at LIMIT 1), \
                    (SELECT count(*) FROM {pm}), \
                    (SELECT count(*) FROM {pm} WHERE claimed_at < $1::timestamptz), \
                    (SELECT count(*) FROM {ob} WHERE published_at IS NOT NULL AND created_at < $1::timestamptz)",
            m = micros("claimed_at"),
            pm,
            ob,
        )))
        .bind(&cut)
        .fetch_one(self.pool())
        .await
        .map_err(store("retention status"))?;
        let n = |i: usize| count(&r, i);
        let ret = &mut stats.retention;
        ret.oldest_claim = r
            .try_get::<Option<i64>, _>(0)?
            .map(Timestamp::from_unix_micros);
        ret.all_claims = n(1)?;
        ret.cutoff = Some(cutoff);
        ret.purgeable_claims = n(2)?;
        ret.purgeable_events = n(3)?;

        stats.outcomes = self.outcome_counts(since, until).await?;

        if sample > 0 {
            let keys: Vec<String> = sqlx::query_scalar(statement(sql!(
                "SELECT idempotency_key FROM {pm} \
                 WHERE claimed_at >= $1::timestamptz AND claimed_at < $2::timestamptz \
                 ORDER BY md5(idempotency_key) LIMIT $3",
                pm
            )))
            .bind(since)
            .bind(until)
            .bind(i64::try_from(sample).unwrap_or(i64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(store("audit sample"))?;
            for k in keys {
                if let Ok(key) = k.parse::<idem_core::IdempotencyKey>() {
                    if let Some(r) = self.inspect_key(&key).await? {
                        stats.sample.push(r);
                    }
                }
            }
        }
        Ok(stats)
    }
}

impl PgStore {
    /// The statement of [`add_outcome_counts`](PgStore::add_outcome_counts): one upsert
    /// of unnested arrays `($1 days, $2 outcomes, $3 reasons, $4 counts)`, summed per
    /// `(day, outcome, reason)` and taken in that order (so two concurrent flushes lock
    /// their rows in one order and never deadlock). With a flush id (`$5` writer, `$6`
    /// sequence number), the counts are added only when the same statement raised the
    /// writer's row of `idem_outcome_flushes` to this sequence number: a flush applied
    /// before (or a later one) adds nothing, and two tries of one flush running at once
    /// meet on that row (the second waits, then adds nothing, unless the first rolled
    /// back).
    fn add_outcome_counts_sql(&self, once: bool) -> SqlText {
        let t = self.sql_table("idem_outcome_counts");
        let flushes = self.sql_table("idem_outcome_flushes");
        let (with, only_if) = if once {
            (
                sql!(
                    "WITH f AS (INSERT INTO {flushes} AS f (writer, seq) VALUES ($5, $6) \
                       ON CONFLICT (writer) DO UPDATE SET seq = EXCLUDED.seq, flushed_at = now() \
                       WHERE f.seq < EXCLUDED.seq RETURNING 1) ",
                    flushes
                ),
                SqlText::from_static("WHERE EXISTS (SELECT 1 FROM f) "),
            )
        } else {
            (SqlText::new(), SqlText::new())
        };
        sql!(
            "{with}INSERT INTO {t} AS c (day, outcome, reason, count) \
             SELECT d::date, o, r, sum(n)::bigint \
             FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) AS u(d, o, r, n) \
             {only_if}GROUP BY 1, 2, 3 ORDER BY 1, 2, 3 \
             ON CONFLICT (day, outcome, reason) DO UPDATE SET count = c.count + EXCLUDED.count",
            with,
            t,
            only_if
        )
    }

    /// Adds `counts` to the outcome tally (`idem_outcome_counts`, created by
    /// [`migrate`](PgStore::migrate)) in one statement: `INSERT … ON CONFLICT (day,
    /// outcome, reason) DO UPDATE SET count = count + EXCLUDED.count`. Counts of one row
    /// given twice add up; so do concurrent calls from several consumers. Days are
    /// `YYYY-MM-DD` (UTC). See [`idem_core::tally`] for what the counts mean. Each call
    /// adds: a call tried again after an unknown outcome may add twice — a tally's
    /// flushes go through [`add_outcome_counts_once`](PgStore::add_outcome_counts_once).
    ///
    /// # Errors
    /// [`StoreError`] from the database (the table missing or not writable included); a
    /// count above `i64::MAX` is [`StoreError::Config`]. Nothing is added then.
    pub async fn add_outcome_counts(&self, counts: &[OutcomeCount]) -> Result<(), StoreError> {
        self.write_outcome_counts(None, counts).await
    }

    /// Adds `counts` as [`add_outcome_counts`](PgStore::add_outcome_counts) does, once per
    /// `flush`: the writer's highest applied flush is recorded in `idem_outcome_flushes`
    /// in the same statement, and a flush at or below it adds nothing (and succeeds) —
    /// the [`OutcomeCountStore`] contract. The transaction runs under a statement timeout
    /// of its own ([`OUTCOME_FLUSH_TIMEOUT`]), so a flush that waits on a lock ends on the
    /// server, and gives its connection back, soon after its caller gave up on it. The
    /// first flush of a writer also removes the rows of writers not heard from for 30
    /// days.
    ///
    /// # Errors
    /// As [`add_outcome_counts`](PgStore::add_outcome_counts); the statement timeout is
    /// [`StoreError::Unavailable`] or [`StoreError::Other`] (retryable). The flush's
    /// table missing (a schema `migrate` has not run on) is an error too.
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
        let mut days = Vec::with_capacity(counts.len());
        let mut outcomes = Vec::with_capacity(counts.len());
        let mut reasons = Vec::with_capacity(counts.len());
        let mut ns = Vec::with_capacity(counts.len());
        for c in counts {
            days.push(c.day.as_str());
            outcomes.push(c.outcome.as_str());
            reasons.push(c.reason.as_str());
            ns.push(c.stored_count()?);
        }
        let seq = flush.map(FlushId::stored_seq).transpose()?;
        let ms = OUTCOME_FLUSH_TIMEOUT.as_millis();
        let mut tx = self
            .begin_with(
                sqlx::query("SELECT set_config('statement_timeout', $1, true)")
                    .bind(format!("{ms}ms")),
                "adding outcome counts",
                "adding outcome counts",
            )
            .await?;
        if seq == Some(1) {
            let flushes = self.sql_table("idem_outcome_flushes");
            sqlx::query(statement(sql!(
                "DELETE FROM {flushes} WHERE flushed_at < now() - interval '30 days'",
                flushes
            )))
            .execute(&mut *tx)
            .await
            .map_err(|e| map_sqlx(e, "removing old outcome flushes"))?;
        }
        let mut q = sqlx::query(statement(self.add_outcome_counts_sql(flush.is_some())))
            .bind(&days)
            .bind(&outcomes)
            .bind(&reasons)
            .bind(&ns);
        if let (Some(f), Some(seq)) = (flush, seq) {
            q = q.bind(f.writer()).bind(seq);
        }
        q.execute(&mut *tx)
            .await
            .map_err(|e| map_sqlx(e, "adding outcome counts"))?;
        tx.commit()
            .await
            .map_err(|e| map_sqlx(e, "adding outcome counts"))?;
        Ok(())
    }

    /// The outcome tally of every UTC day that overlaps `since <= t < until` (RFC 3339 or
    /// any timestamp the server reads), ordered by day, outcome and reason; `None` when
    /// the schema has no `idem_outcome_counts` table (`migrate` has not run on it).
    ///
    /// # Errors
    /// [`PgError::InvalidTimestamp`] for a bad bound; [`PgError::Store`] from the database.
    pub async fn outcome_counts(
        &self,
        since: &str,
        until: &str,
    ) -> Result<Option<Vec<OutcomeCount>>, PgError> {
        let t = self.sql_table("idem_outcome_counts");
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(t.as_str())
            .fetch_one(self.pool())
            .await
            .map_err(|e| PgError::Store(map_sqlx(e, "looking for the outcome table")))?;
        if !exists {
            return Ok(None);
        }
        let rows = sqlx::query(statement(sql!(
            "SELECT to_char(day, 'YYYY-MM-DD'), outcome, reason, count FROM {t} \
             WHERE day >= ($1::timestamptz AT TIME ZONE 'UTC')::date \
               AND day::timestamp < ($2::timestamptz AT TIME ZONE 'UTC') \
             ORDER BY day, outcome, reason",
            t
        )))
        .bind(since)
        .bind(until)
        .fetch_all(self.pool())
        .await
        .map_err(|e| match sqlstate(&e) {
            Some(code) if code.starts_with("22") => timestamp_error(e, since, until),
            _ => PgError::Store(map_sqlx(e, "reading outcome counts")),
        })?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let n: i64 = r.try_get(3)?;
            out.push(OutcomeCount::new(
                r.try_get::<String, _>(0)?,
                r.try_get::<String, _>(1)?,
                r.try_get::<String, _>(2)?,
                u64::try_from(n).unwrap_or(0),
            ));
        }
        Ok(Some(out))
    }
}

#[idem_core::async_trait]
impl OutcomeCountStore for PgStore {
    async fn add_outcome_counts(
        &self,
        flush: &FlushId,
        counts: &[OutcomeCount],
    ) -> Result<(), StoreError> {
        PgStore::add_outcome_counts_once(self, flush, counts).await
    }
}

/// A data exception (SQLSTATE class 22) on the window's bounds is the caller's bad
/// timestamp; anything else is a store error.
impl PgStore {
    /// The bounds of a window, read by the server on their own: a bad one is the
    /// caller's error ([`PgError::InvalidTimestamp`]), whatever the state of the tables.
    async fn check_bounds(&self, since: &str, until: &str) -> Result<(), PgError> {
        sqlx::query("SELECT $1::timestamptz, $2::timestamptz")
            .bind(since)
            .bind(until)
            .execute(self.pool())
            .await
            .map_err(|e| timestamp_error(e, since, until))?;
        Ok(())
    }
}

/// Column `i` of `r`, a `bigint` count, as a `u64` (0 below zero).
fn count(r: &sqlx::postgres::PgRow, i: usize) -> Result<u64, PgError> {
    Ok(u64::try_from(r.try_get::<i64, _>(i)?).unwrap_or(0))
}

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
