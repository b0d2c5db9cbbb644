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
    ///
    /// With [`record_identity`](ClaimMeta::record_identity), the subject and this
    /// timestamp are the submission's *identity*: a store that
    /// [detects conflicts](Capabilities::detects_conflicts) answers
    /// [`ClaimOutcome::Conflict`] when another key already claimed the same identity (the
    /// same submission with a different payload).
    pub submission_timestamp: Option<String>,
    /// Whether the claim records the identity (subject + submission timestamp) and checks
    /// it for conflicts. True by default; it has an effect only with a
    /// [`submission_timestamp`](ClaimMeta::submission_timestamp). The gate's
    /// `ConflictPolicy::Process` re-claims a
    /// conflicting submission with it cleared ([`ClaimMeta::without_identity`]): the
    /// claim is then recorded like a reference consumer's (identity columns left NULL),
    /// while a partitioned store still files it by its timestamp.
    pub record_identity: bool,
}

impl ClaimMeta {
    /// Metadata for a claim on behalf of `subject`, without a submission timestamp.
    pub fn new(subject: impl Into<String>) -> Self {
        Self {
            subject: subject.into(),
            submission_timestamp: None,
            record_identity: true,
        }
    }

    /// The same metadata without the identity check ([`record_identity`](ClaimMeta::record_identity)
    /// cleared); the submission timestamp is kept (a partitioned store files the claim by it).
    ///
    /// ```
    /// use idem_core::ClaimMeta;
    /// let meta = ClaimMeta::new("A-1").with_submission_timestamp("2026-07-01T09:00:00Z");
    /// assert_eq!(meta.identity(), Some(("A-1", "2026-07-01T09:00:00Z")));
    /// assert_eq!(meta.without_identity().identity(), None);
    /// ```
    #[must_use]
    pub fn without_identity(mut self) -> Self {
        self.record_identity = false;
        self
    }

