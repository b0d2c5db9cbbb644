//! Inspection: "was this award / key processed, when, under which key, which outbox
//! events" ([`PgStore::inspect_key`], [`PgStore::inspect_subject`]).

use idem_core::IdempotencyKey;
use sqlx::Row;

use idem_core::sql;

use crate::audit::micros;
use crate::error::{map_sqlx, PgError};
use crate::sql::statement;
use crate::store::PgStore;

/// The record types, shared with every SQL store (they live in `idem_core::record`).
pub use idem_core::record::{ClaimRecord, OutboxRecord, Timestamp};

fn ts(micros: Option<i64>) -> Option<Timestamp> {
    micros.map(Timestamp::from_unix_micros)
}

impl PgStore {
    /// The dedup record of `key` with its outbox events, or `None` if `key` was never
    /// claimed (or its record was purged).
    ///
    /// # Errors
    /// [`PgError::Store`] from the database.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_store_postgres::PgStore, key: idem_core::IdempotencyKey) -> Result<(), idem_store_postgres::PgError> {
    /// match store.inspect_key(&key).await? {
    ///     Some(r) => println!("claimed at {:?} for {:?}, {} events", r.claimed_at.map(|t| t.to_string()), r.award_id, r.events.len()),
    ///     None => println!("never processed"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn inspect_key(&self, key: &IdempotencyKey) -> Result<Option<ClaimRecord>, PgError> {
        let mut records = self.records("idempotency_key = $1", &key.to_hex()).await?;
        Ok(records.pop())
    }

    /// Every dedup record of `subject` (an award id), oldest first, each with its outbox
    /// events.
    ///
    /// # Errors
    /// [`PgError::Store`] from the database.
    pub async fn inspect_subject(&self, subject: &str) -> Result<Vec<ClaimRecord>, PgError> {
        self.records("award_id = $1", subject).await
    }

    async fn records(
        &self,
        filter: &'static str,
        value: &str,
    ) -> Result<Vec<ClaimRecord>, PgError> {
        let text = sql!(
            "SELECT idempotency_key, award_id, {m} FROM {pm} WHERE {filter} \
             ORDER BY claimed_at, idempotency_key",
            m = micros("claimed_at"),
            pm = self.sql_table("processed_messages"),
            filter
        );
        let rows = sqlx::query(statement(text))
            .bind(value)
            .fetch_all(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "inspect dedup records"))?;
        let mut records = Vec::with_capacity(rows.len());
        for row in rows {
            records.push(ClaimRecord::new(
                row.try_get(0)?,
                row.try_get(1)?,
                ts(row.try_get(2)?),
            ));
        }
        if records.is_empty() {
            return Ok(records);
        }
        let keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
        let text = sql!(
            "SELECT id, event_id, event_type, subject, idempotency_key, {c}, {p} FROM {ob} \
             WHERE idempotency_key = ANY($1::text[]) ORDER BY id",
            c = micros("created_at"),
            p = micros("published_at"),
            ob = self.sql_table("outbox")
        );
        let rows = sqlx::query(statement(text))
            .bind(&keys)
            .fetch_all(self.pool())
            .await
            .map_err(|e| map_sqlx(e, "inspect outbox events"))?;
        for row in rows {
            let key: String = row.try_get(4)?;
            let ev = OutboxRecord::new(
                row.try_get(0)?,
                row.try_get(1)?,
                row.try_get(2)?,
                row.try_get(3)?,
                ts(row.try_get(5)?),
                ts(row.try_get(6)?),
            );
            if let Some(r) = records.iter_mut().find(|r| r.key == key) {
                r.events.push(ev);
            }
        }
        Ok(records)
    }
}
