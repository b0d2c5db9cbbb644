//! [`PgOutboxSource`]: the relay's side of the outbox — `FOR UPDATE SKIP LOCKED` batches
//! in id order, per-subject order across several relays, LISTEN/NOTIFY wake-ups with a
//! polling fallback.

use std::collections::HashSet;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    EventId, IdempotencyKey, OutboxBacklog, OutboxBatch, OutboxEvent, OutboxSource, StoreError,
};
use sqlx::postgres::PgListener;
use sqlx::{Postgres, Row, Transaction};
use tokio::sync::Mutex;

use crate::error::map_sqlx;
use crate::store::PgStore;

/// Where an [`idem_core::Relay`] finds a [`PgStore`]'s unpublished outbox rows.
///
/// # Contract
/// - [`lease`](OutboxSource::lease) opens a transaction and locks up to `max` of the
///   oldest unpublished rows (`ORDER BY id … FOR UPDATE SKIP LOCKED`): rows another
///   relay holds are skipped, never published twice at once.
/// - A row is returned only if every earlier unpublished row of its subject is in the
///   same batch before it. A subject whose earlier row is held by another relay (or
///   was skipped in this batch) is left out entirely, so several relays never publish one
///   subject's events out of id order.
/// - Rows without an `event_id` (written by another program into a reference `outbox`)
///   are not relayed.
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
/// use idem_core::Relay;
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
}

impl PgStore {
    /// The outbox rows not yet published and the age of the oldest (by the database's
    /// clock): one index-only count over the unpublished rows, and the first of them by id.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the database cannot be reached.
    pub async fn outbox_backlog(&self) -> Result<OutboxBacklog, StoreError> {
        let outbox = self.table("outbox");
        let (pending, age): (i64, Option<f64>) = sqlx::query_as(&format!(
            "SELECT (SELECT count(*) FROM {outbox} WHERE published_at IS NULL), \
                    (SELECT EXTRACT(EPOCH FROM (now() - created_at))::float8 FROM {outbox} \
                      WHERE published_at IS NULL ORDER BY id LIMIT 1)"
        ))
        .fetch_one(self.pool())
        .await
        .map_err(|e| map_sqlx(e, "measuring the outbox backlog"))?;
        Ok(OutboxBacklog {
            pending: u64::try_from(pending).unwrap_or(0),
            oldest_age: age.and_then(|a| Duration::try_from_secs_f64(a.max(0.0)).ok()),
        })
    }
}

impl PgOutboxSource {
    /// A source over `store`'s outbox that polls every `poll_interval` when no
    /// notification comes.
    pub fn new(store: PgStore, poll_interval: Duration) -> Self {
        Self {
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
    mark_sql: String,
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

    /// `UPDATE outbox SET published_at = now() WHERE id = ANY(…)`, then commit.
    async fn mark_published(mut self) -> Result<(), StoreError> {
        let Some(mut tx) = self.tx.take() else {
            return Ok(());
        };
        sqlx::query(&self.mark_sql)
            .bind(&self.ids)
            .execute(&mut *tx)
            .await
            .map_err(|e| map_sqlx(e, "mark outbox events published"))?;
        tx.commit()
            .await
            .map_err(|e| map_sqlx(e, "commit published outbox events"))
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

fn decode_row(row: &sqlx::postgres::PgRow) -> Result<(i64, OutboxEvent, bool), StoreError> {
    let bad = |what: &str| StoreError::Rejected {
        message: format!("outbox row has an invalid {what}"),
        source: None,
    };
    let get = |e: sqlx::Error| map_sqlx(e, "decode outbox row");
    let id: i64 = row.try_get(0).map_err(get)?;
    let event_id: String = row.try_get(1).map_err(get)?;
    let event_type: String = row.try_get(2).map_err(get)?;
    let subject: Option<String> = row.try_get(3).map_err(get)?;
    let key: Option<String> = row.try_get(4).map_err(get)?;
    let payload: String = row.try_get(5).map_err(get)?;
    let blocked: bool = row.try_get(6).map_err(get)?;
    let event_id: EventId = event_id.parse().map_err(|_| bad("event_id"))?;
    let key: IdempotencyKey = key
        .as_deref()
        .unwrap_or_default()
        .parse()
        .map_err(|_| bad("idempotency_key"))?;
    Ok((
        id,
        OutboxEvent {
            event_id,
            event_type,
            subject: subject.unwrap_or_default(),
            idempotency_key: key,
            payload: payload.into_bytes(),
        },
        blocked,
    ))
}

#[async_trait]
impl OutboxSource for PgOutboxSource {
    type Batch = PgOutboxBatch;

    async fn lease(&self, max: usize) -> Result<PgOutboxBatch, StoreError> {
        let shared = self.store.shared().clone();
        let mut tx = self
            .store
            .pool()
            .begin()
            .await
            .map_err(|e| map_sqlx(e, "begin outbox lease"))?;
        let limit = i64::try_from(max.max(1)).unwrap_or(i64::MAX);
        let rows = sqlx::query(&shared.sql.lease)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| map_sqlx(e, "lease outbox rows"))?;
        let mut blocked: HashSet<String> = HashSet::new();
        let mut ids = Vec::with_capacity(rows.len());
        let mut events = Vec::with_capacity(rows.len());
        for row in &rows {
            let (id, ev, is_blocked) = decode_row(row)?;
            // Once one row of a subject is left out, every later one of it is too.
            if is_blocked || blocked.contains(&ev.subject) {
                blocked.insert(ev.subject);
                continue;
            }
            ids.push(id);
            events.push(ev);
        }
        let tx = if ids.is_empty() {
            // Nothing to hold: end the transaction now (this releases any locked but
            // blocked rows at once).
            tx.rollback()
                .await
                .map_err(|e| map_sqlx(e, "end empty outbox lease"))?;
            None
        } else {
            Some(tx)
        };
        Ok(PgOutboxBatch {
            tx,
            ids,
            events,
            mark_sql: shared.sql.mark_published.clone(),
        })
    }

    async fn backlog(&self) -> Result<OutboxBacklog, StoreError> {
        self.store.outbox_backlog().await
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
