//! [`PgOutboxSource`]: the relay's side of the outbox — `FOR UPDATE SKIP LOCKED` batches
//! in id order from the relay's queue (`outbox_pending`,
//! `migrations/0010_outbox_pending.sql`), per-subject order across several relays,
//! LISTEN/NOTIFY wake-ups with a polling fallback.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::outbox::MovedAside;
use idem_core::{
    sql, EventId, InvalidStoredEvent, OutboxBacklog, OutboxBatch, OutboxEvent, OutboxSource,
    StoreError,
};
use sqlx::postgres::PgListener;
use sqlx::{Postgres, Row, SqlStr, Transaction};
use tokio::sync::Mutex;

use crate::error::map_sqlx;
use crate::sql::statement;
use crate::store::PgStore;

/// Where an `idem_engine::Relay` finds a [`PgStore`]'s unpublished outbox rows.
///
/// # Contract
/// - [`lease`](OutboxSource::lease) opens a transaction and locks up to `max` of the
///   oldest rows of the relay's queue, `outbox_pending` (`ORDER BY id … FOR UPDATE SKIP
///   LOCKED`): rows another relay holds are skipped, never published twice at once. The
///   queue holds one row per event still to publish, written by a trigger on the outbox
///   in the writer's transaction (`migrations/0010_outbox_pending.sql`).
/// - [`mark_published`](OutboxBatch::mark_published) deletes the batch's queue rows and
///   sets `outbox.published_at` in one statement, then commits: no index names
///   `published_at`, so the mark is a HOT update.
/// - A queue row whose outbox row is gone, already published or moved aside (an outbox
///   row deleted or changed by hand) is deleted when it is leased, never published.
/// - A row is returned only if every earlier unpublished row of its subject is in the
///   same batch before it. A subject whose earlier row is held by another relay (or
///   was skipped in this batch) is left out entirely, so several relays never publish one
///   subject's events out of id order.
/// - Rows without an `event_id` (written by another program into a reference `outbox`)
///   get no queue row and are not relayed.
/// - A row that is not a valid event (an `event_id` or `idempotency_key` that is not 64
///   hex digits: see [`InvalidStoredEvent`]) is moved aside when it is leased, with the
///   reason as its `last_error`, and never published as it is; the events behind it go on.
///   Failing the lease on it would stop the whole outbox.
/// - The `traceparent` column (when the outbox has it) is read back into
///   [`OutboxEvent::traceparent`]; a value that is not a valid W3C `traceparent` is
///   ignored (the event is published untraced), never an error.
/// - The payload is read back as `payload::text`: Postgres's normalised rendering of the
///   `jsonb` value, the same bytes every time the row is read, so a republished event is
///   byte-identical to the first publication.
/// - [`wait`](OutboxSource::wait) returns on a NOTIFY of the schema's channel (sent by
///   committed outbox inserts) or after the polling interval, whichever comes first; if
///   the listening connection fails it falls back to polling and reconnects later.
///
/// ```no_run
/// # async fn demo(store: idem_store_postgres::PgStore, publisher: idem_testkit::SimBroker) -> Result<(), idem_core::Error> {
/// use std::time::Duration;
/// use idem_engine::Relay;
/// use idem_store_postgres::PgOutboxSource;
///
/// let relay = Relay::new(PgOutboxSource::new(store, Duration::from_secs(1)), publisher, 100);
/// let stats = relay.run(async { let _ = tokio::signal::ctrl_c().await; }).await?;
/// println!("published {}", stats.published);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PgOutboxSource {
    store: PgStore,
    poll_interval: Duration,
    listener: Mutex<Option<PgListener>>,
    sql: Arc<SourceSql>,
}

/// The relay's statements, built once from the validated schema.
#[derive(Debug)]
struct SourceSql {
    lease: SqlStr,
    drop_stale: SqlStr,
    mark_published: SqlStr,
    record_failure: SqlStr,
    move_aside_invalid: SqlStr,
    moved_aside: SqlStr,
}

