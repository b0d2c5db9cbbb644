//! The outbox writer: events inserted in the claim's transaction, with a `pg_notify`
//! that Postgres delivers only when that transaction commits.
//!
//! # Order per subject
//! Each insert first takes a transaction-scoped advisory lock on its subject
//! (`pg_advisory_xact_lock(SUBJECT_LOCK, hashtext(subject))`, several subjects in sorted
//! order), and only then draws the row's id. A second transaction writing an event of the
//! same subject waits until the first commits or rolls back, so one subject's ids follow
//! its commit order, and the relay — which publishes a subject's events in id order, never
//! past an earlier unpublished one — publishes them in commit order. Without the lock, a
//! later id committed first would be published before the earlier one. The cost: writers
//! of one subject serialise from their enqueue to their commit (different subjects never
//! wait, except on a 32-bit hash collision), and each transaction holds one lock per
//! distinct subject in the shared lock table (sized by `max_locks_per_transaction` ×
//! `max_connections`, 6,400 by default: keep batch size × concurrency well below it).

use async_trait::async_trait;
use idem_core::{OutboxEvent, OutboxWriter, StoreError};

use crate::error::map_sqlx;
use crate::store::PgTx;

/// The first key of the per-subject advisory lock (`'idem'` in ASCII); the second is
/// `hashtext(subject)`. Other programs sharing the database should not use it.
pub(crate) const SUBJECT_LOCK: i32 = 0x6964_656d;

fn payload_text(event: &OutboxEvent) -> Result<&str, StoreError> {
    std::str::from_utf8(&event.payload).map_err(|_| StoreError::Rejected {
        // The payload itself is never put in a message.
        message: format!(
            "outbox payload of event {} is not UTF-8 (the column is jsonb)",
            event.event_id
        ),
        source: None,
    })
}

impl PgTx {
    /// Stages several events in one round trip (`INSERT … SELECT … FROM unnest(…)`),
    /// in slice order (their ids, and so their publication order, follow it). An event
    /// id already in the outbox, or repeated in `events`, is stored once. Each event's
    /// [`traceparent`](OutboxEvent::traceparent) goes to the `traceparent` column (when
    /// the outbox has it: `migrations/0007_outbox_traceparent.sql`).
    ///
    /// # Errors
    /// [`StoreError::Rejected`] when a payload is not valid JSON (the `jsonb` column
    /// refuses it; the transaction is then aborted), or the database's error.
    pub async fn enqueue_many(&mut self, events: &[OutboxEvent]) -> Result<(), StoreError> {
        if events.is_empty() {
            return Ok(());
        }
        let mut ids = Vec::with_capacity(events.len());
        let mut types = Vec::with_capacity(events.len());
        let mut subjects = Vec::with_capacity(events.len());
        let mut keys = Vec::with_capacity(events.len());
        let mut payloads = Vec::with_capacity(events.len());
        for ev in events {
            ids.push(ev.event_id.to_string());
            types.push(ev.event_type.as_str());
            subjects.push(ev.subject.as_str());
            keys.push(ev.idempotency_key.to_hex());
            payloads.push(payload_text(ev)?);
        }
        let shared = self.shared_arc();
        let notify = shared.take_notify();
        let traced = shared.has_traceparent();
        let sql = if traced {
            &shared.sql.enqueue_many_traced
        } else {
            &shared.sql.enqueue_many
        };
        let mut q = sqlx::query(sql[usize::from(!notify)].clone())
            .bind(&ids)
            .bind(&types)
            .bind(&subjects)
            .bind(&keys)
            .bind(&payloads);
        if traced {
            let traces: Vec<Option<String>> = events
                .iter()
                .map(|e| e.traceparent.map(|t| t.to_string()))
                .collect();
            q = q.bind(traces);
        }
        if notify {
            q = q.bind(shared.channel.as_str());
        }
        if let Err(e) = q.execute(self.conn()).await {
            self.mark_aborted();
            return Err(map_sqlx(e, "enqueue outbox events"));
        }
        Ok(())
    }
}

#[async_trait]
impl OutboxWriter for PgTx {
    /// Inserts the event (`ON CONFLICT (event_id) DO NOTHING`) and, when
    /// [`PgConfig::notify`](crate::PgConfig::notify) is on (at most once per
    /// [`PgConfig::notify_interval`](crate::PgConfig::notify_interval)), `pg_notify`s the
    /// schema's channel in the same statement: the relay wakes when this transaction
    /// commits. The event's [`traceparent`](OutboxEvent::traceparent) goes to the
    /// `traceparent` column (when the outbox has it).
    async fn enqueue(&mut self, event: &OutboxEvent) -> Result<(), StoreError> {
        let payload = payload_text(event)?;
        let shared = self.shared_arc();
        let notify = shared.take_notify();
        let traced = shared.has_traceparent();
        let sql = if traced {
            &shared.sql.enqueue_traced
        } else {
            &shared.sql.enqueue
        };
        let mut q = sqlx::query(sql[usize::from(!notify)].clone())
            .bind(event.event_id.to_string())
            .bind(event.event_type.as_str())
            .bind(event.subject.as_str())
            .bind(event.idempotency_key.to_hex())
            .bind(payload);
        if traced {
            q = q.bind(event.traceparent.map(|t| t.to_string()));
        }
        if notify {
            q = q.bind(shared.channel.as_str());
        }
        if let Err(e) = q.execute(self.conn()).await {
            self.mark_aborted();
            return Err(map_sqlx(e, "enqueue outbox event"));
        }
        Ok(())
    }
}
