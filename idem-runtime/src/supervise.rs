//! The supervised consumer: [`consumer::run`] over a delivery stream that is reconnected
//! when it closes, slowed down while the store keeps failing, and given up on after a
//! deadline, with counts that survive every reconnect.
//!
//! The decision by error class:
//! - a delivery stream that ends or fails (a broker restart) is reconnected with
//!   [`Backoff`], for at most [`SupervisorConfig::reconnect_timeout`] per outage;
//! - deliveries that keep failing (the store is down) are each delayed by a growing
//!   backoff; once they have failed for `reconnect_timeout` in a row, with no probe of the
//!   store committing meanwhile ([`Gate::store_proven`]: one message failing alone is the
//!   gate's to judge, not a failing store), the run ends with
//!   [`SuperviseError::StoreFailing`]. The deadline is checked every half second whatever
//!   the workers are doing (all of them may be waiting on the store); deliveries in
//!   flight then get five seconds to settle and are dropped unsettled (their
//!   transactions roll back, the broker redelivers them);
//! - an error [`consumer::run`] returns that no retry fixes (a `Config`-class failure: a
//!   missing table or privilege, a dead-letter destination that refuses dead letters for
//!   good) ends the run at once with [`SuperviseError::Consumer`], nothing more acked;
//! - a connection refused for good ([`Attempt::Final`]) ends it with
//!   [`SuperviseError::Connect`].

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use futures::{FutureExt as _, Stream};
use idem_engine::outbox::Backoff;
use idem_engine::{
    consumer, Acker, BoxError, ClaimStore, ConsumerConfig, ConsumerStats, Delivery, Error, Gate,
    Handler, Outcome, OutcomeKind,
};

use crate::retry::{retry, Attempt, GaveUp};

/// How [`supervise`] runs.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SupervisorConfig {
    /// The consumer loop's batch size and concurrency.
    pub consumer: ConsumerConfig,
    /// End the run once no delivery arrived for this long (default: never), and nothing
    /// is left for it: a delivery still in its handler is waited for, and one that failed
    /// or was deferred (it comes back after its
    /// delay, held by the consumer or redelivered by the broker) is waited for until it
    /// settles. One that does not come back within twice the gate's longest retry delay
    /// after its last failure (the broker gave it to another consumer) ends the run with
    /// [`SuperviseError::NotDrained`]. With a [`source_check`](Self::source_check), the
    /// run ends only once the source itself holds nothing more: see [`SourceCheck`].
    pub exit_when_idle: Option<Duration>,
    /// How an idle run asks the source what it still holds (default: it does not ask).
    pub source_check: Option<SourceCheck>,
    /// How long the broker or the store may stay unreachable before the run ends
    /// (default 60 s).
    pub reconnect_timeout: Duration,
    /// The delay between reconnects, and before each delivery while the store fails.
    pub backoff: Backoff,
}

impl SupervisorConfig {
    /// The defaults around `consumer`.
    pub fn new(consumer: ConsumerConfig) -> Self {
        Self {
            consumer,
            exit_when_idle: None,
            source_check: None,
            reconnect_timeout: Duration::from_secs(60),
            backoff: Backoff::default(),
        }
    }

    /// Sets [`exit_when_idle`](Self::exit_when_idle).
    #[must_use]
    pub fn exit_when_idle(mut self, idle: Option<Duration>) -> Self {
        self.exit_when_idle = idle;
        self
    }

    /// Sets [`source_check`](Self::source_check).
    #[must_use]
    pub fn source_check(mut self, check: Option<SourceCheck>) -> Self {
        self.source_check = check;
        self
    }

    /// Sets [`reconnect_timeout`](Self::reconnect_timeout).
    #[must_use]
    pub fn reconnect_timeout(mut self, timeout: Duration) -> Self {
        self.reconnect_timeout = timeout;
        self
    }
}

