//! The transactional outbox: events written in the claim's transaction and published
//! at least once by a [`Relay`], each with a deterministic [`EventId`] so the next
//! consumer dedups the same way.

use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::future::BoxFuture;
use futures::FutureExt;
use sha2::{Digest, Sha256};

use crate::backoff;
use crate::error::{Error, KeyError, PublishError, StoreError};
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
    /// [`OutboxEvent::new`] fills it in while the [`Gate`](crate::Gate) runs a handler
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
    /// The [`Relay`] calls it with one-event batches only, so a failure is charged to the
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
/// [`RelayOptions::max_publish_attempts`] times (see [`OutboxBatch::record_failure`]):
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

/// Counts of a relay run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Events published and marked.
    pub published: u64,
    /// Batches published and marked.
    pub batches: u64,
    /// Batches that failed to publish (or to lease or mark) and were released for
    /// another try.
    pub failed_batches: u64,
    /// Events moved aside after the broker refused them `max_publish_attempts` times.
    pub moved_aside: u64,
}

/// A growing, capped, jittered delay ("equal jitter"): attempt `n` (from 1) waits a
/// random time in `[d/2, d]` where `d = min(initial × 2^(n-1), max)`. Built on `backon`'s
/// exponential backoff, which doubles in `f32` seconds: `d` can differ from the exact
/// double by a few parts in ten million; `max` is exact and never exceeded.
///
/// ```
/// use std::time::Duration;
/// use idem_core::outbox::Backoff;
/// let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
/// assert_eq!(b.ceiling(1), Duration::from_millis(100));
/// assert_eq!(b.ceiling(4).as_micros(), 800_000);
/// assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(5));
/// let d = b.delay(4);
/// assert!(d >= Duration::from_millis(400) && d <= b.ceiling(4));
/// // Or the whole sequence, attempt 1, 2, …, drawn once.
/// assert!(b.delays().take(10).all(|d| d <= Duration::from_secs(5)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first attempt's ceiling.
    pub initial: Duration,
    /// The largest ceiling.
    pub max: Duration,
}

impl Default for Backoff {
    /// 100 ms, doubling up to 5 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

impl Backoff {
    /// A backoff from `initial`, doubling up to `max`.
    pub const fn new(initial: Duration, max: Duration) -> Self {
        Self { initial, max }
    }

    /// The ceiling of attempt `attempt` (from 1), before jitter.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        backoff::nth(backoff::ceilings(self.initial, self.max), attempt)
    }

    /// The delay before attempt `attempt` (from 1): a random time in `[c/2, c]`,
    /// `c` = [`ceiling`](Self::ceiling).
    pub fn delay(&self, attempt: u32) -> Duration {
        backoff::nth(self.delays(), attempt)
    }

    /// The delays of attempts 1, 2, … (endless), each drawn as [`delay`](Self::delay)
    /// draws it: what a retry loop consumes one failure at a time.
    pub fn delays(&self) -> impl Iterator<Item = Duration> + Send + Sync + Unpin {
        backoff::jittered(self.initial, self.max, None)
    }
}

/// A timer: returns a future that completes after the given time. `idem-core` has no
/// runtime; the caller passes its own (`idem-runtime` gives tokio's).
pub type Sleep = Arc<dyn Fn(Duration) -> BoxFuture<'static, ()> + Send + Sync>;

/// What a [`Relay`] reports as it runs, for metrics. Every method has an empty default.
pub trait RelayObserver: Send + Sync {
    /// A batch of `events` events was published and marked.
    fn published(&self, events: usize) {
        let _ = events;
    }
    /// A batch failed (leasing, publishing or marking); the next try is in `retry_in`.
    fn failed(&self, error: &Error, retry_in: Duration) {
        let _ = (error, retry_in);
    }
    /// `events` events were moved aside after failing to publish, the last time with
    /// `reason`.
    fn moved_aside(&self, events: u64, reason: &str) {
        let _ = (events, reason);
    }
}

/// How a [`Relay`] runs: batch size, backoff, idle exit, give-up deadline, the poison
/// event limit, the timer and the observer.
///
/// ```
/// use std::time::Duration;
/// use idem_core::outbox::RelayOptions;
/// let options = RelayOptions::default()
///     .batch_size(500)
///     .exit_when_idle(Some(Duration::from_secs(5)))
///     .give_up_after(Some(Duration::from_secs(60)));
/// assert_eq!(options.max_publish_attempts, 5);
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct RelayOptions {
    /// Events per lease (at least 1; default 100).
    pub batch_size: usize,
    /// The delay between failed tries (default 100 ms doubling to 5 s, jittered).
    pub backoff: Backoff,
    /// Return once no event was waiting for this long (default: never).
    pub exit_when_idle: Option<Duration>,
    /// Return the last error once every try has failed for this long (default: never).
    pub give_up_after: Option<Duration>,
    /// An event the broker refuses for good this many times is moved aside
    /// ([`OutboxBatch::record_failure`]; default 5).
    pub max_publish_attempts: u32,
    /// Batches in flight at once (default 1): with 2, the next batch is leased and
    /// published while the previous one waits for its confirms and its mark, hiding the
    /// store's round trips. Order per subject still holds: a source never leases an event
    /// while an earlier one of its subject is held by another batch.
    pub in_flight: usize,
    sleep: Option<Sleep>,
    observer: Option<Arc<dyn RelayObserver>>,
}