impl SourceSql {
    fn new(store: &PgStore) -> Self {
        let ob = store.sql_table("outbox");
        let pend = store.sql_table("outbox_pending");
        // An outbox not migrated to 0007 has no trace column: its rows are untraced.
        let trace = if store.shared().has_traceparent() {
            "o.traceparent"
        } else {
            "NULL::text AS traceparent"
        };
        Self {
            // `blocked`: an earlier queue row of the subject that this batch does not hold
            // (another relay's, or skipped). `live`: the outbox row is still to publish;
            // a queue row that is not (no outbox row, published, moved aside) is stale.
            lease: statement(sql!(
                "WITH c AS ( \
                   SELECT id, subject FROM {pend} ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED) \
                 SELECT c.id, o.event_id, o.event_type, o.subject, o.idempotency_key, \
                   o.payload::text, \
                   EXISTS (SELECT 1 FROM {pend} e WHERE e.subject = c.subject AND e.id < c.id \
                     AND e.id NOT IN (SELECT id FROM c)) AS blocked, \
                   {trace}, \
                   (o.id IS NOT NULL AND o.published_at IS NULL AND o.failed_at IS NULL \
                     AND o.event_id IS NOT NULL) AS live \
                 FROM c LEFT JOIN {ob} o ON o.id = c.id ORDER BY c.id",
                pend,
                trace,
                ob
            )),
            drop_stale: statement(sql!(
                "DELETE FROM {pend} WHERE id = ANY($1::bigint[])",
                pend
            )),
            mark_published: statement(sql!(
                "WITH done AS (DELETE FROM {pend} WHERE id = ANY($1::bigint[])) \
                 UPDATE {ob} SET published_at = now() WHERE id = ANY($1::bigint[])",
                pend,
                ob
            )),
            // An event moved aside leaves the queue with its last attempt.
            record_failure: statement(sql!(
                "WITH u AS ( \
                   UPDATE {ob} SET publish_attempts = publish_attempts + 1, last_error = $2, \
                     failed_at = CASE WHEN publish_attempts + 1 >= $3 THEN now() END \
                   WHERE id = ANY($1::bigint[]) RETURNING id, failed_at IS NOT NULL AS moved), \
                 gone AS (DELETE FROM {pend} WHERE id IN (SELECT id FROM u WHERE moved)) \
                 SELECT moved FROM u",
                ob,
                pend
            )),
            // Rows that are not valid events ($1 ids, $2 reasons), locked by the lease:
            // moved aside with their reason, out of the queue.
            move_aside_invalid: statement(sql!(
                "WITH r AS (SELECT * FROM unnest($1::bigint[], $2::text[]) AS r(id, reason)), \
                 u AS (UPDATE {ob} o SET failed_at = now(), last_error = r.reason \
                   FROM r WHERE o.id = r.id) \
                 DELETE FROM {pend} WHERE id = ANY($1::bigint[])",
                ob,
                pend
            )),
            moved_aside: statement(sql!(
                "SELECT count(*) FROM {ob} WHERE published_at IS NULL AND failed_at IS NOT NULL",
                ob
            )),
        }
    }
}

impl PgStore {
    /// The outbox rows not yet published and the age of the oldest (by the database's
    /// clock): a count of the relay's queue, and the first of it by id.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the database cannot be reached.
    pub async fn outbox_backlog(&self) -> Result<OutboxBacklog, StoreError> {
        let outbox = self.sql_table("outbox");
        let pend = self.sql_table("outbox_pending");
        let (pending, age): (i64, Option<f64>) = sqlx::query_as(statement(sql!(
            "SELECT (SELECT count(*) FROM {pend}), \
                    (SELECT EXTRACT(EPOCH FROM (now() - o.created_at))::float8 \
                      FROM {pend} p JOIN {outbox} o ON o.id = p.id ORDER BY p.id LIMIT 1)",
            pend,
            outbox
        )))
        .fetch_one(self.pool())
        .await
        .map_err(|e| map_sqlx(e, "measuring the outbox backlog"))?;
        Ok(OutboxBacklog {
            pending: u64::try_from(pending).unwrap_or(0),
            oldest_age: age.and_then(|a| Duration::try_from_secs_f64(a.max(0.0)).ok()),
        })
    }
}

/// `event_id, subject, publish_attempts, last_error, failed_at` of a row moved aside.
type MovedAsideRow = (Option<String>, Option<String>, i32, Option<String>, String);