/// What a drain asks the broker once the run has gone idle with nothing of its own left
/// ([`SupervisorConfig::exit_when_idle`]): how many messages the source still holds that
/// this consumer may yet receive — messages another consumer holds, a dead consumer's
/// until the broker hands them on (an SQS visibility timeout, a NATS `ack_wait`, a Kafka
/// partition still assigned to a member whose session has not expired), records behind a
/// consumer group's committed offset.
///
/// While the answer is not zero the run waits one idle period more and asks again; once
/// nothing has been delivered for twice the gate's longest retry delay with the source
/// still holding messages (or the broker not answering), it ends with
/// [`SuperviseError::SourceNotDrained`], saying how many. A drain thus exits cleanly only
/// when the source is empty for it. `idem consume` asks with
/// `idem_broker::any::pending_count`.
#[derive(Clone)]
pub struct SourceCheck(
    Arc<dyn Fn() -> futures::future::BoxFuture<'static, Result<u64, BoxError>> + Send + Sync>,
);

impl SourceCheck {
    /// A check that runs `f` each time it asks.
    pub fn new<F, Fut>(f: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<u64, BoxError>> + Send + 'static,
    {
        Self(Arc::new(move || f().boxed()))
    }

    fn ask(&self) -> futures::future::BoxFuture<'static, Result<u64, BoxError>> {
        (self.0)()
    }
}

impl std::fmt::Debug for SourceCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SourceCheck")
    }
}

/// What a supervised run did, over all its connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Supervised {
    /// Every outcome, counted across reconnects.
    pub stats: ConsumerStats,
    /// From the first settled delivery to the last (zero when none).
    pub busy: Duration,
    /// How many times the delivery stream was reconnected.
    pub reconnects: u32,
}

/// Why a supervised run ended without success.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SuperviseError<E: std::error::Error + 'static> {
    /// The broker could not be (re)connected: refused for good, or not within the
    /// reconnect deadline.
    #[error(transparent)]
    Connect(GaveUp<E>),
    /// Deliveries kept failing (the store is down) for longer than the deadline.
    #[error("the store kept failing for {:.0} s ({deliveries} deliveries in a row)", .after.as_secs_f64())]
    StoreFailing {
        /// How long.
        after: Duration,
        /// Failed deliveries in a row.
        deliveries: u64,
    },
    /// The consumer stopped on an error no retry fixes (a `Config`-class failure).
    #[error(transparent)]
    Consumer(Error),
    /// The run went idle ([`SupervisorConfig::exit_when_idle`]) with deliveries left
    /// unsettled: they failed or were deferred and did not come back to this consumer.
    #[error(
        "not drained: {left} deliveries that failed or were deferred did not come back \
         within {:.0} s of their last attempt (another consumer may hold them, or the \
         broker redelivers them later)",
        .waited.as_secs_f64()
    )]
    NotDrained {
        /// How many.
        left: usize,
        /// How long after its last attempt each was waited for.
        waited: Duration,
    },
    /// The run went idle ([`SupervisorConfig::exit_when_idle`]) and the source still held
    /// messages ([`SourceCheck`]) after no delivery reached this consumer for `waited`.
    #[error(
        "not drained: {} after {:.0} s without a delivery (another consumer holds \
         them, a dead one's until the broker hands them on, or they wait in partitions \
         assigned elsewhere)",
        match .left { Some(n) => format!("the source still holds {n} messages"), None => format!("the broker did not say what the source holds ({})", .detail) },
        .waited.as_secs_f64()
    )]
    SourceNotDrained {
        /// How many messages the source held at the last answer (`None`: no answer).
        left: Option<u64>,
        /// How long no delivery came.
        waited: Duration,
        /// The broker's last error, when it did not answer.
        detail: String,
    },
}

/// Deliveries that failed or were deferred and have not settled since (by key): a drain
/// ([`SupervisorConfig::exit_when_idle`]) waits for them.
#[derive(Debug, Default)]
struct Awaited {
    keys: Mutex<std::collections::HashMap<idem_engine::IdempotencyKey, Instant>>,
    not_drained: Mutex<Option<usize>>,
    /// What the source held when the drain gave up on it ([`SourceCheck`]): how many
    /// (`None`: no answer) and the broker's error.
    source_left: Mutex<Option<(Option<u64>, String)>>,
}

