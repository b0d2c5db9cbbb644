//! The consumer loop: deliveries in, bounded concurrency, graceful shutdown.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use futures::channel::oneshot;
use futures::future::Shared;
use futures::{FutureExt as _, Stream, StreamExt};

use crate::delivery::{Acker, Delivery};
use crate::error::{AckError, BoxError, Error, ErrorClass, StoreError};
use crate::gate::{Gate, Handler, Identified, Outcome, OutcomeKind};
use crate::store::ClaimStore;

/// How a consumer takes deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// How many batches (or single deliveries) are processed at once.
    pub concurrency: usize,
    /// The most deliveries processed in one transaction. The loop batches whatever is
    /// already waiting, up to this size; it never waits to fill a batch.
    pub batch_size: usize,
}

impl Default for ConsumerConfig {
    /// [`DEFAULT_CONCURRENCY`](Self::DEFAULT_CONCURRENCY) batches of up to
    /// [`DEFAULT_BATCH_SIZE`](Self::DEFAULT_BATCH_SIZE).
    fn default() -> Self {
        Self {
            concurrency: Self::DEFAULT_CONCURRENCY,
            batch_size: Self::DEFAULT_BATCH_SIZE,
        }
    }
}

impl ConsumerConfig {
    /// The default batch size: up to 100 deliveries share one transaction (one claim
    /// statement, one commit, one WAL flush). The loop batches only what is already
    /// waiting, so at low load a delivery still goes alone and costs no added latency;
    /// under a backlog one commit serves up to 100.
    pub const DEFAULT_BATCH_SIZE: usize = 100;
    /// The default concurrency: four batches in flight, so that while some wait for a
    /// round trip or their commit's WAL flush, others are claimed and written (measured
    /// by `scripts/bench-postgres`: four beat two in every pair of runs; see the
    /// performance table in docs/performance.md). Each needs a database connection of its own.
    pub const DEFAULT_CONCURRENCY: usize = 4;

    /// A configuration; zero values are raised to one.
    pub fn new(concurrency: usize, batch_size: usize) -> Self {
        Self {
            concurrency: concurrency.max(1),
            batch_size: batch_size.max(1),
        }
    }
}

/// Counts of a consumer run, by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Committed and acked.
    pub processed: u64,
    /// Skipped as duplicates and acked.
    pub duplicates: u64,
    /// Nacked with a delay because the key was held elsewhere.
    pub deferred: u64,
    /// Dead-lettered.
    pub rejected: u64,
    /// Rolled back and nacked.
    pub failed: u64,
    /// Settlements that failed (an ack after a commit, a nack, a dead-letter).
    pub settle_failures: u64,
    /// Dead-lettered as conflicts: the same submission (identity) already claimed with
    /// another payload ([`Outcome::Conflict`]). Not counted in `rejected`.
    pub conflicts: u64,
}

impl ConsumerStats {
    /// All deliveries seen.
    pub fn deliveries(&self) -> u64 {
        self.processed
            + self.duplicates
            + self.deferred
            + self.rejected
            + self.failed
            + self.conflicts
    }

    /// Every count by its name (`deliveries` first, then each field), for a report or a
    /// log line.
    ///
    /// ```
    /// let s = idem_engine::ConsumerStats { processed: 3, duplicates: 1, ..Default::default() };
    /// assert_eq!(s.counts()[0], ("deliveries", 4));
    /// assert_eq!(s.counts()[1], ("processed", 3));
    /// ```
    pub fn counts(&self) -> [(&'static str, u64); 8] {
        [
            ("deliveries", self.deliveries()),
            ("processed", self.processed),
            ("duplicates", self.duplicates),
            ("deferred", self.deferred),
            ("rejected", self.rejected),
            ("failed", self.failed),
            ("settle_failures", self.settle_failures),
            ("conflicts", self.conflicts),
        ]
    }
}

#[derive(Default)]
struct Counters([AtomicU64; 7]);

impl Counters {
    fn record(&self, o: &Outcome) {
        let i = match o.kind() {
            OutcomeKind::Processed => 0,
            OutcomeKind::Duplicate => 1,
            OutcomeKind::Deferred => 2,
            OutcomeKind::Rejected => 3,
            OutcomeKind::Failed => 4,
            OutcomeKind::Conflict => 6,
        };
        self.0[i].fetch_add(1, Ordering::Relaxed);
        if o.settle_error().is_some() {
            self.0[5].fetch_add(1, Ordering::Relaxed);
        }
    }

