//! The [`Gate`]: claim → handler → commit → ack, one delivery or one batch at a time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::clock::SharedClock;
use crate::delivery::{Acker, Delivery, Headers};
use crate::error::{Error, HandlerError, RejectReason, StoreError};
use crate::key::IdempotencyKey;
use crate::store::{ClaimMeta, ClaimStore};
use crate::trace::TraceParent;

mod batch;
mod config;
mod judge;
mod single;

pub use config::{ConflictPolicy, GateConfig, RetryPolicy};
pub use idem_core::outcome::{
    Outcome, OutcomeKind, ATTEMPTS_EXHAUSTED, CONFLICT, PERMANENT_FAILURE, STORE_REJECTED,
};
use judge::Judge;

#[cfg(doc)]
use crate::delivery::AckProof;
#[cfg(doc)]
use crate::error::ErrorClass;

/// A delivery identified: its key, its subject, and the parsed input the handler needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submission<I> {
    /// The idempotency key derived from the delivery.
    pub key: IdempotencyKey,
    /// The business id (stored with the claim, shown in audit events).
    pub subject: String,
    /// What the handler works on.
    pub input: I,
}

/// The business side of a pipeline: how a delivery is identified and what its effect is.
///
/// # Contract
/// - [`identify`](Handler::identify) is pure: the same bytes give the same key. Bad input
///   is a [`RejectReason`] (the delivery is dead-lettered), never a panic.
/// - [`handle`](Handler::handle) writes only through `tx`, so its writes commit or roll
///   back with the claim. It never sees the acker. Returning `Err` rolls back;
///   [`HandlerError::Reject`] dead-letters the delivery and any other error nacks it for
///   redelivery.
#[async_trait]
pub trait Handler<Tx: Send>: Send + Sync {
    /// What `identify` parses out of a delivery.
    type Input: Send + Sync;

    /// Derives the key and parses the input from the raw delivery.
    fn identify(
        &self,
        payload: &[u8],
        headers: &Headers,
    ) -> Result<Submission<Self::Input>, RejectReason>;

    /// Applies the effect inside the claim's transaction.
    async fn handle(
        &self,
        tx: &mut Tx,
        submission: &Submission<Self::Input>,
    ) -> Result<(), HandlerError>;

    /// The metadata stored with `submission`'s claim. The default records the subject
    /// only; a pipeline whose key is derived from a submission timestamp overrides it to
    /// add [`ClaimMeta::with_submission_timestamp`], which lets a partitioned store file
    /// the claim by the message's own month (the grant handler does).
    fn claim_meta(&self, submission: &Submission<Self::Input>) -> ClaimMeta {
        ClaimMeta::new(submission.subject.clone())
    }

    /// Applies the effects of several claimed submissions of one batch, in one
    /// transaction. The default calls [`handle`](Handler::handle) for each; override it
    /// to write a batch in a few round trips. An `Err` rolls the whole batch back and the
    /// gate retries its deliveries one by one.
    async fn handle_batch(
        &self,
        tx: &mut Tx,
        submissions: &[&Submission<Self::Input>],
    ) -> Result<(), HandlerError> {
        for sub in submissions {
            self.handle(tx, sub).await?;
        }
        Ok(())
    }
}

