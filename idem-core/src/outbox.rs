//! The transactional outbox: events written in the claim's transaction and published
//! at least once by a [`Relay`], each with a deterministic [`EventId`] so the next
//! consumer dedups the same way.

use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use sha2::{Digest, Sha256};

use crate::error::{Error, KeyError, PublishError, StoreError};
use crate::key::{hex_lower, parse_hex32, IdempotencyKey};

/// A deterministic event id: `sha256("idem-event-v1|" + key_hex + "|" + event_type)`.
///
/// A relay that republishes after a crash sends the same id, so a downstream consumer
/// (or the broker's own dedup window, such as JetStream's `Nats-Msg-Id`) drops the copy.
///
/// ```
/// use idem_core::{EventId, IdempotencyKey};
/// let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}")?;
/// assert_eq!(EventId::derive(&key, "disbursement.recorded"), EventId::derive(&key, "disbursement.recorded"));
/// assert_ne!(EventId::derive(&key, "disbursement.recorded"), EventId::derive(&key, "other"));
/// # Ok::<(), idem_core::KeyError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId([u8; 32]);

impl EventId {
    /// Derives the id of the event of type `event_type` caused by the submission `key`.
    pub fn derive(key: &IdempotencyKey, event_type: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"idem-event-v1|");
        h.update(key.to_hex().as_bytes());
        h.update(b"|");
        h.update(event_type.as_bytes());
        Self(h.finalize().into())
    }

    /// The raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex_lower(&self.0))
    }
}

impl fmt::Debug for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EventId({})", &hex_lower(&self.0)[..12])
    }
}

impl FromStr for EventId {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_hex32(s).map(Self).ok_or(KeyError::InvalidHex)
    }
}

/// The name of the header (or message attribute) that carries an event's id.
pub const EVENT_ID_HEADER: &str = "idem-event-id";
/// The name of the header that carries an event's type.
pub const EVENT_TYPE_HEADER: &str = "idem-event-type";

/// An event to publish once its transaction commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// Deterministic id (see [`EventId`]).
    pub event_id: EventId,
    /// The event's type, for example `disbursement.recorded`.
    pub event_type: String,
    /// The business id the event is about; events of one subject are published in order
    /// (brokers with partitions use it as the message key).
    pub subject: String,
    /// The key of the submission that caused it.
    pub idempotency_key: IdempotencyKey,
    /// The body to publish (JSON for the grant pipeline).
    pub payload: Vec<u8>,
}

impl OutboxEvent {
    /// A new event; its id is derived from `key` and `event_type`.
    pub fn new(
        key: IdempotencyKey,
        event_type: impl Into<String>,
        subject: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        let event_type = event_type.into();
        Self {
            event_id: EventId::derive(&key, &event_type),
            event_type,
            subject: subject.into(),
            idempotency_key: key,
            payload: payload.into(),
        }
    }

    /// The headers every adapter sends with the event.
    pub fn headers(&self) -> Vec<(String, String)> {
        vec![
            (EVENT_ID_HEADER.to_owned(), self.event_id.to_string()),
            (EVENT_TYPE_HEADER.to_owned(), self.event_type.clone()),
        ]
    }
}

/// Publishes outbox events to a broker.
///
/// # Contract
/// - [`publish`](Publisher::publish) returns `Ok` only once the broker has confirmed every
///   event durably (publisher confirms, a JetStream ack, a stored SQS message).
/// - Events are published in slice order; events of one subject must not be reordered.
/// - Each event carries its id in the [`EVENT_ID_HEADER`] header (and in the broker's own
///   dedup field where it has one).
/// - Publishing is at least once: an `Err` may still have published some events, which
///   the relay will send again with the same ids.
#[async_trait]
pub trait Publisher: Send + Sync {
    /// Publishes `events` and waits for the broker's confirmation.
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError>;
}

/// A batch of unpublished outbox rows, locked for this relay until it is marked or
/// released.
///
/// # Contract
/// - While a batch is held, no other relay receives any of its rows.
/// - [`mark_published`](OutboxBatch::mark_published) records the rows as published and
///   releases them, atomically.
/// - [`release`](OutboxBatch::release), or dropping the batch, leaves the rows
///   unpublished for the next relay.
#[async_trait]
pub trait OutboxBatch: Send {
    /// The events, in publication order.
    fn events(&self) -> &[OutboxEvent];

