//! The claim store contract: [`ClaimStore`] opens a [`ClaimTx`], in which a key is
//! claimed, the business rows are written and the whole is committed at once.

use async_trait::async_trait;

use crate::error::StoreError;
use crate::key::IdempotencyKey;
use crate::outbox::OutboxEvent;

/// What a claim records beside the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimMeta {
    /// The business id the key was derived from (`award_id` for grants). Stored with the
    /// claim so an auditor can ask "was award X processed, and under which key".
    pub subject: String,
    /// The submission timestamp exactly as the message carries it, when the pipeline
    /// knows it (the grant handler does: it is part of the key's preimage, so the same
    /// key always comes with the same timestamp). A store may derive a partition from it:
    /// idem-store-postgres's partitioned layout files the claim under the timestamp's
    /// month, which — being a pure function of the key's input — is the same for a message
    /// and every redelivery of it. Stores without partitions ignore it. `None` (the
    /// default) files the claim where timestamps that do not parse go.
    pub submission_timestamp: Option<String>,
}

impl ClaimMeta {
    /// Metadata for a claim on behalf of `subject`, without a submission timestamp.
    pub fn new(subject: impl Into<String>) -> Self {
        Self {
            subject: subject.into(),
            submission_timestamp: None,
        }
    }

    /// Sets [`submission_timestamp`](ClaimMeta::submission_timestamp): pass the
    /// timestamp the key was derived from, exactly as written in the message.
    ///
    /// ```
    /// use idem_core::ClaimMeta;
    /// let meta = ClaimMeta::new("A-1").with_submission_timestamp("2026-07-01T09:00:00Z");
    /// assert_eq!(meta.submission_timestamp.as_deref(), Some("2026-07-01T09:00:00Z"));
    /// ```
    #[must_use]
    pub fn with_submission_timestamp(mut self, timestamp: impl Into<String>) -> Self {
        self.submission_timestamp = Some(timestamp.into());
        self
    }
}

/// The answer to a claim. A duplicate is an *outcome*, not an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClaimOutcome {
    /// This transaction owns the key: do the work and commit.
    Claimed,
    /// The key's work has already been committed: roll back and ack.
    Duplicate,
    /// Someone else holds the key and has not finished (a live lease, or a lock that did
    /// not clear within the store's lock timeout): defer the delivery, never ack it.
    InProgress,
}

/// What a store can do, so callers (and the conformance suite) know which guarantees hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// Business writes and outbox rows can share the claim's transaction. Only such a
    /// store gives exactly-once *effect* on its own.
    pub transactional_writes: bool,
    /// [`ClaimTx::claim_batch`] is one round trip rather than a loop.
    pub native_batch_claims: bool,
    /// A committed claim survives a restart of the store (it is audit evidence).
    pub durable: bool,
}

impl Capabilities {
    /// A transactional, durable store with batch claims (Postgres, SQLite).
    pub const TRANSACTIONAL: Self = Self {
        transactional_writes: true,
        native_batch_claims: true,
        durable: true,
    };

    /// Builds a capability set.
    pub const fn new(transactional_writes: bool, native_batch_claims: bool, durable: bool) -> Self {
        Self {
            transactional_writes,
            native_batch_claims,
            durable,
        }
    }
}

/// A dedup store that opens claim transactions.
///
/// # Contract
/// - [`begin`](ClaimStore::begin) opens an independent transaction; transactions of one
///   store may run concurrently on different tasks.
/// - A store is cheap to share (`&self` methods); wrap it in an `Arc` or clone a pooled
///   handle to use it from several tasks.
/// - [`capabilities`](ClaimStore::capabilities) tells the truth: a store that cannot put
///   business writes in the claim's transaction says so.
#[async_trait]
pub trait ClaimStore: Send + Sync {
    /// The store's own transaction type: handlers write their business rows through it.
    type Tx: ClaimTx;

    /// Opens a transaction.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when no connection can be had (retryable).
    async fn begin(&self) -> Result<Self::Tx, StoreError>;

    /// What this store guarantees.
    fn capabilities(&self) -> Capabilities;
}

/// One claim transaction: claim, business writes and outbox rows commit together or not
/// at all.
///
/// # Contract
/// - Claiming a key nobody holds returns [`ClaimOutcome::Claimed`].
/// - Claiming a committed key returns [`ClaimOutcome::Duplicate`]; it must not error, and
///   it must not add a row.
/// - Claiming a key that another open transaction has claimed waits for that
///   transaction: `Duplicate` if it commits, `Claimed` if it rolls back. A store with a
///   lock timeout or a lease may answer [`ClaimOutcome::InProgress`] instead of waiting.
/// - Claiming the same key twice in one transaction returns `Duplicate` the second time.
/// - [`commit`](ClaimTx::commit) makes the claim and every write made through the
///   transaction durable at once. If it returns `Err`, the outcome may be unknown (the
///   connection died mid-commit): callers must not ack, and the redelivery will find out.
/// - [`rollback`](ClaimTx::rollback), an error inside the transaction, or dropping the
///   transaction without committing leaves no claim and no write behind: the key can be
///   claimed again.
/// - Errors carry [`StoreError::is_retryable`].
#[async_trait]
pub trait ClaimTx: Send {
    /// Claims one key.
    async fn claim(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError>;

    /// Claims several keys, returning one outcome per input, in input order.
    ///
    /// The same rules as [`claim`](ClaimTx::claim) apply to each key; a key repeated in
    /// `items` is `Claimed` at its first position and `Duplicate` after. Stores that can
    /// do it in one round trip override this default, which claims one by one.
    async fn claim_batch(
        &mut self,
        items: &[(IdempotencyKey, ClaimMeta)],
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        for (key, meta) in items {
            out.push(self.claim(key, meta).await?);
        }
        Ok(out)
    }

    /// Commits the claim and every write made through this transaction.
    async fn commit(self) -> Result<(), StoreError>
    where
        Self: Sized;

    /// Rolls everything back; the claimed keys can be claimed again.
    async fn rollback(self) -> Result<(), StoreError>
    where
        Self: Sized;
}

/// A transaction that can write outbox events alongside the claim.
///
/// # Contract
/// - An enqueued event becomes visible to the relay only when the transaction commits,
///   and vanishes with a rollback.
/// - Enqueuing the same [`OutboxEvent::event_id`] twice in one transaction stores it once.
#[async_trait]
pub trait OutboxWriter: Send {
    /// Stages an event in this transaction.
    async fn enqueue(&mut self, event: &OutboxEvent) -> Result<(), StoreError>;
}
