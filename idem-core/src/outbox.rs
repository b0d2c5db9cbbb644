//! The transactional outbox: events written in the claim's transaction and published
//! at least once by a relay (`idem-engine`'s `Relay`), each with a deterministic [`EventId`] so the next
//! consumer dedups the same way.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sha2::{Digest, Sha256};

use crate::error::{KeyError, PublishError, StoreError};
use crate::key::{hex_lower, parse_hex32, IdempotencyKey};
use crate::trace::{TraceParent, TRACEPARENT_HEADER};

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
    /// The W3C trace context the event is published with (the `traceparent` header):
    /// the trace of the delivery that caused it, with that delivery's span as parent.
    /// [`OutboxEvent::new`] fills it in while the `Gate` runs a handler
    /// for a traced delivery (see [`crate::trace`]); stores keep it in the outbox row.
    pub traceparent: Option<TraceParent>,
}

impl OutboxEvent {
    /// A new event; its id is derived from `key` and `event_type`. Inside a handler the
    /// gate runs for a traced delivery, the event gets that delivery's trace context
    /// ([`crate::trace::current`]); elsewhere it has none.
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
            traceparent: crate::trace::current(&key),
            idempotency_key: key,
            payload: payload.into(),
        }
    }

    /// The same event with the trace context `traceparent` (stores use it when they read
    /// a row back; a handler may override what [`new`](OutboxEvent::new) found).
    #[must_use]
    pub fn with_traceparent(mut self, traceparent: Option<TraceParent>) -> Self {
        self.traceparent = traceparent;
        self
    }

    /// The headers every adapter sends with the event: its id, its type, and its
    /// `traceparent` when it has one.
    pub fn headers(&self) -> Vec<(String, String)> {
        let mut h = Vec::with_capacity(3);
        h.push((EVENT_ID_HEADER.to_owned(), self.event_id.to_string()));
        h.push((EVENT_TYPE_HEADER.to_owned(), self.event_type.clone()));
        if let Some(tp) = &self.traceparent {
            h.push((TRACEPARENT_HEADER.to_owned(), tp.to_string()));
        }
        h
    }
}

/// Why an outbox row that a store read back is not an event a relay can publish: a
/// column that does not parse (a row written by another program, or edited by hand).
///
/// A store's [`OutboxSource`] moves such a row aside with this reason, as it does an
/// event the broker refuses for good (see [`OutboxBatch::record_failure`]): listed and
/// counted for an operator, never published as it is, and no longer in the way of the
/// events behind it. Failing every lease on it instead would stop the whole outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidStoredEvent {
    /// The column whose value does not parse: `event_id` or `idempotency_key`.
    pub column: &'static str,
}

impl fmt::Display for InvalidStoredEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "not a valid event: its {} is not 64 hex digits (fix the row, then requeue it)",
            self.column
        )
    }
}

impl std::error::Error for InvalidStoredEvent {}

impl OutboxEvent {
    /// An event read back from a store's outbox columns: both ids parsed; a stored
    /// `traceparent` that is not a valid W3C `traceparent` is dropped (the event is
    /// published untraced), never an error.
    ///
    /// ```
    /// use idem_core::{IdempotencyKey, OutboxEvent};
    /// let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}")?;
    /// let ev = OutboxEvent::new(key, "disbursement.recorded", "A-1", "{}");
    /// let back = OutboxEvent::from_stored(
    ///     &ev.event_id.to_string(), ev.event_type.clone(), ev.subject.clone(),
    ///     &key.to_hex(), ev.payload.clone(), Some("not a traceparent"),
    /// )?;
    /// assert_eq!(back, ev.clone().with_traceparent(None));
    /// let bad = OutboxEvent::from_stored("x", ev.event_type, ev.subject, &key.to_hex(), ev.payload, None);
    /// assert_eq!(bad.unwrap_err().column, "event_id");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`InvalidStoredEvent`] naming the first id column that does not parse.
    pub fn from_stored(
        event_id: &str,
        event_type: String,
        subject: String,
        idempotency_key: &str,
        payload: Vec<u8>,
        traceparent: Option<&str>,
    ) -> Result<Self, InvalidStoredEvent> {
        let invalid = |column| InvalidStoredEvent { column };
        Ok(Self {
            event_id: event_id.parse().map_err(|_| invalid("event_id"))?,
            event_type,
            subject,
            idempotency_key: idempotency_key
                .parse()
                .map_err(|_| invalid("idempotency_key"))?,
            payload,
            traceparent: traceparent.and_then(|t| TraceParent::parse(t).ok()),
        })
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

    /// Records that the broker refused the batch's events for good (`reason`: the
    /// publisher's error), and releases them. Each event's count of such failures grows
    /// by one; an event whose count reaches `max_attempts` is **moved aside**: never
    /// leased again, kept with its last error for an operator (and counted by
    /// [`OutboxSource::moved_aside`]), so that it no longer holds back the outbox's head.
    /// Returns how many events were moved aside.
    ///
    /// The relay calls it with one-event batches only, so a failure is charged to the
    /// event that caused it. The default keeps no count: it releases the batch and
    /// returns 0 (the event will be retried forever).
    async fn record_failure(self, reason: &str, max_attempts: u32) -> Result<u64, StoreError>
    where
        Self: Sized,
    {
        let _ = (reason, max_attempts);
        self.release().await.map(|()| 0)
    }
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

    /// How many events were moved aside after failing to publish (see
    /// [`OutboxBatch::record_failure`]): they wait for an operator, not for a relay.
    /// The default (a source that moves nothing aside) is 0.
    async fn moved_aside(&self) -> Result<u64, StoreError> {
        Ok(0)
    }
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

/// An outbox event moved aside after the broker refused it
/// the relay's `max_publish_attempts` times (see [`OutboxBatch::record_failure`]):
/// what each SQL store lists for an operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovedAside {
    /// The event's id (64 hex).
    pub event_id: String,
    /// Its subject.
    pub subject: String,
    /// How many times the broker refused it.
    pub attempts: u32,
    /// The broker's last refusal.
    pub last_error: String,
    /// When it was moved aside (UTC, RFC 3339).
    pub failed_at: String,
}