    /// The identity this claim records and checks, `(subject, submission timestamp)`:
    /// `None` without a timestamp or with [`record_identity`](ClaimMeta::record_identity)
    /// cleared.
    pub fn identity(&self) -> Option<(&str, &str)> {
        match (&self.submission_timestamp, self.record_identity) {
            (Some(ts), true) => Some((self.subject.as_str(), ts.as_str())),
            _ => None,
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

/// The order in which a batch's claims take their locks: by
/// [identity](ClaimMeta::identity) (claims without one first); claims of one identity in
/// arrival order (their positions in `items`), claims without an identity by key; each
/// key once (its first position). Returns positions in `items`.
///
/// **The first delivered wins.** Of two payloads of one submission (the same subject and
/// timestamp, another key), the one delivered first is claimed first, so it is the one
/// that takes effect, and the later one is the [conflict](ClaimOutcome::Conflict) that is
/// dead-lettered — never the other way round, whatever the keys' order.
///
/// Two transactions that claim in this order can never wait on each other in a cycle: a
/// claim waits only on an uncommitted row with the same key or the same identity, a key
/// always comes with the same identity, and both transactions meet shared identities in
/// the same order. Within one identity the order does not matter for locks: a
/// transaction's first claim of an identity holds it, and its later claims of that
/// identity meet its own row (a conflict) without waiting on anyone. Sorting by key alone
/// is not enough once identities are checked: two batches holding different payloads of
/// the same two submissions could each lock one identity and wait for the other's (the
/// stores break such a deadlock, but only after their deadlock timeout, and the batch
/// then falls back to one claim at a time). The gate claims batches in this order, and a
/// store that inserts a batch in one statement keeps it.
///
/// ```
/// use idem_core::{claim_order, ClaimMeta, IdempotencyKey};
/// let ts = "2026-07-01T09:00:00Z";
/// let item = |award: &str, body: &str| {
///     let key = IdempotencyKey::derive(award, ts, body.as_bytes()).unwrap();
///     (key, ClaimMeta::new(award).with_submission_timestamp(ts))
/// };
/// let items = [item("B", "1"), item("A", "2"), item("A", "1"), item("B", "1")];
/// let order = claim_order(&items);
/// // A's two payloads first, in the order they arrived, then B once.
/// assert_eq!(order, vec![1, 2, 0]);
/// ```
pub fn claim_order(items: &[(IdempotencyKey, ClaimMeta)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    // Stable: claims of one identity keep their arrival order, and among equal keys the
    // first position stays first.
    order.sort_by(|&a, &b| {
        let (ia, ib) = (items[a].1.identity(), items[b].1.identity());
        ia.cmp(&ib).then_with(|| match ia {
            None => items[a].0.as_bytes().cmp(items[b].0.as_bytes()),
            Some(_) => std::cmp::Ordering::Equal,
        })
    });
    let mut seen = std::collections::HashSet::with_capacity(items.len());
    order.retain(|&i| seen.insert(items[i].0));
    order
}

/// The answer to a claim. A duplicate (or a conflict) is an *outcome*, not an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClaimOutcome {
    /// This transaction owns the key: do the work and commit.
    Claimed,
    /// The key's work has already been committed: roll back and ack.
    Duplicate,
    /// Someone else holds the key and has not finished (a live lease, or a lock that did
    /// not clear within the store's lock timeout): defer the delivery, never ack it.
    InProgress,
    /// The key is new, but its identity ([`ClaimMeta::identity`]: the same subject and
    /// submission timestamp) is already claimed under another key, `existing`: the same
    /// submission sent again with a different payload. Nothing was claimed; the gate
    /// applies the pipeline's `ConflictPolicy`.
    Conflict {
        /// The key that claimed the identity first.
        existing: IdempotencyKey,
    },
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
    /// Claims record the submission's identity and answer [`ClaimOutcome::Conflict`] for
    /// a second key of one identity ([`ClaimMeta::identity`]). A store without it never
    /// answers `Conflict`: a resubmission with a different payload is processed again.
    pub detects_conflicts: bool,
}

impl Capabilities {
    /// A transactional, durable store with batch claims that detects conflicts
    /// (Postgres, SQLite).
    pub const TRANSACTIONAL: Self = Self {
        transactional_writes: true,
        native_batch_claims: true,
        durable: true,
        detects_conflicts: true,
    };

    /// Builds a capability set that does not detect conflicts (see
    /// [`with_conflict_detection`](Capabilities::with_conflict_detection)).
    pub const fn new(transactional_writes: bool, native_batch_claims: bool, durable: bool) -> Self {
        Self {
            transactional_writes,
            native_batch_claims,
            durable,
            detects_conflicts: false,
        }
    }

    /// Sets [`detects_conflicts`](Capabilities::detects_conflicts).
    #[must_use]
    pub const fn with_conflict_detection(mut self, detects: bool) -> Self {
        self.detects_conflicts = detects;
        self
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

    /// Keeps the durable count of a key's *reruns*: the runs of its handler on a
    /// delivery that came again because no earlier delivery settled (the process that
    /// held it died, or its attempt failed). The gate records each rerun before it runs
    /// the handler (`GateConfig::check_attempts_before_handler`), so a message that
    /// kills its process every time it runs (an OOM kill, an abort in a native library)
    /// is dead-lettered unrun once its runs reach the limit, while a message that only
    /// sat in the dying process's buffer is not charged for a run it never had.
    ///
    /// # Contract
    /// - [`RunNote::Started`] adds one to the key's count and returns the new count;
    ///   the count is durable (committed, outside any claim transaction) before this
    ///   returns, so a process killed right after still leaves it. It must not wait for
    ///   a claim transaction of the calling task (the gate calls it with none open).
    /// - [`RunNote::NotRun`] takes back one count whose handler did not run (the claim
    ///   found a duplicate, a conflict or a key in progress); never below zero.
    /// - [`RunNote::Settled`] forgets the key's count (its delivery committed, or its
    ///   handler rejected it). Best effort: a count left behind only matters for a key
    ///   that is claimed again, which a committed key never is. A key dead-lettered unrun
    ///   keeps its count, so a copy of its message still in flight elsewhere is
    ///   dead-lettered unrun too.
    /// - A store that keeps no such count returns `Ok(None)` for every note (the
    ///   default): the gate then runs every rerun, and only the failures it sees count.
    ///
    /// # Errors
    /// [`StoreError`] from the store (the gate then runs the handler without the check,
    /// rather than hold the delivery).
    ///
    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: RunNote,
    ) -> Result<Option<u32>, StoreError> {
        let _ = (key, note);
        Ok(None)
    }

    /// The store's own evidence that it works: a small write of its own that must commit
    /// within a bound the store sets. The gate calls it after a delivery failed on the
    /// store's side (a timeout, a broken connection, a serialization failure, a handler
    /// past its deadline) and only counts the failure against the message when the probe
    /// commits: a store that is down, read-only, out of space or slow for everyone fails
    /// its probe too, and then no message is charged.
    ///
    /// # Contract
    /// - `Ok(())` only when a write committed durably through the same server the claims
    ///   go to, just now (never a cached answer).
    /// - Bounded: it returns within a few seconds whatever the server does (a dead
    ///   network path, a lock, a slow flush), answering `Err` when it could not finish.
    /// - It needs no message and touches no business table; it must not wait for a claim
    ///   transaction of the calling task (the gate calls it with none open).
    ///
    /// The default opens a transaction and commits it ([`begin`](ClaimStore::begin) then
    /// [`ClaimTx::commit`]): a store that can write something cheaper and more telling
    /// (Postgres assigns a transaction id, which a read-only node refuses, and flushes its
    /// commit) overrides it.
    ///
    /// # Errors
    /// The [`StoreError`] that stopped the probe.
    async fn probe(&self) -> Result<(), StoreError> {
        self.begin().await?.commit().await
    }
}

/// What [`ClaimStore::note_run`] records of a key's rerun.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunNote {
    /// The handler is about to run again: add one to the key's count.
    Started,
    /// A counted rerun did not run its handler after all: take its count back.
    NotRun,
    /// The key's delivery settled (committed, or dead-lettered): forget its count.
    Settled,
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
/// - A store that [detects conflicts](Capabilities::detects_conflicts): claiming a new key
///   whose [`ClaimMeta::identity`] is already claimed under another key returns
///   [`ClaimOutcome::Conflict`] with that key and claims nothing (a committed identity, or
///   one claimed earlier in this transaction; an identity held by another open
///   transaction is waited for like a key). A key already claimed is `Duplicate`, whatever
///   its identity. Two concurrent claims of one identity under different keys never both
///   succeed. Claims with no identity (no timestamp, or
///   [`ClaimMeta::without_identity`]) are never in conflict.
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
    /// `items` is `Claimed` at its first position and `Duplicate` after, and of two keys
    /// of one identity in `items` one is `Claimed` and the other a `Conflict` naming it.
    /// Stores that can
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

    /// Records, in this transaction, where its deliveries stand in their logs
    /// ([`crate::position`]): each partition's row moves by
    /// [`advance`](crate::position::advance), at the move's epoch only. The gate calls it
    /// just before [`commit`](ClaimTx::commit) with the positions of the transaction's
    /// settled deliveries.
    ///
    /// # Errors
    /// [`StoreError::Fenced`] when a partition's row is at another epoch (the partition
    /// was taken by another member): the transaction must then be rolled back. The
    /// default, for a store that keeps no positions, refuses any move with
    /// [`StoreError::Config`].
    async fn advance_positions(
        &mut self,
        moves: &[crate::position::PositionMove],
    ) -> Result<(), StoreError> {
        if moves.is_empty() {
            Ok(())
        } else {
            Err(StoreError::Config(
                "this store keeps no log positions (use the Postgres or SQLite store)".into(),
            ))
        }
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
/// - The event's [`traceparent`](OutboxEvent::traceparent) is stored with it, and the
///   store's [`OutboxSource`](crate::OutboxSource) gives it back, so the relay publishes
///   it (see [`crate::trace`]).
#[async_trait]
pub trait OutboxWriter: Send {
    /// Stages an event in this transaction.
    async fn enqueue(&mut self, event: &OutboxEvent) -> Result<(), StoreError>;
}