impl PgStore {
    /// The events moved aside after failing to publish (see
    /// [`OutboxBatch::record_failure`]), oldest first.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the database cannot be reached.
    pub async fn outbox_moved_aside(&self) -> Result<Vec<MovedAside>, StoreError> {
        let rows: Vec<MovedAsideRow> = sqlx::query_as(statement(sql!(
            "SELECT event_id, subject, publish_attempts, last_error, \
                   to_char(failed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
                 FROM {ob} WHERE published_at IS NULL AND failed_at IS NOT NULL ORDER BY id",
            ob = self.sql_table("outbox")
        )))
        .fetch_all(self.pool())
        .await
        .map_err(|e| map_sqlx(e, "reading the outbox events moved aside"))?;
        Ok(rows
            .into_iter()
            .map(
                |(event_id, subject, attempts, last_error, failed_at)| MovedAside {
                    event_id: event_id.unwrap_or_default(),
                    subject: subject.unwrap_or_default(),
                    attempts: u32::try_from(attempts).unwrap_or(0),
                    last_error: last_error.unwrap_or_default(),
                    failed_at,
                },
            )
            .collect())
    }

    /// Puts an event moved aside back in line (its attempts reset), for an operator who
    /// fixed the cause. Returns whether it was moved aside.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the database cannot be reached.
    pub async fn outbox_requeue(&self, event_id: &EventId) -> Result<bool, StoreError> {
        // Back in the relay's queue in the same statement.
        let done = sqlx::query(statement(sql!(
            "WITH u AS (UPDATE {ob} SET failed_at = NULL, publish_attempts = 0 \
               WHERE event_id = $1 AND failed_at IS NOT NULL AND published_at IS NULL \
               RETURNING id, subject) \
             INSERT INTO {pend} (id, subject) SELECT id, subject FROM u ON CONFLICT DO NOTHING",
            ob = self.sql_table("outbox"),
            pend = self.sql_table("outbox_pending")
        )))
        .bind(event_id.to_string())
        .execute(self.pool())
        .await
        .map_err(|e| map_sqlx(e, "requeueing an outbox event"))?;
        Ok(done.rows_affected() > 0)
    }
}

impl PgOutboxSource {
    /// A source over `store`'s outbox that polls every `poll_interval` when no
    /// notification comes.
    pub fn new(store: PgStore, poll_interval: Duration) -> Self {
        Self {
            sql: Arc::new(SourceSql::new(&store)),
            store,
            poll_interval,
            listener: Mutex::new(None),
        }
    }

    /// The store.
    pub fn store(&self) -> &PgStore {
        &self.store
    }

    /// The polling interval.
    pub fn poll_interval(&self) -> Duration {
        self.poll_interval
    }

    /// Starts listening now (otherwise the first [`wait`](OutboxSource::wait) does), so
    /// that no notification committed from here on is missed.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the listening connection cannot be opened.
    pub async fn listen(&self) -> Result<(), StoreError> {
        let mut guard = self.listener.lock().await;
        Self::ensure_listener(&self.store, &mut guard).await
    }

    async fn ensure_listener(
        store: &PgStore,
        slot: &mut Option<PgListener>,
    ) -> Result<(), StoreError> {
        if slot.is_none() {
            let mut l = PgListener::connect_with(store.pool())
                .await
                .map_err(|e| map_sqlx(e, "open the LISTEN connection"))?;
            l.listen(store.channel())
                .await
                .map_err(|e| map_sqlx(e, "LISTEN"))?;
            *slot = Some(l);
        }
        Ok(())
    }
}

/// A leased batch of a [`PgOutboxSource`]: its rows stay locked (by the open
/// transaction) until [`mark_published`](OutboxBatch::mark_published) or
/// [`release`](OutboxBatch::release); dropping it rolls back, leaving them unpublished.
#[derive(Debug)]
pub struct PgOutboxBatch {
    tx: Option<Transaction<'static, Postgres>>,
    ids: Vec<i64>,
    events: Vec<OutboxEvent>,
    sql: Arc<SourceSql>,
}

impl PgOutboxBatch {
    /// The outbox row ids of the events, in order.
    pub fn row_ids(&self) -> &[i64] {
        &self.ids
    }
}

