//! The relay source over the SQLite outbox.
//!
//! A lease is one short write (`UPDATE … SET lease_token, leased_until … RETURNING`):
//! the rows are stamped with a token of this lease and a deadline, and the write lock is
//! released at once, so the broker is never waited for while consumers wait for the lock.
//! Marking them published (or releasing them, or recording a failure) is another short
//! write matched by the token. Until the deadline ([`SqliteOutboxSource::lease_duration`],
//! default 30 s) no other relay leases them; a relay that dies holding a lease leaves its
//! rows to the next relay once the deadline passes (dropping a batch releases it at once).
//!
//! Order per subject: a row is leased only when no earlier unpublished row of its subject
//! is leased by someone else, and SQLite's single writer means ids follow commit order.
//! A relay that outlives its lease (a publish slower than the lease) may see its rows
//! leased again: they are then published twice, with the same event ids.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use idem_core::outbox::MovedAside;
use idem_core::{EventId, OutboxBacklog, OutboxBatch, OutboxEvent, OutboxSource, StoreError};
use sqlx::{Row as _, SqlitePool};

use crate::error::map;
use crate::store::SqliteStore;

/// Unpublished outbox rows of a [`SqliteStore`], for `idem_engine::Relay`.
#[derive(Debug, Clone)]
pub struct SqliteOutboxSource {
    store: SqliteStore,
    poll: Duration,
    lease: Duration,
    /// Tokens of this source's batches dropped unreleased: released before the next lease.
    abandoned: Arc<Mutex<Vec<String>>>,
}

impl SqliteStore {
    /// The outbox rows not yet published (nor moved aside) and the age of the oldest (by
    /// SQLite's clock, in milliseconds).
    ///
    /// # Errors
    /// A [`StoreError`] when the database cannot be read.
    pub async fn outbox_backlog(&self) -> Result<OutboxBacklog, StoreError> {
        let (pending, age_ms): (i64, Option<f64>) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL AND failed_at IS NULL), \
                    (SELECT (julianday('now') - julianday(created_at)) * 86400000.0 FROM outbox \
                      WHERE published_at IS NULL AND failed_at IS NULL ORDER BY id LIMIT 1)",
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

    /// The events moved aside after failing to publish (see
    /// [`OutboxBatch::record_failure`]), oldest first.
    ///
    /// # Errors
    /// A [`StoreError`] when the database cannot be read.
    pub async fn outbox_moved_aside(&self) -> Result<Vec<MovedAside>, StoreError> {
        let rows = sqlx::query(
            "SELECT event_id, subject, publish_attempts, last_error, failed_at FROM outbox \
             WHERE published_at IS NULL AND failed_at IS NOT NULL ORDER BY id",
        )
        .fetch_all(self.pool())
        .await
        .map_err(|e| map("reading the events moved aside", e))?;
        Ok(rows
            .iter()
            .map(|r| MovedAside {
                event_id: r.get(0),
                subject: r.get(1),
                attempts: u32::try_from(r.get::<i64, _>(2)).unwrap_or(0),
                last_error: r.get::<Option<String>, _>(3).unwrap_or_default(),
                failed_at: r.get(4),
            })
            .collect())
    }

    /// Puts an event moved aside back in line (its attempts reset), for an operator who
    /// fixed the cause. Returns whether it was moved aside.
    ///
    /// # Errors
    /// A [`StoreError`] when the database cannot be written.
    pub async fn outbox_requeue(&self, event_id: &EventId) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE outbox SET failed_at = NULL, publish_attempts = 0 \
             WHERE event_id = ? AND failed_at IS NOT NULL AND published_at IS NULL",
        )
        .bind(event_id.to_string())
        .execute(self.pool())
        .await
        .map_err(|e| map("requeueing an outbox event", e))?;
        Ok(done.rows_affected() > 0)
    }
}

impl SqliteOutboxSource {
    /// A source that polls every `poll` when idle (SQLite has no notifications).
    pub fn new(store: SqliteStore, poll: Duration) -> Self {
        Self {
            store,
            poll,
            lease: Duration::from_secs(30),
            abandoned: Arc::default(),
        }
    }

    /// How long a leased batch is reserved for its relay (default 30 s): longer than a
    /// publish may take, short enough for a dead relay's rows to move on.
    #[must_use]
    pub fn with_lease_duration(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(1));
        self
    }

    /// See [`with_lease_duration`](Self::with_lease_duration).
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }
}

/// Milliseconds since the Unix epoch.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A token unique to one lease: the process, a counter and the time.
fn lease_token() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!(
        "{:016x}-{}-{}",
        h.finish(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        now_ms()
    )
}

/// A leased batch: its rows carry this lease's token until it is marked, released or
/// recorded as failed; dropping it releases them (in the background).
#[derive(Debug)]
pub struct SqliteOutboxBatch {
    pool: SqlitePool,
    abandoned: Arc<Mutex<Vec<String>>>,
    token: String,
    events: Vec<OutboxEvent>,
    done: bool,
    /// The lease moved a row aside that was not a valid event.
    moved_invalid: bool,
}

impl SqliteOutboxBatch {
    async fn finish(&mut self, sql: &'static str, what: &str) -> Result<(), StoreError> {
        self.done = true;
        sqlx::query(sql)
            .bind(&self.token)
            .execute(&self.pool)
            .await
            .map_err(|e| map(what, e))?;
        Ok(())
    }
}

const RELEASE: &str =
    "UPDATE outbox SET lease_token = NULL, leased_until = NULL WHERE lease_token = ?";