impl fmt::Debug for RelayOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayOptions")
            .field("batch_size", &self.batch_size)
            .field("backoff", &self.backoff)
            .field("exit_when_idle", &self.exit_when_idle)
            .field("give_up_after", &self.give_up_after)
            .field("max_publish_attempts", &self.max_publish_attempts)
            .field("in_flight", &self.in_flight)
            .field("sleep", &self.sleep.is_some())
            .field("observer", &self.observer.is_some())
            .finish()
    }
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch_size: 100,
            backoff: Backoff::default(),
            exit_when_idle: None,
            give_up_after: None,
            max_publish_attempts: 5,
            in_flight: 1,
            sleep: None,
            observer: None,
        }
    }
}

impl RelayOptions {
    /// Sets [`batch_size`](Self::batch_size).
    #[must_use]
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// Sets [`backoff`](Self::backoff).
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Sets [`exit_when_idle`](Self::exit_when_idle).
    #[must_use]
    pub fn exit_when_idle(mut self, idle: Option<Duration>) -> Self {
        self.exit_when_idle = idle;
        self
    }

    /// Sets [`give_up_after`](Self::give_up_after).
    #[must_use]
    pub fn give_up_after(mut self, deadline: Option<Duration>) -> Self {
        self.give_up_after = deadline;
        self
    }

    /// Sets [`max_publish_attempts`](Self::max_publish_attempts) (at least 1).
    #[must_use]
    pub fn max_publish_attempts(mut self, n: u32) -> Self {
        self.max_publish_attempts = n.max(1);
        self
    }

    /// Sets [`in_flight`](Self::in_flight) (at least 1).
    #[must_use]
    pub fn in_flight(mut self, n: usize) -> Self {
        self.in_flight = n.max(1);
        self
    }

    /// The timer for backoff waits and the idle deadline. Without one the relay waits
    /// with [`OutboxSource::wait`] (its polling interval) instead of the backoff, and
    /// notices the idle deadline only when a wait returns.
    #[must_use]
    pub fn sleep(mut self, sleep: Sleep) -> Self {
        self.sleep = Some(sleep);
        self
    }

    /// The observer told of every published batch, failure and event moved aside.
    #[must_use]
    pub fn observer(mut self, observer: Arc<dyn RelayObserver>) -> Self {
        self.observer = Some(observer);
        self
    }
}

/// What one lease-publish-mark round did.
enum Round {
    /// Nothing was waiting.
    Idle,
    /// Published and marked this many events.
    Published(usize),
    /// Moved this many events aside; the broker's last refusal.
    MovedAside(u64, String),
}

/// A failed round: the error, and how many events the batch held (0 when the lease
/// itself failed).
struct Failure {
    error: Error,
    events: usize,
}

/// Moves committed outbox events to a broker: lease a batch, publish it (waiting for the
/// broker's confirmation), mark it published. A crash between publishing and marking
/// republishes the batch with the same event ids: at least once, deduplicated downstream.
///
/// Tracing: an event's [`traceparent`](OutboxEvent::traceparent) is published as it was
/// stored — the consumer's delivery span is the message's parent — so a republished event
/// carries the same headers as the first publication. The relay adds no span of its own
/// to the trace; it logs each traced event's `trace_id` (target `idem::relay`, level
/// debug) as it publishes it.
///
/// [`run`](Relay::run) keeps going through failures:
/// - a failed round (store or broker unreachable, a retryable or unknown error) releases
///   its batch and is tried again after a [`Backoff`] delay; once every round has failed
///   for [`RelayOptions::give_up_after`], `run` returns the last error;
/// - a store [`StoreError::Config`] error (a missing table or privilege) ends `run` at once;
/// - when the broker refuses a batch for good (a non-retryable [`PublishError`]), the
///   relay publishes its events one at a time to find the culprit, and an event refused
///   [`RelayOptions::max_publish_attempts`] times is moved aside
///   ([`OutboxBatch::record_failure`]) so that the events behind it keep flowing (its
///   subject's later events are then published without it);
/// - shutdown is checked between rounds and cuts every wait short; the batch in hand is
///   always finished.
#[derive(Debug)]
pub struct Relay<S, P> {
    source: S,
    publisher: P,
    options: RelayOptions,
}

