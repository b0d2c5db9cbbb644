//! Deliveries and their settlement: [`Delivery`], [`Acker`] and the proof of commit.

use std::time::Duration;

use async_trait::async_trait;

use crate::error::{AckError, RejectReason, StoreError};
use crate::key::IdempotencyKey;
use crate::store::{ClaimOutcome, ClaimTx};

/// A message's headers, in the broker's order.
pub type Headers = Vec<(String, String)>;

/// One delivery from an at-least-once broker.
#[derive(Debug)]
pub struct Delivery<A> {
    /// The message body, exactly as delivered (the key is derived from these bytes).
    pub payload: Vec<u8>,
    /// The broker's headers or attributes.
    pub headers: Headers,
    /// Which delivery of this message this is, counted from 1, as the broker knows it
    /// (NATS `num_delivered`, RabbitMQ quorum `x-delivery-count` + 1, SQS
    /// `ApproximateReceiveCount`, the Redis pending entry's delivery count, Kafka counted per
    /// offset). `None` when the broker keeps no count: the consumer counts then.
    /// The gate dead-letters a delivery whose attempt reaches
    /// `GateConfig::max_attempts` after a failure (and,
    /// where asked, one past it before its handler runs:
    /// `GateConfig::check_attempts_before_handler`).
    pub attempt: Option<u32>,
    /// Settles the delivery. Only the gate uses it.
    pub acker: A,
}

impl<A> Delivery<A> {
    /// A delivery with no headers.
    pub fn new(payload: impl Into<Vec<u8>>, acker: A) -> Self {
        Self {
            payload: payload.into(),
            headers: Vec::new(),
            attempt: None,
            acker,
        }
    }

    /// Sets the attempt number the broker reported (1 for a first delivery).
    #[must_use]
    pub fn with_attempt(mut self, attempt: u32) -> Self {
        self.attempt = Some(attempt);
        self
    }

    /// Sets the headers.
    #[must_use]
    pub fn with_headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// Dead-letters this delivery (its own payload and headers) with `reason`.
    ///
    /// # Errors
    /// The acker's [`AckError`]; the delivery then stays in its source.
    pub async fn dead_letter(self, reason: &RejectReason) -> Result<(), AckError>
    where
        A: Acker,
    {
        let Delivery {
            payload,
            headers,
            acker,
            ..
        } = self;
        acker.dead_letter(&payload, &headers, reason).await
    }

    /// The first header named `name` (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Why acking is allowed: the work was committed, or it had been committed before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckReason {
    /// This delivery's transaction committed.
    Committed,
    /// The key had already been committed (a duplicate claim).
    Duplicate,
}

/// Permission to ack one delivery. Outside this crate a proof cannot be made from parts:
/// it comes from a commit that succeeded ([`commit`] returns the [`CommitReceipt`] that
/// [`AckProof::committed`] needs) or from a claim that answered
/// [`ClaimOutcome::Duplicate`] ([`AckProof::duplicate`]). An engine that acks therefore
/// acks after a commit or a duplicate claim, and "ack before commit" is a compile error
/// rather than a code-review finding:
///
/// ```compile_fail
/// use idem_core::AckProof;
/// // There is no public constructor: a proof cannot be made from its parts.
/// let proof = AckProof { key: todo!(), reason: idem_core::AckReason::Committed };
/// ```
#[derive(Debug)]
pub struct AckProof {
    key: IdempotencyKey,
    reason: AckReason,
}

impl AckProof {
    /// The delivery of `key` was committed by the transaction whose commit gave `receipt`.
    pub fn committed(receipt: &CommitReceipt, key: IdempotencyKey) -> Self {
        let _ = receipt;
        Self {
            key,
            reason: AckReason::Committed,
        }
    }

    /// The delivery of `key` needed no write of its own in the transaction whose commit
    /// gave `receipt`: its claim there answered `Duplicate`, or another copy of it in the
    /// same transaction (a batch) was the one processed.
    pub fn duplicate_within(receipt: &CommitReceipt, key: IdempotencyKey) -> Self {
        let _ = receipt;
        Self {
            key,
            reason: AckReason::Duplicate,
        }
    }

    /// The claim of `key` answered `claim`: a proof when that is
    /// [`ClaimOutcome::Duplicate`] (the key was committed before), `None` otherwise.
    pub fn duplicate(key: IdempotencyKey, claim: ClaimOutcome) -> Option<Self> {
        (claim == ClaimOutcome::Duplicate).then_some(Self {
            key,
            reason: AckReason::Duplicate,
        })
    }

    /// The key this proof covers.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// Why acking is allowed.
    pub fn reason(&self) -> AckReason {
        self.reason
    }
}