#[async_trait]
impl OutboxBatch for PgOutboxBatch {
    fn events(&self) -> &[OutboxEvent] {
        &self.events
    }

    /// Deletes the batch's queue rows and sets `outbox.published_at = now()` (one
    /// statement), then commits.
    async fn mark_published(mut self) -> Result<(), StoreError> {
        let Some(mut tx) = self.tx.take() else {
            return Ok(());
        };
        sqlx::query(self.sql.mark_published.clone())
            .bind(&self.ids)
            .execute(&mut *tx)
            .await
            .map_err(|e| map_sqlx(e, "mark outbox events published"))?;
        tx.commit()
            .await
            .map_err(|e| map_sqlx(e, "commit published outbox events"))
    }

    /// `UPDATE outbox SET publish_attempts = publish_attempts + 1, last_error = …,
    /// failed_at = (now() once the attempts reach max_attempts)`, then commit.
    async fn record_failure(mut self, reason: &str, max_attempts: u32) -> Result<u64, StoreError> {
        let Some(mut tx) = self.tx.take() else {
            return Ok(0);
        };
        let moved: Vec<bool> = sqlx::query_scalar(self.sql.record_failure.clone())
            .bind(&self.ids)
            .bind(reason)
            .bind(i32::try_from(max_attempts).unwrap_or(i32::MAX))
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| map_sqlx(e, "record an outbox publish failure"))?;
        tx.commit()
            .await
            .map_err(|e| map_sqlx(e, "commit an outbox publish failure"))?;
        Ok(moved.into_iter().filter(|m| *m).count() as u64)
    }

    async fn release(mut self) -> Result<(), StoreError> {
        match self.tx.take() {
            Some(tx) => tx
                .rollback()
                .await
                .map_err(|e| map_sqlx(e, "release outbox batch")),
            None => Ok(()),
        }
    }
}

/// One leased queue row: its id, whether an earlier row of its subject is held elsewhere,
/// and its event — `None` when the queue row is stale (see [`PgOutboxSource`]), an error
/// when the row is not a valid event (it is then moved aside).
type LeasedRow = (i64, bool, Option<Result<OutboxEvent, InvalidStoredEvent>>);

fn decode_row(row: &sqlx::postgres::PgRow) -> Result<LeasedRow, StoreError> {
    let get = |e: sqlx::Error| map_sqlx(e, "decode outbox row");
    let id: i64 = row.try_get(0).map_err(get)?;
    let blocked: bool = row.try_get(6).map_err(get)?;
    let live: bool = row.try_get(8).map_err(get)?;
    if !live {
        return Ok((id, blocked, None));
    }
    let event = OutboxEvent::from_stored(
        row.try_get(1).map_err(get)?,
        row.try_get(2).map_err(get)?,
        row.try_get::<Option<String>, _>(3)
            .map_err(get)?
            .unwrap_or_default(),
        row.try_get::<Option<&str>, _>(4)
            .map_err(get)?
            .unwrap_or_default(),
        row.try_get::<String, _>(5).map_err(get)?.into_bytes(),
        row.try_get(7).map_err(get)?,
    );
    Ok((id, blocked, Some(event)))
}

#[async_trait]
impl OutboxSource for PgOutboxSource {
    type Batch = PgOutboxBatch;