    fn snapshot(&self) -> ConsumerStats {
        let g = |i: usize| self.0[i].load(Ordering::Relaxed);
        ConsumerStats {
            processed: g(0),
            duplicates: g(1),
            deferred: g(2),
            rejected: g(3),
            failed: g(4),
            settle_failures: g(5),
            conflicts: g(6),
        }
    }
}

/// Keeps the deliveries of one claim identity in arrival order across the batches in
/// flight: a batch holding an identity that an earlier batch still in flight holds waits
/// for that batch to finish before it claims anything.
#[derive(Default)]
struct Turnstile {
    /// The next batch's number.
    next: u64,
    /// Identity hash → the number of the last batch that holds it and its completion.
    holders: HashMap<u64, (u64, Shared<oneshot::Receiver<()>>)>,
}

/// A batch's place in the [`Turnstile`].
struct Turn {
    number: u64,
    identities: Vec<u64>,
    waits: Vec<Shared<oneshot::Receiver<()>>>,
    done: oneshot::Sender<()>,
}

impl Turnstile {
    /// Registers a batch (in arrival order): it now holds its identities, and waits for
    /// the batches that held them before it.
    fn enter(&mut self, identities: Vec<u64>) -> Turn {
        let number = self.next;
        self.next += 1;
        let (done, finished) = oneshot::channel();
        let finished = finished.shared();
        let mut waits = Vec::new();
        for &id in &identities {
            if let Some((other, wait)) = self.holders.insert(id, (number, finished.clone())) {
                if other != number {
                    waits.push(wait);
                }
            }
        }
        Turn {
            number,
            identities,
            waits,
            done,
        }
    }