    /// Marks every event of the batch as published.
    async fn mark_published(self) -> Result<(), StoreError>
    where
        Self: Sized;

    /// Gives the rows back unpublished.
    async fn release(self) -> Result<(), StoreError>
    where
        Self: Sized;
}

/// Where a relay finds unpublished events.
///
/// # Contract
/// - [`lease`](OutboxSource::lease) returns at most `max` of the oldest unpublished events
///   that no other relay holds, and never two events of one subject out of order: an event
///   is leased only when every earlier event of its subject is published or in the same
///   batch before it.
/// - [`wait`](OutboxSource::wait) returns when new events may be there (a notification
///   or a polling interval), so an idle relay does not spin.
#[async_trait]
pub trait OutboxSource: Send + Sync {
    /// The locked batch type.
    type Batch: OutboxBatch;

    /// Leases up to `max` events.
    async fn lease(&self, max: usize) -> Result<Self::Batch, StoreError>;

    /// Waits until new events may be there.
    async fn wait(&self) -> Result<(), StoreError>;

    /// How many events are committed but not yet published, and how old the oldest of
    /// them is: the relay's lag, for monitoring (`idem relay --metrics-addr`).
    async fn backlog(&self) -> Result<OutboxBacklog, StoreError>;
}

/// The unpublished part of an outbox (see [`OutboxSource::backlog`]).
///
/// A backlog that keeps growing, or an oldest event that keeps ageing, means no relay is
/// keeping up: events are safe in the store, but downstream does not see them yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxBacklog {
    /// Committed events not yet marked published (including ones a relay holds now).
    pub pending: u64,
    /// How long ago the oldest of them was committed; `None` when nothing is pending.
    pub oldest_age: Option<Duration>,
}

/// Counts of a relay run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Events published and marked.
    pub published: u64,
    /// Batches that failed to publish and were released for another try.
    pub failed_batches: u64,
}

/// Moves committed outbox events to a broker: lease a batch, publish it (waiting for the
/// broker's confirmation), mark it published. A crash between publishing and marking
/// republishes the batch with the same event ids: at least once, deduplicated downstream.
#[derive(Debug)]
pub struct Relay<S, P> {
    source: S,
    publisher: P,
    batch_size: usize,
}

impl<S: OutboxSource, P: Publisher> Relay<S, P> {
    /// A relay that moves up to `batch_size` events per transaction.
    pub fn new(source: S, publisher: P, batch_size: usize) -> Self {
        Self {
            source,
            publisher,
            batch_size: batch_size.max(1),
        }
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The publisher.
    pub fn publisher(&self) -> &P {
        &self.publisher
    }

    /// Publishes one batch; returns how many events it published (0 when none waited).
    ///
    /// # Errors
    /// A store error leasing or marking, or the publisher's error (the batch is then
    /// released unmarked).
    pub async fn run_once(&self) -> Result<usize, Error> {
        let batch = self.source.lease(self.batch_size).await?;
        let n = batch.events().len();
        if n == 0 {
            batch.release().await?;
            return Ok(0);
        }
        if let Err(e) = self.publisher.publish(batch.events()).await {
            // Release explicitly; if that fails too, dropping the batch releases it.
            let _ = batch.release().await;
            return Err(e.into());
        }
        batch.mark_published().await?;
        tracing::debug!(target: "idem::relay", published = n, "outbox batch published");
        Ok(n)
    }

    /// Runs until `shutdown` completes (finishing the batch in hand) or a non-retryable
    /// error. Retryable errors are counted and the relay waits before the next try.
    ///
    /// # Errors
    /// The first non-retryable error.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<RelayStats, Error> {
        let mut stats = RelayStats::default();
        let shutdown = shutdown.fuse();
        futures::pin_mut!(shutdown);
        loop {
            if (&mut shutdown).now_or_never().is_some() {
                return Ok(stats);
            }
            match self.run_once().await {
                Ok(0) => {
                    let wait = self.source.wait().fuse();
                    futures::pin_mut!(wait);
                    futures::select! {
                        () = shutdown => return Ok(stats),
                        r = wait => r?,
                    }
                }
                Ok(n) => stats.published += n as u64,
                Err(e) if e.is_retryable() => {
                    stats.failed_batches += 1;
                    tracing::warn!(target: "idem::relay", error = %e, "relay batch failed; will retry");
                    self.source.wait().await?;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