/// The claim → commit → ack state machine.
///
/// For one delivery ([`process`](Gate::process)):
/// 1. identify it (bad input → dead-letter with the reason: [`Outcome::Rejected`]);
/// 2. begin a transaction and claim the key;
/// 3. `Claimed` → run the handler in the transaction → commit → ack
///    ([`Outcome::Processed`]); under [`GateConfig::check_attempts_before_handler`], a
///    delivery whose count of runs ([`Acker::attempt_counts_runs`]) is past
///    [`GateConfig::max_attempts`] is rolled back and dead-lettered unrun
///    ([`Outcome::Rejected`], [`ATTEMPTS_EXHAUSTED`]): its earlier runs never settled; `Duplicate` → roll back → ack ([`Outcome::Duplicate`]);
///    `InProgress` → roll back → nack with a delay ([`Outcome::Deferred`]);
///    `Conflict` (the same identity claimed under another key) → by
///    [`GateConfig::on_conflict`]: roll back → dead-letter naming both keys
///    ([`Outcome::Conflict`]), or claim the key again without its identity and go on as
///    `Claimed` ([`ConflictPolicy::Process`]);
/// 4. any error → roll back, then by its [`ErrorClass`]: transient → nack with a growing
///    delay ([`Outcome::Failed`]), or dead-letter once the attempts reach
///    [`GateConfig::max_attempts`]; a store outage → [`Acker::defer`] with the growing
///    delay (the broker keeps the delivery where it can, so an outage spends none of its
///    deliveries); permanent (the store or the handler refuses this
///    message for good) → dead-letter with the reason ([`Outcome::Rejected`]); config →
///    nack ([`Outcome::Failed`]) and [`consumer::run`](crate::consumer::run) stops.
///    A handler that panics is caught: a failed attempt like a transient error.
///
/// The ack needs an [`AckProof`], which only a commit or a duplicate claim mints.
///
/// ```
/// # use idem_engine::*;
/// # async fn demo<S, H, A>(gate: Gate<S, H>, delivery: Delivery<A>)
/// # where S: ClaimStore, H: Handler<S::Tx>, A: Acker {
/// match gate.process(delivery).await {
///     Outcome::Processed { key, .. } => println!("{} committed", key.short()),
///     Outcome::Duplicate { .. } => println!("skipped a redelivery"),
///     other => println!("{:?}", other.kind()),
/// }
/// # }
/// ```
pub struct Gate<S, H> {
    store: S,
    handler: H,
    config: GateConfig,
    observer: Option<Arc<dyn GateObserver>>,
    /// Failed attempts per key, for deliveries whose broker keeps no count.
    attempts: Mutex<HashMap<IdempotencyKey, u32>>,
    /// What decides whose fault a failure on the store's side is ([`Judge`]).
    judge: Mutex<Judge>,
    /// The last probe of the store ([`ClaimStore::probe`]): how many failures had been
    /// judged when it started, and whether it committed. Failures judged together share
    /// one probe that started after them.
    probe: futures::lock::Mutex<Option<(u64, bool)>>,
    /// When a probe last committed ([`Gate::store_proven`]).
    proven: Mutex<Option<Instant>>,
    /// Identities whose earlier payload failed or was deferred in this process and has
    /// not settled since, with that payload's key and the time by which it comes back:
    /// a later payload of the same identity waits for it ([`Gate::held_back`]), so the
    /// first delivered wins through a failed first attempt.
    unsettled: Mutex<HashMap<u64, (IdempotencyKey, Duration)>>,
    /// The delay each failed or deferred key was handed back with, until its identity's
    /// turn is recorded ([`Gate::track`]).
    handed_back: Mutex<HashMap<IdempotencyKey, Duration>>,
    /// Time, for every decision the gate makes by it (the explorer's is logical).
    clock: SharedClock,
    /// Held by the rerun being processed: reruns run one at a time in this gate, so a
    /// message that kills the process is never run beside another rerun, whose count
    /// ([`ClaimStore::note_run`]) it would raise with its own.
    reruns: futures::lock::Mutex<()>,
}

/// How many keys the gate's own attempt counter holds before it starts over (it only
/// serves brokers that keep no count; a reset means a few more attempts, never fewer).
const ATTEMPT_MEMORY: usize = 100_000;

impl<S: std::fmt::Debug, H: std::fmt::Debug> std::fmt::Debug for Gate<S, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("store", &self.store)
            .field("handler", &self.handler)
            .field("config", &self.config)
            .field("observer", &self.observer.is_some())
            .finish_non_exhaustive()
    }
}

/// A step of the pipeline whose latency a [`GateObserver`] sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Beginning the transaction and claiming (one key or a batch).
    Claim,
    /// The handler's business writes.
    Handler,
    /// The commit.
    Commit,
    /// Acknowledging with the broker after a commit or a duplicate claim.
    Ack,
}

impl Stage {
    /// A lowercase name (`claim`, `handler`, `commit`, `ack`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Handler => "handler",
            Self::Commit => "commit",
            Self::Ack => "ack",
        }
    }
}

/// Sees what a [`Gate`] does, for metrics.
///
/// # Contract
/// Methods are called inline on the delivery's task: they must be cheap and must not
/// block (update atomics, not a database).
pub trait GateObserver: Send + Sync {
    /// A stage took `elapsed` (for a batch, once for the whole batch).
    fn stage(&self, stage: Stage, elapsed: Duration) {
        let _ = (stage, elapsed);
    }

    /// A delivery ended with `outcome`.
    fn outcome(&self, outcome: &Outcome) {
        let _ = outcome;
    }
}

/// The dead-letter reason of a conflict: it names both keys in full (the subject and the
/// timestamp are in the payload; the payload itself never is).
///
/// ```
/// # use idem_engine::{IdempotencyKey, gate::conflict_reason};
/// let a = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{\"amount\":1}").unwrap();
/// let b = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{\"amount\":2}").unwrap();
/// let r = conflict_reason(&b, &a);
/// assert_eq!(r.code, "conflict");
/// assert!(r.detail.contains(&a.to_hex()) && r.detail.contains(&b.to_hex()));
/// ```
pub fn conflict_reason(key: &IdempotencyKey, existing: &IdempotencyKey) -> RejectReason {
    RejectReason::new(
        CONFLICT,
        format!(
            "key {key} conflicts with key {existing}: the same identity (subject and \
             submission timestamp) was already claimed with a different payload"
        ),
    )
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}

/// The handler panicked; the gate caught it and counts it as a failed attempt.
#[derive(Debug, thiserror::Error)]
#[error("the handler panicked: {0}")]
pub struct HandlerPanic(pub String);