impl<S: OutboxSource, P: Publisher> Relay<S, P> {
    /// A relay that moves up to `batch_size` events per transaction, with the other
    /// options at their defaults.
    pub fn new(source: S, publisher: P, batch_size: usize) -> Self {
        Self::with_options(
            source,
            publisher,
            RelayOptions::default().batch_size(batch_size),
        )
    }

    /// A relay with `options`.
    pub fn with_options(source: S, publisher: P, options: RelayOptions) -> Self {
        Self {
            source,
            publisher,
            options,
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

    /// The options.
    pub fn options(&self) -> &RelayOptions {
        &self.options
    }

    /// Publishes one batch; returns how many events it published (0 when none waited).
    ///
    /// # Errors
    /// A store error leasing or marking, or the publisher's error (the batch is then
    /// released unmarked).
    pub async fn run_once(&self) -> Result<usize, Error> {
        match self.round(self.options.batch_size, false).await {
            Ok(Round::Idle | Round::MovedAside(..)) => Ok(0),
            Ok(Round::Published(n)) => Ok(n),
            Err(f) => Err(f.error),
        }
    }

    /// One lease-publish-mark round of at most `max` events. With `charge`, a one-event
    /// batch the broker refuses for good is charged to its event.
    async fn round(&self, max: usize, charge: bool) -> Result<Round, Failure> {
        let fail = |error: Error, events| Failure { error, events };
        let started = Instant::now();
        let batch = self
            .source
            .lease(max)
            .await
            .map_err(|e| fail(e.into(), 0))?;
        let n = batch.events().len();
        if n == 0 {
            batch.release().await.map_err(|e| fail(e.into(), 0))?;
            return Ok(Round::Idle);
        }
        let leased = started.elapsed();
        if tracing::enabled!(target: "idem::relay", tracing::Level::DEBUG) {
            for ev in batch.events() {
                if let Some(tp) = &ev.traceparent {
                    tracing::debug!(
                        target: "idem::relay",
                        event_id = %ev.event_id,
                        trace_id = %tp.trace_id_hex(),
                        parent_id = %tp.parent_id_hex(),
                        "publishing a traced outbox event"
                    );
                }
            }
        }
        match self.publisher.publish(batch.events()).await {
            Ok(()) => {
                let published = started.elapsed();
                batch
                    .mark_published()
                    .await
                    .map_err(|e| fail(e.into(), n))?;
                tracing::debug!(
                    target: "idem::relay",
                    published = n,
                    lease_us = leased.as_micros() as u64,
                    publish_us = (published - leased).as_micros() as u64,
                    mark_us = (started.elapsed() - published).as_micros() as u64,
                    "outbox batch published"
                );
                Ok(Round::Published(n))
            }
            Err(e) if charge && n == 1 && !e.is_retryable() => {
                let reason = error_chain(&e);
                let moved = batch
                    .record_failure(&reason, self.options.max_publish_attempts)
                    .await
                    .map_err(|se| fail(se.into(), n))?;
                if moved > 0 {
                    tracing::warn!(target: "idem::relay", moved, error = %reason, "outbox event moved aside after repeated publish failures");
                    Ok(Round::MovedAside(moved, reason))
                } else {
                    Err(fail(e.into(), n))
                }
            }
            Err(e) => {
                // Release explicitly; if that fails too, dropping the batch releases it.
                let _ = batch.release().await;
                Err(fail(e.into(), n))
            }
        }
    }

    /// Waits `d` (with the timer, else one [`OutboxSource::wait`]), or until `shutdown`;
    /// returns `true` on shutdown.
    async fn pause<F>(&self, d: Duration, mut shutdown: &mut F) -> Result<bool, Error>
    where
        F: Future<Output = ()> + futures::future::FusedFuture + Unpin,
    {
        let wait = match &self.options.sleep {
            Some(sleep) => sleep(d).map(|()| Ok(())).boxed(),
            None => self.source.wait().map(|r| r.map_err(Error::from)).boxed(),
        };
        let mut wait = wait.fuse();
        futures::select! {
            () = shutdown => Ok(true),
            r = wait => r.map(|()| false),
        }
    }

    /// Waits for new events (a notification or the source's polling interval), at most
    /// until `idle_left` when a timer is set, or until `shutdown`; returns `true` on
    /// shutdown.
    async fn idle_wait<F>(&self, idle_left: Option<Duration>, mut shutdown: &mut F) -> bool
    where
        F: Future<Output = ()> + futures::future::FusedFuture + Unpin,
    {
        let mut wait = self.source.wait().fuse();
        let timer = match (&self.options.sleep, idle_left) {
            (Some(sleep), Some(left)) => sleep(left),
            _ => futures::future::pending().boxed(),
        };
        let mut timer = timer.fuse();
        futures::select! {
            () = shutdown => true,
            () = timer => false,
            r = wait => {
                if let Err(e) = r {
                    tracing::warn!(target: "idem::relay", error = %error_chain(&e), "waiting for outbox events failed");
                    if let Some(sleep) = &self.options.sleep {
                        let mut pause = sleep(self.options.backoff.delay(1)).fuse();
                        futures::select! {
                            () = shutdown => return true,
                            () = pause => {}
                        }
                    }
                }
                false
            }
        }
    }

    /// Runs until `shutdown` completes (finishing the batch in hand), the outbox stays
    /// empty for [`RelayOptions::exit_when_idle`], or it gives up (see [`Relay`]).
    ///
    /// # Errors
    /// A store [`StoreError::Config`] error at once; otherwise the last error once every
    /// round has failed for [`RelayOptions::give_up_after`].
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<RelayStats, Error> {
        let shutdown = shutdown.shared();
        if self.options.in_flight <= 1 {
            return self.worker(shutdown).await;
        }
        // Each worker leases, publishes and marks its own batches; the first error ends
        // them all (a batch dropped mid-way is released unmarked, republished later).
        let workers = (0..self.options.in_flight).map(|_| self.worker(shutdown.clone()));
        let all = futures::future::try_join_all(workers).await?;
        Ok(all.iter().fold(RelayStats::default(), |mut t, s| {
            t.published += s.published;
            t.batches += s.batches;
            t.failed_batches += s.failed_batches;
            t.moved_aside += s.moved_aside;
            t
        }))
    }

    /// One lease-publish-mark loop (see [`run`](Self::run)).
    async fn worker(&self, shutdown: impl Future<Output = ()>) -> Result<RelayStats, Error> {
        let o = &self.options;
        let observer = o.observer.as_deref();
        let mut stats = RelayStats::default();
        let shutdown = shutdown.fuse();
        futures::pin_mut!(shutdown);
        let mut last_work = Instant::now();
        let mut failing_since: Option<Instant> = None;
        let mut failures = 0u32;
        // Events still to publish one at a time after the broker refused a batch.
        let mut probe = 0usize;
        loop {
            if (&mut shutdown).now_or_never().is_some() {
                return Ok(stats);
            }
            let max = if probe > 0 { 1 } else { o.batch_size };
            match self.round(max, probe > 0).await {
                Ok(Round::Idle) => {
                    (failing_since, failures, probe) = (None, 0, 0);
                    let left = match o.exit_when_idle {
                        Some(idle) if last_work.elapsed() >= idle => return Ok(stats),
                        Some(idle) => Some(idle.saturating_sub(last_work.elapsed())),
                        None => None,
                    };
                    if self.idle_wait(left, &mut shutdown).await {
                        return Ok(stats);
                    }
                }
                Ok(Round::Published(n)) => {
                    (failing_since, failures) = (None, 0);
                    probe = probe.saturating_sub(n);
                    stats.published += n as u64;
                    stats.batches += 1;
                    last_work = Instant::now();
                    if let Some(obs) = observer {
                        obs.published(n);
                    }
                }
                Ok(Round::MovedAside(moved, reason)) => {
                    (failing_since, failures) = (None, 0);
                    probe = probe.saturating_sub(1);
                    stats.moved_aside += moved;
                    last_work = Instant::now();
                    if let Some(obs) = observer {
                        obs.moved_aside(moved, &reason);
                    }
                }
                Err(Failure { error, events }) => {
                    stats.failed_batches += 1;
                    if matches!(error, Error::Store(StoreError::Config(_))) {
                        return Err(error);
                    }
                    let refused = matches!(&error, Error::Publish(e) if !e.is_retryable());
                    if refused && probe == 0 {
                        // Find the event the broker refuses: one at a time, at once.
                        tracing::warn!(target: "idem::relay", events, error = %error_chain(&error), "broker refused a batch; publishing its events one by one");
                        probe = events;
                        if let Some(obs) = observer {
                            obs.failed(&error, Duration::ZERO);
                        }
                        continue;
                    }
                    failures = failures.saturating_add(1);
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    if o.give_up_after.is_some_and(|g| since.elapsed() >= g) {
                        return Err(error);
                    }
                    let wait = o.backoff.delay(failures);
                    tracing::warn!(target: "idem::relay", error = %error_chain(&error), "relay batch failed; retrying in {wait:?}");
                    if let Some(obs) = observer {
                        obs.failed(&error, wait);
                    }
                    match self.pause(wait, &mut shutdown).await {
                        Ok(true) => return Ok(stats),
                        Ok(false) => {}
                        // Only without a timer: the source's wait failed too.
                        Err(e) if e.is_retryable() => {}
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }
}

/// An error and its sources, `: `-separated (the publisher's reason as stored).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        let t = src.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = src.source();
    }
    s
}