impl Drop for SqliteOutboxBatch {
    fn drop(&mut self) {
        if self.done || self.events.is_empty() {
            return;
        }
        // Released by this source's next lease at the latest, and at once in the
        // background where a runtime runs.
        let token = std::mem::take(&mut self.token);
        if let Ok(mut abandoned) = self.abandoned.lock() {
            abandoned.push(token.clone());
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let pool = self.pool.clone();
            rt.spawn(async move {
                let _ = sqlx::query(RELEASE).bind(token).execute(&pool).await;
            });
        }
    }
}

impl SqliteOutboxSource {
    /// One lease (see [`OutboxSource::lease`]). A row that is not a valid event is moved
    /// aside at once, with its reason, and left out of the batch.
    async fn lease_once(&self, max: usize) -> Result<SqliteOutboxBatch, StoreError> {
        let token = lease_token();
        let now = now_ms();
        let until = now.saturating_add(i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX));
        let rows = sqlx::query(
            "UPDATE outbox SET lease_token = ?1, leased_until = ?2 WHERE id IN ( \
               SELECT o.id FROM outbox o \
               WHERE o.published_at IS NULL AND o.failed_at IS NULL \
                 AND (o.leased_until IS NULL OR o.leased_until <= ?3) \
                 AND NOT EXISTS (SELECT 1 FROM outbox e WHERE e.subject = o.subject \
                   AND e.id < o.id AND e.published_at IS NULL AND e.failed_at IS NULL \
                   AND e.leased_until > ?3) \
               ORDER BY o.id LIMIT ?4) \
             RETURNING id, event_id, event_type, subject, idempotency_key, payload, traceparent",
        )
        .bind(&token)
        .bind(until)
        .bind(now)
        .bind(i64::try_from(max.max(1)).unwrap_or(i64::MAX))
        .fetch_all(self.store.pool())
        .await
        .map_err(|e| map("leasing outbox rows", e))?;
        let mut batch = SqliteOutboxBatch {
            pool: self.store.pool().clone(),
            abandoned: Arc::clone(&self.abandoned),
            token,
            events: Vec::with_capacity(rows.len()),
            done: false,
            moved_invalid: false,
        };
        // RETURNING gives no order: publication order is id order.
        let mut rows: Vec<_> = rows.iter().map(|r| (r.get::<i64, _>(0), r)).collect();
        rows.sort_by_key(|(id, _)| *id);
        for (id, r) in rows {
            let event_id: String = r.get(1);
            let key: String = r.get(4);
            let payload: String = r.get(5);
            let traceparent: Option<String> = r.get(6);
            match OutboxEvent::from_stored(
                &event_id,
                r.get(2),
                r.get(3),
                &key,
                payload.into_bytes(),
                traceparent.as_deref(),
            ) {
                Ok(ev) => batch.events.push(ev),
                // Failing the lease on it would stop the whole outbox.
                Err(why) => {
                    tracing::warn!(target: "idem::relay", row = id, error = %why, "outbox row moved aside");
                    sqlx::query(concat!(
                        "UPDATE outbox SET failed_at = ",
                        now!(),
                        ", last_error = ?2, lease_token = NULL, leased_until = NULL \
                         WHERE id = ?1 AND lease_token = ?3"
                    ))
                    .bind(id)
                    .bind(why.to_string())
                    .bind(&batch.token)
                    .execute(self.store.pool())
                    .await
                    .map_err(|e| map("moving an invalid outbox row aside", e))?;
                    batch.moved_invalid = true;
                }
            }
        }
        Ok(batch)
    }
}

#[async_trait]
impl OutboxSource for SqliteOutboxSource {
    type Batch = SqliteOutboxBatch;

    async fn lease(&self, max: usize) -> Result<SqliteOutboxBatch, StoreError> {
        let abandoned = self
            .abandoned
            .lock()
            .map(|mut a| std::mem::take(&mut *a))
            .unwrap_or_default();
        for token in abandoned {
            sqlx::query(RELEASE)
                .bind(token)
                .execute(self.store.pool())
                .await
                .map_err(|e| map("releasing an abandoned relay batch", e))?;
        }
        loop {
            let batch = self.lease_once(max).await?;
            // A lease whose every row was moved aside (see `lease_once`) is no sign of an
            // empty outbox: look again.
            if !batch.events.is_empty() || !batch.moved_invalid {
                return Ok(batch);
            }
        }
    }

    async fn backlog(&self) -> Result<OutboxBacklog, StoreError> {
        self.store.outbox_backlog().await
    }

    async fn moved_aside(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND failed_at IS NOT NULL",
        )
        .fetch_one(self.store.pool())
        .await
        .map_err(|e| map("counting outbox events moved aside", e))?;
        Ok(u64::try_from(n).unwrap_or(0))
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
        let sql = concat!(
            "UPDATE outbox SET published_at = ",
            now!(),
            ", lease_token = NULL, leased_until = NULL WHERE lease_token = ?"
        );
        self.finish(sql, "marking events published").await
    }

    async fn release(mut self) -> Result<(), StoreError> {
        self.finish(RELEASE, "releasing the relay batch").await
    }

    async fn record_failure(mut self, reason: &str, max_attempts: u32) -> Result<u64, StoreError> {
        self.done = true;
        let moved: Vec<bool> = sqlx::query_scalar(concat!(
            "UPDATE outbox SET publish_attempts = publish_attempts + 1, last_error = ?2, \
               failed_at = CASE WHEN publish_attempts + 1 >= ?3 THEN ",
            now!(),
            " END, lease_token = NULL, leased_until = NULL \
             WHERE lease_token = ?1 RETURNING failed_at IS NOT NULL"
        ))
        .bind(&self.token)
        .bind(reason)
        .bind(i64::from(max_attempts))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| map("recording an outbox publish failure", e))?;
        Ok(moved.into_iter().filter(|m| *m).count() as u64)
    }
}