impl<S, H> Gate<S, H>
where
    S: ClaimStore,
    H: Handler<S::Tx>,
{
    /// A gate with the default configuration.
    pub fn new(store: S, handler: H) -> Self {
        Self::with_config(store, handler, GateConfig::default())
    }

    /// A gate with `config`.
    pub fn with_config(store: S, handler: H, config: GateConfig) -> Self {
        Self {
            store,
            handler,
            config,
            observer: None,
            attempts: Mutex::new(HashMap::new()),
            judge: Mutex::new(Judge::default()),
            probe: futures::lock::Mutex::new(None),
            proven: Mutex::new(None),
            unsettled: Mutex::new(HashMap::new()),
            handed_back: Mutex::new(HashMap::new()),
            clock: crate::clock::system(),
            reruns: futures::lock::Mutex::new(()),
        }
    }

    /// Reads time from `clock` for every decision it makes by time (whose fault a failure
    /// is, how long a later payload waits for an earlier one); the default is the
    /// process's monotonic clock. The explorer gives its logical one.
    #[must_use]
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Reports stage latencies and outcomes to `observer`.
    #[must_use]
    pub fn with_observer(mut self, observer: Arc<dyn GateObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    fn timed(&self, stage: Stage, started: Instant) {
        if let Some(o) = &self.observer {
            o.stage(stage, started.elapsed());
        }
    }

    fn observed(&self, outcome: Outcome) -> Outcome {
        // A committed handler write is evidence that the business path works (a
        // duplicate, which writes nothing, is none).
        if matches!(outcome, Outcome::Processed { .. }) {
            lock(&self.judge).last_processed = Some(self.clock.now());
        }
        if let Some(o) = &self.observer {
            o.outcome(&outcome);
        }
        outcome
    }

    /// When the store last proved that it works while deliveries failed on its side: the
    /// start of the latest [probe](ClaimStore::probe) that committed (`None`: none did
    /// yet). A supervisor that gives up on a store failing for long reads it, so that one
    /// message failing alone (the store's probes commit) is not taken for a failing store.
    pub fn store_proven(&self) -> Option<Instant> {
        *lock(&self.proven)
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// The configuration.
    pub fn config(&self) -> &GateConfig {
        &self.config
    }
}

/// Locks `m`, whatever a panicking holder left in it (every value here stays valid).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A delivery whose transaction was fenced ([`StoreError::Fenced`]): its partition was
/// taken by another member, which has it now. Rolled back, and left unsettled: an ack
/// would be a lie, a nack or a dead letter would settle what is no longer ours.
fn fenced<A: Acker>(delivery: Delivery<A>, key: IdempotencyKey, e: StoreError) -> Outcome {
    tracing::warn!(target: "idem::gate", key = key.short(), error = %e, "fenced: the partition was taken by another member; left to it");
    drop(delivery);
    Outcome::Failed {
        key: Some(key),
        error: e.into(),
        settle: Ok(()),
    }
}

/// A delivery of a batch with its position and its identification.
/// A delivery of a batch with its position in the batch and its submission.
type Positioned<A, I> = (usize, Delivery<A>, Submission<I>);

/// A delivery [identified](Gate::identify) but not yet processed: its submission (or why
/// it is refused) and its claim identity.
#[derive(Debug)]
pub struct Identified<A, I> {
    delivery: Delivery<A>,
    submission: Result<Submission<I>, RejectReason>,
    identity: Option<u64>,
}

impl<A, I> Identified<A, I> {
    /// A hash of the submission's [claim identity](ClaimMeta::identity) (subject and
    /// submission timestamp): equal for every payload of one submission. `None` for a
    /// delivery that is refused, or whose claim carries no identity. Two identities may
    /// share a hash: a caller may only use it to keep deliveries in order, never to
    /// decide an outcome.
    pub fn identity(&self) -> Option<u64> {
        self.identity
    }

    /// The delivery.
    pub fn delivery(&self) -> &Delivery<A> {
        &self.delivery
    }
}

/// A traced delivery's context: the sender's (its `traceparent` header) and the one of
/// the delivery's own span, a child of it.
#[derive(Debug, Clone, Copy)]
struct SpanTrace {
    upstream: TraceParent,
    own: TraceParent,
}

/// The own trace context of the batch's delivery at position `i`.
fn own(traces: &[Option<SpanTrace>], i: usize) -> Option<TraceParent> {
    traces.get(i).copied().flatten().map(|t| t.own)
}

impl SpanTrace {
    /// `None` without a valid `traceparent` header (a malformed one is ignored).
    fn of(headers: &Headers) -> Option<Self> {
        let upstream = TraceParent::from_headers(headers)?;
        Some(Self {
            upstream,
            own: upstream.child(),
        })
    }

    /// Fills in `span`'s `trace_id`, `parent_id` and `span_id`.
    fn record(&self, span: &tracing::Span) {
        if span.is_disabled() {
            return;
        }
        span.record("trace_id", self.upstream.trace_id_hex().as_str());
        span.record("parent_id", self.upstream.parent_id_hex().as_str());
        span.record("span_id", self.own.parent_id_hex().as_str());
    }
}

#[cold]
fn unreachable_outcome() -> Outcome {
    // Every position is filled above; this keeps the function total without a panic.
    Outcome::Failed {
        key: None,
        error: Error::Store(StoreError::other(
            "internal: delivery left unsettled",
            false,
        )),
        settle: Ok(()),
    }
}