/// What an idle consumer still waits for.
enum Left {
    /// Nothing: drained.
    Nothing,
    /// Deliveries that will come back.
    Waiting,
    /// Deliveries that did not come back within the bound (recorded as not drained).
    Gone,
}

impl Awaited {
    fn record(&self, o: &Outcome) {
        let Some(key) = o.key() else { return };
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let comes_back = match o {
            Outcome::Failed { error, .. } => {
                !matches!(error, Error::Store(e) if e.is_fenced())
                    && !error.class().eq(&idem_engine::ErrorClass::Config)
            }
            Outcome::Deferred { .. } => true,
            _ => false,
        };
        if comes_back {
            keys.insert(*key, Instant::now());
        } else if !keys.is_empty() {
            keys.remove(key);
        }
    }

    /// What is left, each delivery waited for at most `bound` after its last attempt.
    fn left(&self, bound: Duration) -> Left {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if keys.is_empty() {
            return Left::Nothing;
        }
        if keys.values().any(|at| at.elapsed() < bound) {
            return Left::Waiting;
        }
        *self
            .not_drained
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(keys.len());
        Left::Gone
    }

    fn not_drained(&self) -> Option<usize> {
        *self
            .not_drained
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn source_not_drained(&self, left: Option<u64>, detail: String) {
        *self
            .source_left
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((left, detail));
    }

    fn source_left(&self) -> Option<(Option<u64>, String)> {
        self.source_left
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Counts by outcome across connections, and the first and last settle time.
#[derive(Default)]
struct Counts {
    by_kind: [AtomicU64; 6],
    settle_failures: AtomicU64,
    first_last: Mutex<Option<(Instant, Instant)>>,
}

/// The outcome kinds counted here and by the metrics, in their order.
pub(crate) const KINDS: [OutcomeKind; 6] = [
    OutcomeKind::Processed,
    OutcomeKind::Duplicate,
    OutcomeKind::Deferred,
    OutcomeKind::Rejected,
    OutcomeKind::Failed,
    OutcomeKind::Conflict,
];

/// The index of `o`'s kind in [`KINDS`]: an outcome kind this crate does not know yet
/// counts as failed.
pub(crate) fn kind_index(o: &Outcome) -> usize {
    KINDS.iter().position(|k| *k == o.kind()).unwrap_or(4)
}

impl Counts {
    fn record(&self, o: &Outcome) {
        let i = kind_index(o);
        self.by_kind[i].fetch_add(1, Ordering::Relaxed);
        if o.settle_error().is_some() {
            self.settle_failures.fetch_add(1, Ordering::Relaxed);
        }
        let now = Instant::now();
        let mut fl = self
            .first_last
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *fl = Some(fl.map_or((now, now), |(first, _)| (first, now)));
    }

    // Field by field: `ConsumerStats` may gain fields (or `#[non_exhaustive]`) in core.
    #[allow(clippy::field_reassign_with_default)]
    fn stats(&self) -> ConsumerStats {
        let get = |i: usize| self.by_kind[i].load(Ordering::Relaxed);
        let mut s = ConsumerStats::default();
        s.processed = get(0);
        s.duplicates = get(1);
        s.deferred = get(2);
        s.rejected = get(3);
        s.failed = get(4);
        s.conflicts = get(5);
        s.settle_failures = self.settle_failures.load(Ordering::Relaxed);
        s
    }

    fn busy(&self) -> Duration {
        self.first_last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .map_or(Duration::ZERO, |(first, last)| last.duration_since(first))
    }
}

/// Consecutive failed deliveries (a store that is down), for backoff and the deadline.
#[derive(Debug, Default)]
struct Streak {
    failures: AtomicU64,
    since: Mutex<Option<Instant>>,
    gave_up: Mutex<Option<(Duration, u64)>>,
}

impl Streak {
    fn record(&self, kind: OutcomeKind) {
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        if kind == OutcomeKind::Failed {
            self.failures.fetch_add(1, Ordering::SeqCst);
            since.get_or_insert_with(Instant::now);
        } else if kind != OutcomeKind::Deferred {
            self.failures.store(0, Ordering::SeqCst);
            *since = None;
        }
    }

    /// How long the next delivery waits (`None`: no failures), or `Err` once the
    /// failures have lasted `timeout` ([`expired`](Streak::expired)).
    fn wait(
        &self,
        timeout: Duration,
        backoff: Backoff,
        proven: Option<Instant>,
    ) -> Option<Result<Duration, ()>> {
        let n = self.failures.load(Ordering::SeqCst);
        if n == 0 {
            return None;
        }
        if self.expired(timeout, proven) {
            return Some(Err(()));
        }
        Some(Ok(backoff.delay(u32::try_from(n).unwrap_or(u32::MAX))))
    }

    /// Whether the failures have lasted `timeout` with no sign that the store works: no
    /// delivery settled, and no probe of the store committed (`proven`, the gate's
    /// [`store_proven`](idem_engine::Gate::store_proven)) since they began. A message that
    /// fails alone while the store's probes commit is the gate's to judge, not a failing
    /// store. Records the give-up.
    fn expired(&self, timeout: Duration, proven: Option<Instant>) -> bool {
        let n = self.failures.load(Ordering::SeqCst);
        let since = *self.since.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(since) = since.filter(|_| n > 0) else {
            return false;
        };
        let since = proven.map_or(since, |p| p.max(since));
        if since.elapsed() < timeout {
            return false;
        }
        let mut gave_up = self.gave_up.lock().unwrap_or_else(PoisonError::into_inner);
        gave_up.get_or_insert((since.elapsed(), n));
        true
    }

    fn gave_up(&self) -> Option<(Duration, u64)> {
        *self.gave_up.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A connection's delivery stream as the consumer sees it: before each delivery is
/// pulled it waits the store-failure backoff (and ends with an error once the failures
/// outlast the deadline); it ends once no delivery arrived for `idle` while it was waited
/// for; `ended` tells a stream the broker closed from one that went idle. (A hand-written
/// stream: combinator closures here defeat rustc's `Send` proof for the caller's future.)
struct Watched<St, P> {
    inner: Pin<Box<St>>,
    idle: Option<Duration>,
    idle_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// What an idle run still waits for, and how long after its last attempt.
    awaited: Arc<Awaited>,
    await_bound: Duration,
    /// Deliveries this stream handed out whose outcome has not come yet: an idle run
    /// waits for them (one may fail and come back).
    in_flight: Arc<AtomicUsize>,
    /// Asks the source what it still holds once nothing of the run's own is left.
    check: Option<SourceCheck>,
    /// The question in flight.
    asking: Option<futures::future::BoxFuture<'static, Result<u64, BoxError>>>,
    /// When the last delivery came (or the stream started).
    last_item: Instant,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
    checked: bool,
    streak: Arc<Streak>,
    timeout: Duration,
    backoff: Backoff,
    /// The gate's [`store_proven`](idem_engine::Gate::store_proven).
    proven: P,
    ended: Arc<AtomicBool>,
    done: bool,
}

impl<St, A, E, P> Stream for Watched<St, P>
where
    St: Stream<Item = Result<Delivery<A>, E>>,
    E: Into<BoxError>,
    P: Fn() -> Option<Instant> + Unpin,
{
    type Item = Result<Delivery<A>, BoxError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if !this.checked {
            this.checked = true;
            match this
                .streak
                .wait(this.timeout, this.backoff, (this.proven)())
            {
                None => {}
                Some(Ok(wait)) => this.pause = Some(Box::pin(tokio::time::sleep(wait))),
                Some(Err(())) => {
                    // Ends this connection's run; `supervise` reports why.
                    this.done = true;
                    return Poll::Ready(Some(Err("the store kept failing".into())));
                }
            }
        }
        if let Some(pause) = this.pause.as_mut() {
            ready!(pause.as_mut().poll(cx));
            this.pause = None;
        }
        match this.inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(item)) => {
                if item.is_ok() {
                    this.in_flight.fetch_add(1, Ordering::SeqCst);
                }
                this.idle_timer = None;
                this.asking = None;
                this.last_item = Instant::now();
                this.checked = false;
                Poll::Ready(Some(item.map_err(Into::into)))
            }
            Poll::Ready(None) => {
                this.ended.store(true, Ordering::SeqCst);
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => {
                let Some(idle) = this.idle else {
                    return Poll::Pending;
                };
                if this.asking.is_none() {
                    let timer = this
                        .idle_timer
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                    if timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    let left = if this.in_flight.load(Ordering::SeqCst) > 0 {
                        Left::Waiting
                    } else {
                        this.awaited.left(this.await_bound)
                    };
                    match (left, &this.check) {
                        (Left::Nothing, Some(check)) => this.asking = Some(check.ask()),
                        (Left::Nothing | Left::Gone, _) => {
                            this.done = true;
                            return Poll::Ready(None);
                        }
                        (Left::Waiting, _) => {}
                    }
                }
                if let Some(asking) = this.asking.as_mut() {
                    let answer = ready!(asking.as_mut().poll(cx));
                    this.asking = None;
                    let (left, detail) = match answer {
                        Ok(0) => {
                            this.done = true;
                            return Poll::Ready(None);
                        }
                        Ok(n) => (Some(n), String::new()),
                        Err(e) => (None, e.to_string()),
                    };
                    if this.last_item.elapsed() >= this.await_bound {
                        this.awaited.source_not_drained(left, detail);
                        this.done = true;
                        return Poll::Ready(None);
                    }
                    tracing::info!(target: "idem::consume", left, error = %detail, "idle, but the source still holds messages for this consumer: waiting for them");
                }
                // Not drained yet: look again one idle period later.
                let mut again = Box::pin(tokio::time::sleep(idle));
                let _ = again.as_mut().poll(cx);
                this.idle_timer = Some(again);
                Poll::Pending
            }
        }
    }
}

/// How long deliveries in flight when the store's failures outlast the reconnect timeout
/// get to settle before they are dropped unsettled.
const GIVE_UP_GRACE: Duration = Duration::from_secs(5);

/// Resolves once the store's failures have outlasted `timeout` ([`Streak::expired`]),
/// checked every half second whatever the consumer is doing.
async fn outlasted(streak: &Streak, timeout: Duration, proven: impl Fn() -> Option<Instant>) {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if streak.expired(timeout, proven()) {
            return;
        }
    }
}

/// Resolves when `a` or `b` does. (An `async fn`, not a combinator with a closure: those
/// defeat rustc's `Send` proof for the caller's future.)
async fn first_of(a: impl Future<Output = ()>, b: impl Future<Output = ()>) {
    futures::pin_mut!(a, b);
    futures::future::select(a, b).await;
}

/// Runs `gate` over deliveries from `connect` until `shutdown`, the idle deadline, or a
/// failure the module docs list. `first` is an already connected stream (else `connect`
/// is called first); `observe` sees every outcome, of every connection.
///
/// # Errors
/// See [`SuperviseError`].
pub async fn supervise<S, H, A, St, E, C, Fut, CE>(
    gate: &Gate<S, H>,
    first: Option<St>,
    mut connect: C,
    config: SupervisorConfig,
    shutdown: impl Future<Output = ()>,
    observe: impl Fn(&Outcome) + Sync,
) -> Result<Supervised, SuperviseError<CE>>
where
    S: ClaimStore,
    H: Handler<S::Tx>,
    A: Acker,
    St: Stream<Item = Result<Delivery<A>, E>>,
    E: Into<BoxError>,
    C: FnMut() -> Fut,
    Fut: Future<Output = Result<St, Attempt<CE>>>,
    CE: std::error::Error + 'static,
{
    let shutdown = shutdown.shared();
    let counts = Counts::default();
    let streak = Arc::new(Streak::default());
    let awaited = Arc::new(Awaited::default());
    let timeout = config.reconnect_timeout;
    let mut reconnects = 0u32;
    let mut next = first;
    let done = |reconnects| Supervised {
        stats: counts.stats(),
        busy: counts.busy(),
        reconnects,
    };
    loop {
        let stream = match next.take() {
            Some(s) => s,
            None => {
                let connecting = retry("the broker", timeout, config.backoff, &mut connect);
                futures::pin_mut!(connecting);
                futures::select! {
                    r = connecting.fuse() => r.map_err(SuperviseError::Connect)?,
                    () = shutdown.clone().fuse() => return Ok(done(reconnects)),
                }
            }
        };
        let ended = Arc::new(AtomicBool::new(false));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let deliveries = Watched {
            inner: Box::pin(stream),
            idle: config.exit_when_idle,
            idle_timer: None,
            awaited: Arc::clone(&awaited),
            await_bound: gate.config().retry.max.saturating_mul(2),
            in_flight: Arc::clone(&in_flight),
            check: config.source_check.clone(),
            asking: None,
            last_item: Instant::now(),
            pause: None,
            checked: false,
            streak: Arc::clone(&streak),
            timeout,
            backoff: config.backoff,
            proven: || gate.store_proven(),
            ended: Arc::clone(&ended),
            done: false,
        };
        // The deadline is kept whatever the workers are doing (every one may be waiting on
        // the store): once the failures have outlasted it, the loop takes no more
        // deliveries, and what is in flight gets `GIVE_UP_GRACE` to settle before it is
        // dropped (its transactions roll back; the broker redelivers what was not acked).
        let stop = first_of(
            shutdown.clone(),
            outlasted(&streak, timeout, || gate.store_proven()),
        );
        let run = consumer::run(gate, deliveries, config.consumer, stop, |o: &Outcome| {
            let _ =
                in_flight.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            awaited.record(o);
            streak.record(o.kind());
            counts.record(o);
            observe(o);
        })
        .fuse();
        let abandon = async {
            outlasted(&streak, timeout, || gate.store_proven()).await;
            tokio::time::sleep(GIVE_UP_GRACE).await;
        }
        .fuse();
        futures::pin_mut!(run, abandon);
        let result = futures::select! {
            r = run => r,
            () = abandon => {
                tracing::warn!(target: "idem::consume", "the store kept failing past the reconnect timeout; in-flight deliveries abandoned unsettled");
                Ok(ConsumerStats::default())
            }
        };
        let stopped = shutdown.peek().is_some();
        if let Some((after, deliveries)) = streak.gave_up() {
            return Err(SuperviseError::StoreFailing { after, deliveries });
        }
        if let Some(left) = awaited.not_drained() {
            return Err(SuperviseError::NotDrained {
                left,
                waited: gate.config().retry.max.saturating_mul(2),
            });
        }
        if let Some((left, detail)) = awaited.source_left() {
            return Err(SuperviseError::SourceNotDrained {
                left,
                waited: gate.config().retry.max.saturating_mul(2),
                detail,
            });
        }
        match result {
            Ok(_) if stopped || !ended.load(Ordering::SeqCst) => return Ok(done(reconnects)),
            Ok(_) => {
                tracing::warn!(target: "idem::consume", "the broker closed the delivery stream; reconnecting");
            }
            Err(_) if stopped => return Ok(done(reconnects)),
            Err(e @ Error::Stream(_)) => {
                tracing::warn!(target: "idem::consume", error = %e, "delivery stream failed; reconnecting");
            }
            Err(e) if !e.is_retryable() => return Err(SuperviseError::Consumer(e)),
            Err(e) => {
                tracing::warn!(target: "idem::consume", error = %e, "consumer failed; reconnecting");
            }
        }
        reconnects += 1;
        let mut pause = tokio::time::sleep(config.backoff.delay(1)).boxed().fuse();
        futures::select! {
            () = pause => {}
            () = shutdown.clone().fuse() => return Ok(done(reconnects)),
        }
    }
}
