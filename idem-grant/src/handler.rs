//! The disbursement handler.

use async_trait::async_trait;
use idem_engine::sql::SqlText;
use idem_engine::{
    sql, ClaimMeta, ClaimTx, Handler, HandlerError, Headers, IdempotencyKey, OutboxEvent,
    OutboxWriter, RejectReason, StoreError, Submission,
};

use crate::canonical::KeyDerivation;
use crate::submission::{parse_submission_with, Grant, DEFAULT_MAX_BODY};

/// The type of the outbox event each disbursement writes.
pub const EVENT_DISBURSEMENT_RECORDED: &str = "disbursement.recorded";

/// A transaction that can record disbursements: the business write of the grant
/// pipeline, in the claim's transaction.
///
/// # Contract
/// Rows written here commit and roll back with the claim.
#[async_trait]
pub trait GrantBook: ClaimTx + OutboxWriter {
    /// Inserts one `disbursements` row into `table` (SQL text naming it, possibly
    /// schema-qualified: program text and validated identifiers only).
    async fn record_disbursement(
        &mut self,
        table: &SqlText,
        grant: &Grant,
        key: &IdempotencyKey,
    ) -> Result<(), StoreError>;

    /// Inserts several rows and their outbox events. The default is one statement each;
    /// stores override it with fewer round trips for the whole batch (Postgres: one
    /// statement for the rows and the events, [`PgTx::insert_and_enqueue`]). The handler
    /// writes a single submission through it too.
    ///
    /// [`PgTx::insert_and_enqueue`]: https://docs.rs/idem-store-postgres/latest/idem_store_postgres/struct.PgTx.html#method.insert_and_enqueue
    async fn record_batch(
        &mut self,
        table: &SqlText,
        items: &[(&Grant, &IdempotencyKey)],
        events: &[OutboxEvent],
    ) -> Result<(), StoreError> {
        for (grant, key) in items {
            self.record_disbursement(table, grant, key).await?;
        }
        for ev in events {
            self.enqueue(ev).await?;
        }
        Ok(())
    }
}

/// The disbursement handler: one `disbursements` row and one
/// [`EVENT_DISBURSEMENT_RECORDED`] outbox event carrying `{"award_id": …}` per
/// submission.
#[derive(Debug, Clone)]
pub struct GrantHandler {
    table: SqlText,
    max_body: usize,
    derivation: KeyDerivation,
}

impl Default for GrantHandler {
    fn default() -> Self {
        Self {
            table: SqlText::from_static(crate::GRANT_TABLE),
            max_body: DEFAULT_MAX_BODY,
            derivation: KeyDerivation::Reference,
        }
    }
}

impl GrantHandler {
    /// The handler for the unqualified `disbursements` table and a 1 MiB body limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes to `table`, in `schema` when given (Postgres), instead: both are checked
    /// as plain SQL identifiers ([`idem_engine::ident`]) and quoted, so no name from
    /// configuration goes into SQL raw.
    ///
    /// ```
    /// let h = idem_grant::GrantHandler::new().with_table(Some("grants"), "disbursements")?;
    /// assert!(idem_grant::GrantHandler::new().with_table(None, "x; DROP TABLE y").is_err());
    /// # Ok::<(), idem_engine::ident::InvalidIdent>(())
    /// ```
    ///
    /// # Errors
    /// [`InvalidIdent`](idem_engine::ident::InvalidIdent) for a name that is not a plain
    /// identifier.
    pub fn with_table(
        mut self,
        schema: Option<&str>,
        table: &str,
    ) -> Result<Self, idem_engine::ident::InvalidIdent> {
        use idem_engine::ident::Ident;
        let table = Ident::new(table)?;
        self.table = match schema {
            Some(schema) => {
                let schema = Ident::new(schema)?;
                sql!("{schema}.{table}", schema, table)
            }
            None => sql!("{table}", table),
        };
        Ok(self)
    }

    /// Rejects bodies over `max_body` bytes.
    #[must_use]
    pub fn with_max_body(mut self, max_body: usize) -> Self {
        self.max_body = max_body;
        self
    }

    /// Derives keys as `derivation` says (default [`KeyDerivation::Reference`], the
    /// reference consumer's key: keep it for a table shared with it).
    #[must_use]
    pub fn with_key_derivation(mut self, derivation: KeyDerivation) -> Self {
        self.derivation = derivation;
        self
    }

    /// The event a disbursement writes.
    pub fn event(key: &IdempotencyKey, grant: &Grant) -> OutboxEvent {
        let payload = serde_json::json!({ "award_id": grant.award_id }).to_string();
        OutboxEvent::new(
            *key,
            EVENT_DISBURSEMENT_RECORDED,
            grant.award_id.clone(),
            payload,
        )
    }
}

#[async_trait]
impl<T: GrantBook> Handler<T> for GrantHandler {
    type Input = Grant;

    fn identify(
        &self,
        payload: &[u8],
        _headers: &Headers,
    ) -> Result<Submission<Grant>, RejectReason> {
        parse_submission_with(payload, self.max_body, self.derivation)
    }

    /// The claim records the submission timestamp too (it is part of the key), so a
    /// partitioned store files it by the submission's month.
    fn claim_meta(&self, sub: &Submission<Grant>) -> ClaimMeta {
        ClaimMeta::new(sub.subject.clone())
            .with_submission_timestamp(sub.input.submission_timestamp.clone())
    }

    /// The row and its event through [`GrantBook::record_batch`]: one round trip on
    /// Postgres.
    async fn handle(&self, tx: &mut T, sub: &Submission<Grant>) -> Result<(), HandlerError> {
        let event = Self::event(&sub.key, &sub.input);
        tx.record_batch(&self.table, &[(&sub.input, &sub.key)], &[event])
            .await?;
        Ok(())
    }

    async fn handle_batch(
        &self,
        tx: &mut T,
        subs: &[&Submission<Grant>],
    ) -> Result<(), HandlerError> {
        let items: Vec<(&Grant, &IdempotencyKey)> =
            subs.iter().map(|s| (&s.input, &s.key)).collect();
        let events: Vec<OutboxEvent> = subs.iter().map(|s| Self::event(&s.key, &s.input)).collect();
        tx.record_batch(&self.table, &items, &events).await?;
        Ok(())
    }
}

#[async_trait]
impl<T, F> GrantBook for idem_engine::FilteredTx<T, F>
where
    T: GrantBook,
    F: idem_engine::DoneFilter + 'static,
{
    async fn record_disbursement(
        &mut self,
        table: &SqlText,
        grant: &Grant,
        key: &IdempotencyKey,
    ) -> Result<(), StoreError> {
        self.inner_mut()
            .record_disbursement(table, grant, key)
            .await
    }

    async fn record_batch(
        &mut self,
        table: &SqlText,
        items: &[(&Grant, &IdempotencyKey)],
        events: &[OutboxEvent],
    ) -> Result<(), StoreError> {
        self.inner_mut().record_batch(table, items, events).await
    }
}
