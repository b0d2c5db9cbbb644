//! Inspection, as on Postgres: "was this award / key processed, when, under which key,
//! which outbox events" ([`SqliteStore::inspect_key`], [`SqliteStore::inspect_subject`]),
//! with the record type every SQL store shares.

use idem_core::record::ClaimRecord;
use idem_core::IdempotencyKey;

use crate::error::{map, SqliteError};
use crate::store::SqliteStore;

impl SqliteStore {
    /// The dedup record of `key` with its outbox events, or `None` if `key` was never
    /// claimed (or its record was purged).
    ///
    /// # Errors
    /// [`SqliteError::Store`] from the database.
    pub async fn inspect_key(
        &self,
        key: &IdempotencyKey,
    ) -> Result<Option<ClaimRecord>, SqliteError> {
        let mut records = self.records("idempotency_key = ?1", &key.to_hex()).await?;
        Ok(records.pop())
    }

    /// Every dedup record of `subject` (an award id), oldest first, each with its outbox
    /// events.
    ///
    /// # Errors
    /// [`SqliteError::Store`] from the database.
    pub async fn inspect_subject(&self, subject: &str) -> Result<Vec<ClaimRecord>, SqliteError> {
        self.records("award_id = ?1", subject).await
    }

    async fn records(
        &self,
        filter: &'static str,
        value: &str,
    ) -> Result<Vec<ClaimRecord>, SqliteError> {
        let sql = idem_core::sql!(
            "SELECT idempotency_key, award_id, claimed_at FROM processed_messages WHERE {filter} \
             ORDER BY claimed_at, idempotency_key",
            filter
        );
        let rows = sqlx::query(crate::sql::statement(sql))
            .bind(value)
            .fetch_all(self.pool())
            .await
            .map_err(|e| map("inspecting dedup records", e))?;
        Ok(self.claims_with_events(&rows).await?)
    }
}