    async fn lease(&self, max: usize) -> Result<PgOutboxBatch, StoreError> {
        if self.store.shared().is_cdc() {
            // Its events are written published and queued for no relay: a relay here
            // would publish nothing, and say nothing of it.
            return Err(StoreError::Config(format!(
                "the outbox of schema {:?} is read by change data capture (idem migrate \
                 --outbox cdc): its events are published by the connector, not by a relay",
                self.store.schema()
            )));
        }
        let limit = i64::try_from(max.max(1)).unwrap_or(i64::MAX);
        loop {
            let mut tx = self
                .store
                .pool()
                // One round trip. Nested loops only: the lease joins at most `max` queue
                // rows to the outbox by primary key, but on a small or freshly filled
                // outbox the planner would hash the whole outbox instead (15 ms for
                // 20,000 rows against 2 ms).
                .begin_with(
                    "BEGIN; SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off",
                )
                .await
                .map_err(|e| map_sqlx(e, "begin outbox lease"))?;
            let rows = sqlx::query(self.sql.lease.clone())
                .bind(limit)
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| map_sqlx(e, "lease outbox rows"))?;
            let mut blocked: HashSet<String> = HashSet::new();
            let mut ids = Vec::with_capacity(rows.len());
            let mut events = Vec::with_capacity(rows.len());
            let mut stale = Vec::new();
            let (mut invalid, mut reasons) = (Vec::new(), Vec::new());
            for row in &rows {
                match decode_row(row)? {
                    (id, _, None) => stale.push(id),
                    (id, _, Some(Err(why))) => {
                        tracing::warn!(target: "idem::relay", row = id, error = %why, "outbox row moved aside");
                        invalid.push(id);
                        reasons.push(why.to_string());
                    }
                    (id, is_blocked, Some(Ok(ev))) => {
                        // Once one row of a subject is left out, every later one is too.
                        if is_blocked || blocked.contains(&ev.subject) {
                            blocked.insert(ev.subject);
                            continue;
                        }
                        ids.push(id);
                        events.push(ev);
                    }
                }
            }
            if !stale.is_empty() {
                // Locked by this lease: deleted with its commit (a release rolls the
                // deletion back with the rest, and a later lease deletes them again).
                tracing::debug!(target: "idem::relay", rows = stale.len(), "dropping stale outbox queue rows");
                sqlx::query(self.sql.drop_stale.clone())
                    .bind(&stale)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| map_sqlx(e, "drop stale outbox queue rows"))?;
            }
            if !invalid.is_empty() {
                // Locked by this lease: moved aside with its commit (a release rolls it
                // back, and a later lease moves them aside again).
                sqlx::query(self.sql.move_aside_invalid.clone())
                    .bind(&invalid)
                    .bind(&reasons)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| map_sqlx(e, "move invalid outbox rows aside"))?;
            }
            if !ids.is_empty() {
                return Ok(PgOutboxBatch {
                    tx: Some(tx),
                    ids,
                    events,
                    sql: Arc::clone(&self.sql),
                });
            }
            if stale.is_empty() && invalid.is_empty() {
                // Nothing to hold: end the transaction now (this releases any locked but
                // blocked rows at once).
                tx.rollback()
                    .await
                    .map_err(|e| map_sqlx(e, "end empty outbox lease"))?;
                return Ok(PgOutboxBatch {
                    tx: None,
                    ids,
                    events,
                    sql: Arc::clone(&self.sql),
                });
            }
            // Only stale or invalid rows: commit their removal and look again.
            tx.commit()
                .await
                .map_err(|e| map_sqlx(e, "commit dropped outbox queue rows"))?;
        }
    }

    async fn backlog(&self) -> Result<OutboxBacklog, StoreError> {
        self.store.outbox_backlog().await
    }

    async fn moved_aside(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(self.sql.moved_aside.clone())
            .fetch_one(self.store.pool())
            .await
            .map_err(|e| map_sqlx(e, "count outbox events moved aside"))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn wait(&self) -> Result<(), StoreError> {
        let mut guard = self.listener.lock().await;
        if let Err(e) = Self::ensure_listener(&self.store, &mut guard).await {
            drop(guard);
            tracing::debug!(target: "idem::relay", error = %e, "LISTEN unavailable; polling");
            tokio::time::sleep(self.poll_interval).await;
            return Ok(());
        }
        let Some(listener) = guard.as_mut() else {
            return Ok(());
        };
        match tokio::time::timeout(self.poll_interval, listener.try_recv()).await {
            // The polling interval elapsed.
            Err(_) => {}
            // A notification: drain the others already buffered (one wake-up for many).
            Ok(Ok(Some(_))) => while listener.next_buffered().is_some() {},
            // The connection was lost (it reconnects on the next call) or failed: wake
            // up anyway, notifications may have been missed.
            Ok(Ok(None)) => {}
            Ok(Err(e)) => {
                tracing::debug!(target: "idem::relay", error = %e, "LISTEN connection failed; polling");
                *guard = None;
            }
        }
        Ok(())
    }
}
