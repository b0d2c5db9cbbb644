//! The outbox writer: the handler's events staged in the claim's transaction
//! ([`SqliteTx::enqueue_many`], [`OutboxWriter`]); the relay reads them through
//! [`crate::source`].

use async_trait::async_trait;
use idem_core::sql::SqlText;
use idem_core::{OutboxEvent, OutboxWriter, StoreError};

use crate::error::map;
use crate::sql::statement;
use crate::store::{SqliteTx, NOW};

impl SqliteTx {
    /// Stages several outbox events in one statement per 1,000 events, in slice order. An
    /// event id already in the outbox, or repeated in `events`, is stored once.
    ///
    /// # Errors
    /// [`StoreError::Rejected`] when a payload is not UTF-8 JSON, or the database's error.
    pub async fn enqueue_many(&mut self, events: &[OutboxEvent]) -> Result<(), StoreError> {
        for chunk in events.chunks(1000) {
            let mut sql = SqlText::from_static(
                "INSERT INTO outbox \
                 (event_id, event_type, subject, idempotency_key, payload, created_at, traceparent) \
                 VALUES ",
            );
            for i in 0..chunk.len() {
                sql.push(if i > 0 { ", " } else { "" })
                    .push("(?, ?, ?, ?, ?, ")
                    .push(NOW)
                    .push(", ?)");
            }
            sql.push(" ON CONFLICT (event_id) DO NOTHING");
            let mut q = sqlx::query(statement(sql));
            for event in chunk {
                q = q
                    .bind(event.event_id.to_string())
                    .bind(event.event_type.clone())
                    .bind(event.subject.clone())
                    .bind(event.idempotency_key.to_hex())
                    .bind(payload_text(event)?.to_owned())
                    .bind(event.traceparent.map(|t| t.to_string()));
            }
            q.execute(self.conn())
                .await
                .map_err(|e| map("writing outbox events", e))?;
        }
        Ok(())
    }
}

fn payload_text(event: &OutboxEvent) -> Result<&str, StoreError> {
    std::str::from_utf8(&event.payload).map_err(|_| StoreError::Rejected {
        message: "outbox payload is not UTF-8 JSON".into(),
        source: None,
    })
}

#[async_trait]
impl OutboxWriter for SqliteTx {
    async fn enqueue(&mut self, event: &OutboxEvent) -> Result<(), StoreError> {
        self.enqueue_many(std::slice::from_ref(event)).await
    }
}
