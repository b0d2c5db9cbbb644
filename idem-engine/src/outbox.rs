//! The outbox relay: publishes the events a claim's transaction wrote, at least once, with
//! their deterministic [`EventId`]s, so the next consumer dedups the same way. The event
//! types and the store's side ([`OutboxSource`], [`Publisher`]) are the contract's, in
//! [`idem_core::outbox`], re-exported here.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::FutureExt;

pub use idem_core::outbox::*;

use crate::backoff;
// An error and its sources: the publisher's reason as stored.
use idem_core::error::{error_chain, Error, StoreError};

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
/// use idem_engine::outbox::Backoff;
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
/// use idem_engine::outbox::RelayOptions;
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
/// - when the broker refuses a batch for good (a non-retryable [`PublishError`](crate::PublishError)), the
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
