//! The outbox writer: events inserted in the claim's transaction, with a `pg_notify`
//! that Postgres delivers only when that transaction commits.

use async_trait::async_trait;
use idem_core::{OutboxEvent, OutboxWriter, StoreError};

use crate::error::map_sqlx;
use crate::store::PgTx;

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
    /// id already in the outbox, or repeated in `events`, is stored once.
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
        let mut q = sqlx::query(&shared.sql.enqueue_many[usize::from(!notify)])
            .bind(&ids)
            .bind(&types)
            .bind(&subjects)
            .bind(&keys)
            .bind(&payloads);
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
    /// commits.
    async fn enqueue(&mut self, event: &OutboxEvent) -> Result<(), StoreError> {
        let payload = payload_text(event)?;
        let shared = self.shared_arc();
        let notify = shared.take_notify();
        let mut q = sqlx::query(&shared.sql.enqueue[usize::from(!notify)])
            .bind(event.event_id.to_string())
            .bind(event.event_type.as_str())
            .bind(event.subject.as_str())
            .bind(event.idempotency_key.to_hex())
            .bind(payload);
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