    /// The batch is settled: the identities it still holds are free.
    fn leave(&mut self, turn: &Turn) {
        for id in &turn.identities {
            if self.holders.get(id).is_some_and(|(n, _)| *n == turn.number) {
                self.holders.remove(id);
            }
        }
    }
}

/// The error that stops the loop, if `o` met one: a configuration error of the store or
/// the handler ([`StoreError::Config`]), or a settlement the broker's setup refuses
/// ([`AckError::config`]: a dead-letter destination that refuses the dead letter).
fn config_failure(o: &Outcome) -> Option<Error> {
    if let Outcome::Failed { error, .. } = o {
        if error.class() == ErrorClass::Config {
            return Some(Error::Store(StoreError::Config(error.to_string())));
        }
    }
    o.settle_error()
        .filter(|e| e.class() == ErrorClass::Config)
        .map(|e| Error::Ack(AckError::config(e.message.clone(), None)))
}

/// Runs `gate` over `deliveries` until the stream ends, it fails, or `shutdown` completes.
///
/// - At most `config.concurrency` batches are in flight; each holds whatever deliveries
///   were already waiting, up to `config.batch_size`.
/// - **The first delivered wins**: deliveries of one submission (the same
///   [claim identity](crate::ClaimMeta::identity): subject and submission timestamp,
///   whatever the payload) are claimed in the order the stream delivered them. Within a
///   batch the gate claims them in arrival order ([`crate::claim_order`]); a batch holding
///   an identity that an earlier batch still in flight holds waits for that batch to
///   settle before it claims anything. So of two payloads of one submission, the first
///   delivered takes effect and the later one is the conflict. Across processes sharing
///   one queue, arrival order is the broker's to keep: give one identity one consumer (a
///   broker's single active consumer, Kafka keys by subject).
/// - On shutdown the loop stops taking deliveries, finishes every one it has taken, and
///   returns. Nothing uncommitted is acked; deliveries never taken stay with the broker.
/// - `observe` sees every outcome (progress bars, metrics).
///
/// - A delivery that fails with a configuration error ([`ErrorClass::Config`]: a missing
///   table or privilege) is nacked, and the loop stops as on shutdown: no delivery can get
///   past such an error until an operator acts, so acking or dead-lettering them would be
///   wrong and retrying them would spin. So does a settlement the broker's setup refuses
///   ([`AckError::config`]: a dead letter its destination refuses for good), the
///   delivery left unsettled for the broker to deliver again after the fix.
///
/// # Performance
/// On tokio's multi-thread runtime, spawn this future (`tokio::spawn`) rather than
/// awaiting it in `block_on`'s own future (the body of `#[tokio::main]`): that future is
/// polled on a thread that is no worker and never polls the sockets, so each answer from
/// the store or the broker wakes it from another thread. The `idem` command, which spawns
/// it, took a third less CPU per message that way (docs/performance.md in the repository).
///
/// # Errors
/// [`Error::Stream`] when the delivery stream yields an error; [`Error::Store`] with
/// [`StoreError::Config`] after a configuration error; [`Error::Ack`] with an
/// [`AckError::config`] after a settlement the broker's setup refuses. In-flight work is
/// finished first.
pub async fn run<S, H, A, St, E>(
    gate: &Gate<S, H>,
    deliveries: St,
    config: ConsumerConfig,
    shutdown: impl Future<Output = ()>,
    observe: impl Fn(&Outcome) + Sync,
) -> Result<ConsumerStats, Error>
where
    S: ClaimStore,
    H: Handler<S::Tx>,
    A: Acker,
    St: Stream<Item = Result<Delivery<A>, E>>,
    E: Into<BoxError>,
{
    let counters = Counters::default();
    let stream_error: Mutex<Option<BoxError>> = Mutex::new(None);
    let config_error: Mutex<Option<Error>> = Mutex::new(None);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let stop_tx = Mutex::new(Some(stop_tx));
    let config = ConsumerConfig::new(config.concurrency, config.batch_size);
    let stop = futures::future::select(Box::pin(shutdown), stop_rx.map(|_| ())).map(|_| ());
    let turnstile = Mutex::new(Turnstile::default());
    let ordered = config.concurrency > 1;

    deliveries
        .take_until(stop)
        .scan((), |(), item| {
            futures::future::ready(match item {
                Ok(d) => Some(d),
                Err(e) => {
                    if let Ok(mut slot) = stream_error.lock() {
                        *slot = Some(e.into());
                    }
                    None
                }
            })
        })
        .map(|d| gate.identify(d))
        .ready_chunks(config.batch_size)
        .for_each_concurrent(
            config.concurrency,
            |mut batch: Vec<Identified<A, H::Input>>| {
                let counters = &counters;
                let observe = &observe;
                let config_error = &config_error;
                let stop_tx = &stop_tx;
                let turnstile = &turnstile;
                // Batches enter in arrival order: this closure is called in stream order.
                let turn = ordered.then(|| {
                    let identities = batch.iter().filter_map(Identified::identity).collect();
                    turnstile
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .enter(identities)
                });
                async move {
                    if let Some(turn) = &turn {
                        for wait in &turn.waits {
                            // Err: the earlier batch was dropped, which also frees it.
                            let _ = wait.clone().await;
                        }
                    }
                    let outcomes = if batch.len() == 1 {
                        match batch.pop() {
                            Some(d) => vec![gate.process_identified_delivery(d).await],
                            None => Vec::new(),
                        }
                    } else {
                        gate.process_identified_batch(batch).await
                    };
                    if let Some(turn) = turn {
                        turnstile
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .leave(&turn);
                        let _ = turn.done.send(());
                    }
                    for o in &outcomes {
                        counters.record(o);
                        observe(o);
                        if let Some(stop) = config_failure(o) {
                            if let Ok(mut slot) = config_error.lock() {
                                slot.get_or_insert(stop);
                            }
                            if let Some(tx) = stop_tx.lock().ok().and_then(|mut s| s.take()) {
                                let _ = tx.send(());
                            }
                        }
                    }
                }
            },
        )
        .await;

    if let Some(e) = config_error.lock().ok().and_then(|mut s| s.take()) {
        return Err(e);
    }
    let err = stream_error.lock().ok().and_then(|mut s| s.take());
    match err {
        Some(e) => Err(Error::Stream(e)),
        None => Ok(counters.snapshot()),
    }
}
