//! The relay source over the SQLite outbox.
//!
//! SQLite has one writer at a time, so a leased batch holds the write lock
//! (`BEGIN IMMEDIATE`) until it is marked or released: no two relays ever hold one row,
//! and order per subject follows from id order. Keep relay batches small on a busy
//! embedded database, since consumers wait for the lock meanwhile.

use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    EventId, IdempotencyKey, OutboxBacklog, OutboxBatch, OutboxEvent, OutboxSource, StoreError,
};
use sqlx::{Row as _, Sqlite, Transaction};

use crate::error::map;
use crate::store::SqliteStore;

/// Unpublished outbox rows of a [`SqliteStore`], for [`idem_core::Relay`].
#[derive(Debug, Clone)]
pub struct SqliteOutboxSource {
    store: SqliteStore,
    poll: Duration,
}

impl SqliteStore {
    /// The outbox rows not yet published and the age of the oldest (by SQLite's clock,
    /// in milliseconds).
    ///
    /// # Errors
    /// A [`StoreError`] when the database cannot be read.
    pub async fn outbox_backlog(&self) -> Result<OutboxBacklog, StoreError> {
        let (pending, age_ms): (i64, Option<f64>) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL), \
                    (SELECT (julianday('now') - julianday(created_at)) * 86400000.0 FROM outbox \
                      WHERE published_at IS NULL ORDER BY id LIMIT 1)",
        )
        .fetch_one(self.pool())
        .await
        .map_err(|e| map("measuring the outbox backlog", e))?;
        Ok(OutboxBacklog {
            pending: u64::try_from(pending).unwrap_or(0),
            oldest_age: age_ms
                .and_then(|ms| Duration::try_from_secs_f64(ms.max(0.0) / 1000.0).ok()),
        })
    }
}

impl SqliteOutboxSource {
    /// A source that polls every `poll` when idle (SQLite has no notifications).
    pub fn new(store: SqliteStore, poll: Duration) -> Self {
        Self { store, poll }
    }
}

/// A leased batch (holding SQLite's write lock).
#[derive(Debug)]
pub struct SqliteOutboxBatch {
    tx: Transaction<'static, Sqlite>,
    ids: Vec<i64>,
    events: Vec<OutboxEvent>,
}

#[async_trait]
impl OutboxSource for SqliteOutboxSource {
    type Batch = SqliteOutboxBatch;

    async fn lease(&self, max: usize) -> Result<SqliteOutboxBatch, StoreError> {
        let mut tx = self
            .store
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| map("beginning a relay transaction", e))?;
        let rows = sqlx::query(
            "SELECT id, event_id, event_type, subject, idempotency_key, payload FROM outbox \
             WHERE published_at IS NULL ORDER BY id LIMIT ?",
        )
        .bind(i64::try_from(max).unwrap_or(i64::MAX))
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| map("leasing outbox rows", e))?;
        let mut ids = Vec::with_capacity(rows.len());
        let mut events = Vec::with_capacity(rows.len());
        for r in &rows {
            let event_id: String = r.get(1);
            let key: String = r.get(4);
            let payload: String = r.get(5);
            ids.push(r.get::<i64, _>(0));
            events.push(OutboxEvent {
                event_id: event_id.parse::<EventId>().map_err(|e| {
                    StoreError::other(format!("corrupt outbox event id: {e}"), false)
                })?,
                event_type: r.get(2),
                subject: r.get(3),
                idempotency_key: key
                    .parse::<IdempotencyKey>()
                    .map_err(|e| StoreError::other(format!("corrupt outbox key: {e}"), false))?,
                payload: payload.into_bytes(),
            });
        }
        Ok(SqliteOutboxBatch { tx, ids, events })
    }

    async fn backlog(&self) -> Result<OutboxBacklog, StoreError> {
        self.store.outbox_backlog().await
    }

    async fn wait(&self) -> Result<(), StoreError> {
        tokio::time::sleep(self.poll).await;
        Ok(())
    }
}

#[async_trait]
impl OutboxBatch for SqliteOutboxBatch {
    fn events(&self) -> &[OutboxEvent] {
        &self.events
    }

    async fn mark_published(mut self) -> Result<(), StoreError> {
        for chunk in self.ids.chunks(10_000) {
            let sql = format!(
                "UPDATE outbox SET published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id IN ({})",
                vec!["?"; chunk.len()].join(",")
            );
            let mut q = sqlx::query(&sql);
            for id in chunk {
                q = q.bind(id);
            }
            q.execute(&mut *self.tx)
                .await
                .map_err(|e| map("marking events published", e))?;
        }
        self.tx
            .commit()
            .await
            .map_err(|e| map("committing the relay batch", e))
    }

    async fn release(self) -> Result<(), StoreError> {
        self.tx
            .rollback()
            .await
            .map_err(|e| map("releasing the relay batch", e))
    }
}