/// Evidence that a claim transaction committed: only [`commit`] makes one, and
/// [`AckProof`]s for the transaction's deliveries are minted from it.
#[derive(Debug)]
pub struct CommitReceipt(());

/// Commits `tx` and, when the commit succeeded, returns the receipt that acks of its
/// deliveries need ([`AckProof::committed`]).
///
/// # Errors
/// The commit's [`StoreError`]. The outcome of a failed commit may be unknown: its
/// deliveries must not be acked (a redelivery finds out through its claim).
pub async fn commit<T: ClaimTx>(tx: T) -> Result<CommitReceipt, StoreError> {
    tx.commit().await?;
    Ok(CommitReceipt(()))
}

/// Settles a delivery with its broker.
///
/// # Contract
/// - Each method consumes the acker: a delivery is settled once.
/// - [`ack`](Acker::ack) removes the delivery from the broker for good. It needs an
///   [`AckProof`], which only a commit or a duplicate claim produces.
/// - [`nack`](Acker::nack) hands the delivery back for redelivery, after `delay` where the
///   broker supports one (otherwise at once, or after its visibility timeout).
/// - [`dead_letter`](Acker::dead_letter) moves the delivery to the dead-letter place with
///   the reason (durably) and then removes it from the source; if it fails, the delivery
///   must stay in the source (it is redelivered and rejected again, never lost).
/// - An acker dropped without being settled leaves the delivery unacked: the broker
///   redelivers it (after its visibility timeout or when the connection closes).
/// - An `Err` from `ack` after a commit is harmless for correctness: the redelivery
///   derives the same key and is acked as a duplicate.
#[async_trait]
pub trait Acker: Send + 'static {
    /// Acknowledges the delivery.
    async fn ack(self, proof: AckProof) -> Result<(), AckError>;

    /// Returns the delivery for redelivery, after `delay` where supported.
    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError>;

    /// Returns the delivery to be processed again after `delay` because it was
    /// *deferred*, not because it failed: its key is held by another transaction
    /// ([`ClaimOutcome::InProgress`]). A deferral is not an
    /// attempt: an adapter whose broker counts redeliveries against a limit (NATS
    /// `max_deliver`, SQS `maxReceiveCount`, a quorum queue's delivery limit) should keep
    /// the delivery (alive, its visibility or lease extended) and hand it back without
    /// spending one, and without raising its attempt number, so that no broker limit ends
    /// a message the gate only waited on. The default is [`nack`](Acker::nack) with the
    /// delay.
    async fn defer(self, delay: Duration) -> Result<(), AckError>
    where
        Self: Sized,
    {
        self.nack(Some(delay)).await
    }

    /// Whether this delivery's [`attempt`](Delivery::attempt) counts only the runs of its
    /// message: deliveries that reached a gate and failed, or whose process died holding
    /// them (a crash, an OOM kill). True where [`defer`](Acker::defer) keeps the delivery
    /// without a redelivery, so neither a deferral nor a store outage (which the gate also
    /// settles with `defer`) raises the broker's count. The default is `false`.
    ///
    /// Only for such deliveries can the gate check the attempt *before* the handler
    /// (`GateConfig::check_attempts_before_handler`):
    /// a delivery past `GateConfig::max_attempts` that
    /// claims its key is rolled back and dead-lettered unrun, since its earlier runs
    /// never settled (it killed the process each time).
    fn attempt_counts_runs(&self) -> bool {
        false
    }

    /// Where this delivery stands in its log, when its source keeps positions in the
    /// store ([`crate::position`]): the gate hands it to the claim transaction
    /// ([`ClaimTx::advance_positions`]) before the
    /// commit. `None` (the default) records nothing.
    fn position(&self) -> Option<crate::position::PositionMove> {
        None
    }

    /// Dead-letters the delivery with `reason`. `payload` and `headers` are the delivery's
    /// own, for adapters that republish them.
    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError>;

    /// Acknowledges several deliveries of one batch. The default acks one by one
    /// ([`ack_each`](Acker::ack_each)); adapters override it with the broker's batch form
    /// (a multiple-ack, a batch delete).
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>>
    where
        Self: Sized,
    {
        Self::ack_each(items).await
    }

    /// Acknowledges the deliveries of `items` one by one, in order, each with its own
    /// [`ack`](Acker::ack): the default [`ack_all`](Acker::ack_all), and what a batch form
    /// falls back to for a batch it cannot settle in one operation (deliveries of two
    /// connections). Not meant to be overridden.
    async fn ack_each(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>>
    where
        Self: Sized,
    {
        let mut out = Vec::with_capacity(items.len());
        for (acker, proof) in items {
            out.push(acker.ack(proof).await);
        }
        out
    }
}
