//! The [`Gate`]: claim → handler → commit → ack, one delivery or one batch at a time.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::FutureExt as _;
use tracing::Instrument as _;

use crate::audit;
use crate::clock::SharedClock;
use crate::delivery::{AckProof, Acker, CommitReceipt, Delivery, Headers};
use crate::error::{AckError, BoxError, Error, ErrorClass, HandlerError, RejectReason, StoreError};
use crate::key::IdempotencyKey;
use crate::mutant::{self, Mutant};
use crate::position::PositionMove;
use crate::store::RunNote;
use crate::store::{claim_order, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx};
use crate::trace::{self, TraceParent};

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

/// The coarse kind of an [`Outcome`], for counters and reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OutcomeKind {
    /// Committed and acked.
    Processed,
    /// Already committed before: rolled back and acked.
    Duplicate,
    /// Claimed elsewhere and not finished: nacked with a delay.
    Deferred,
    /// Bad input: dead-lettered with a reason.
    Rejected,
    /// Rolled back and nacked for redelivery.
    Failed,
    /// The same submission (identity) with another payload: rolled back and dead-lettered.
    Conflict,
}

impl OutcomeKind {
    /// A lowercase name (`processed`, `duplicate`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Duplicate => "duplicate",
            Self::Deferred => "deferred",
            Self::Rejected => "rejected",
            Self::Failed => "failed",
            Self::Conflict => "conflict",
        }
    }
}

/// What happened to one delivery. Each variant carries the result of settling it with the
/// broker: a commit that succeeded followed by a failed ack is `Processed` with an `Err`
/// settlement — the redelivery will be skipped as a duplicate.
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome {
    /// Committed, then acked.
    Processed {
        /// The submission's key.
        key: IdempotencyKey,
        /// The ack's result.
        settle: Result<(), AckError>,
    },
    /// The key was already committed: rolled back, touched nothing, acked.
    Duplicate {
        /// The submission's key.
        key: IdempotencyKey,
        /// The ack's result.
        settle: Result<(), AckError>,
    },
    /// Claimed elsewhere and still live: nacked with the defer delay.
    Deferred {
        /// The submission's key.
        key: IdempotencyKey,
        /// The nack's result.
        settle: Result<(), AckError>,
    },
    /// Bad input: dead-lettered with the reason.
    Rejected {
        /// Why.
        reason: RejectReason,
        /// The dead-letter's result (on `Err` the delivery stays in the source).
        settle: Result<(), AckError>,
    },
    /// Rolled back and nacked for redelivery.
    Failed {
        /// The key, when it could be derived.
        key: Option<IdempotencyKey>,
        /// What failed.
        error: Error,
        /// The nack's result.
        settle: Result<(), AckError>,
    },
    /// The submission's identity (subject + submission timestamp) was already claimed
    /// under another key — the same submission sent again with a different payload — and
    /// the pipeline's policy is [`ConflictPolicy::DeadLetter`]: rolled back and
    /// dead-lettered with a reason ([`CONFLICT`]) naming both keys.
    Conflict {
        /// This delivery's key.
        key: IdempotencyKey,
        /// The key that claimed the identity first.
        existing: IdempotencyKey,
        /// The reason it was dead-lettered with.
        reason: RejectReason,
        /// The dead-letter's result (on `Err` the delivery stays in the source).
        settle: Result<(), AckError>,
    },
}

impl Outcome {
    /// The coarse kind.
    pub fn kind(&self) -> OutcomeKind {
        match self {
            Self::Processed { .. } => OutcomeKind::Processed,
            Self::Duplicate { .. } => OutcomeKind::Duplicate,
            Self::Deferred { .. } => OutcomeKind::Deferred,
            Self::Rejected { .. } => OutcomeKind::Rejected,
            Self::Failed { .. } => OutcomeKind::Failed,
            Self::Conflict { .. } => OutcomeKind::Conflict,
        }
    }

    /// The key, when one was derived.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        match self {
            Self::Processed { key, .. }
            | Self::Duplicate { key, .. }
            | Self::Deferred { key, .. }
            | Self::Conflict { key, .. } => Some(key),
            Self::Failed { key, .. } => key.as_ref(),
            Self::Rejected { .. } => None,
        }
    }

    /// The settlement error, if settling with the broker failed.
    pub fn settle_error(&self) -> Option<&AckError> {
        match self {
            Self::Processed { settle, .. }
            | Self::Duplicate { settle, .. }
            | Self::Deferred { settle, .. }
            | Self::Rejected { settle, .. }
            | Self::Failed { settle, .. }
            | Self::Conflict { settle, .. } => settle.as_ref().err(),
        }
    }
}

/// How long a failed delivery waits before its redelivery: a delay that grows with the
/// attempt number, capped, with jitter so a burst of failures does not come back at once.
///
/// The delay of attempt `n` (counted from 1) is `min(max, initial × 2^(n-1))`, and with
/// jitter a deterministic fraction of it between one half and all of it (derived from the
/// key and the attempt, so a replay sees the same delays). The growing, capped delay is
/// the same `backon` exponential backoff as [`Backoff`](crate::outbox::Backoff)'s
/// (doubling in `f32` seconds: a few parts in ten million off the exact double; `max`
/// exact).
///
/// ```
/// use std::time::Duration;
/// use idem_core::gate::RetryPolicy;
/// let p = RetryPolicy::default();
/// assert!(p.delay(None, 1) <= p.initial);
/// assert!(p.delay(None, 30) <= p.max);
/// assert_eq!(RetryPolicy::fixed(Duration::from_secs(2)).delay(None, 7), Duration::from_secs(2));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// The delay of the first retry.
    pub initial: Duration,
    /// The longest delay.
    pub max: Duration,
    /// Whether the delay is spread between one half and all of its value.
    pub jitter: bool,
}

impl Default for RetryPolicy {
    /// 200 ms, doubling, capped at one minute, with jitter.
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(60),
            jitter: true,
        }
    }
}

impl RetryPolicy {
    /// The same delay for every attempt, without jitter.
    pub fn fixed(delay: Duration) -> Self {
        Self {
            initial: delay,
            max: delay,
            jitter: false,
        }
    }

    /// A growing policy.
    pub fn exponential(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
            jitter: true,
        }
    }

    /// The delay before redelivering attempt `attempt` (1 for the first delivery) of `key`.
    pub fn delay(&self, key: Option<&IdempotencyKey>, attempt: u32) -> Duration {
        let full = crate::backoff::nth(crate::backoff::ceilings(self.initial, self.max), attempt);
        if !self.jitter {
            return full;
        }
        // splitmix64 over the key's first bytes and the attempt: a deterministic fraction
        // of the full delay, in thousandths from 500 to 1000. Not backon's jitter, which
        // draws from a sequence: a nack delay must be a function of (key, attempt) alone,
        // and idem-testkit's explorer (its states hash the pending delays) sees these
        // exact values.
        let seed = key.map_or(0, |k| {
            let b = k.as_bytes();
            u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
        });
        let mut z = seed ^ u64::from(attempt).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let per_mille = 500 + u32::try_from(z % 501).unwrap_or(500);
        full.mul_f64(f64::from(per_mille) / 1000.0)
    }
}

/// How the gate settles what it cannot process now.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GateConfig {
    /// The nack delay of a [`OutcomeKind::Deferred`] delivery (a key held elsewhere).
    pub defer_delay: Duration,
    /// The nack delay of a delivery that failed with a transient error.
    pub retry: RetryPolicy,
    /// How many failed attempts of a delivery, each its own fault, dead-letter it with
    /// the last error (`attempts_exhausted`) instead of handing it back again. Default 10.
    ///
    /// Whose fault a failure is, is decided by evidence the store gives:
    /// - the handler's own errors and panics are the message's, counted by the broker's
    ///   delivery count ([`Delivery::attempt`]) where it keeps one;
    /// - [`StoreError::Degraded`] (a lock wait anywhere in the transaction, a read-only
    ///   node, a full disk) is the store's: never counted, the delivery is deferred;
    /// - any other failure on the store's side (unreachable, a broken connection, a
    ///   statement timeout, a serialization failure, an internal error, a handler past its
    ///   deadline, idem-runtime's `Deadline`) counts only when it is this message's
    ///   alone — since its previous failure another delivery committed its writes, or no
    ///   other delivery failed on the store — and the store's own write
    ///   ([`ClaimStore::probe`]) commits right after it. Such failures are counted by the
    ///   gate in this process (not by the broker, whose count also holds the redeliveries
    ///   of an outage), each when it happens: a store that is down, slow or failing for
    ///   everyone dead-letters nothing, and faults met during an outage are not charged
    ///   when it ends. Two messages that fail together while nothing else commits look
    ///   like a store failing for everyone: they are deferred until one of them, or
    ///   another delivery, commits.
    pub max_attempts: u32,
    /// Also check the attempts *before* the handler, so that a message that kills its
    /// process each time it runs (an OOM kill, an abort in a native library, a stack
    /// overflow) is dead-lettered unrun after [`max_attempts`](Self::max_attempts) runs
    /// instead of being run for ever. On by default.
    ///
    /// A *rerun* is a delivery whose broker counts runs ([`Acker::attempt_counts_runs`])
    /// and whose attempt is past 1: an earlier delivery of it never settled. A rerun is
    /// processed alone (never in a batch), one at a time per gate, and the store records
    /// that it starts before its handler runs ([`ClaimStore::note_run`], durable). A rerun
    /// whose recorded runs, with its first, would pass `max_attempts` claims its key, is
    /// rolled back and dead-lettered `attempts_exhausted` ("not run again"). The
    /// neighbours that sat in the dying process's buffer were counted by the broker but
    /// never started, so they are not charged; one that was running beside a first
    /// delivery that killed the process is charged one run for it. The record costs one
    /// write per rerun and nothing on a first delivery. A store that keeps no record
    /// (`note_run` answers `None`) makes the check a no-op.
    pub check_attempts_before_handler: bool,
    /// What a [`ClaimOutcome::Conflict`] (the same submission with another payload)
    /// leads to. Default [`ConflictPolicy::DeadLetter`].
    pub on_conflict: ConflictPolicy,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self {
            defer_delay: Duration::from_secs(1),
            retry: RetryPolicy::default(),
            max_attempts: 10,
            on_conflict: ConflictPolicy::DeadLetter,
            check_attempts_before_handler: true,
        }
    }
}

/// What the gate does with a submission whose identity (subject + submission timestamp,
/// [`ClaimMeta::identity`]) is already claimed under another key: the same submission
/// sent again with a different payload (an amount changed, fields reordered, a space
/// added), which the seed-compatible key derivation turns into a new key.
///
/// Either way an audit event (`outcome = "conflict"`) names both key prefixes and the
/// policy. Only stores that [detect conflicts](crate::Capabilities::detects_conflicts)
/// report them; with any other store both policies process the submission.
///
/// ```
/// use idem_core::gate::ConflictPolicy;
/// assert_eq!("process".parse::<ConflictPolicy>(), Ok(ConflictPolicy::Process));
/// assert_eq!(ConflictPolicy::default().as_str(), "dead-letter");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ConflictPolicy {
    /// Roll back and dead-letter the delivery with a reason ([`CONFLICT`]) naming both
    /// keys: [`Outcome::Conflict`]. Nothing of it is written; its redeliveries conflict
    /// again. The default.
    #[default]
    DeadLetter,
    /// The reference behaviour: process it as a submission of its own (a second effect).
    /// The gate re-claims the key in the same transaction without the identity
    /// ([`ClaimMeta::without_identity`]), so the key's own unique index still makes its
    /// redeliveries duplicates; the outcome is `Processed` (or `Duplicate`).
    Process,
}

impl ConflictPolicy {
    /// `dead-letter` or `process`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::DeadLetter => "dead-letter",
            Self::Process => "process",
        }
    }
}

impl std::fmt::Display for ConflictPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ConflictPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "dead-letter" => Ok(Self::DeadLetter),
            "process" => Ok(Self::Process),
            other => Err(format!(
                "unknown conflict policy {other:?}: expected dead-letter or process"
            )),
        }
    }
}

impl GateConfig {
    /// Sets the defer delay.
    #[must_use]
    pub fn with_defer_delay(mut self, d: Duration) -> Self {
        self.defer_delay = d;
        self
    }

    /// A fixed retry delay (`None`: at once) instead of the growing default.
    #[must_use]
    pub fn with_retry_delay(mut self, d: Option<Duration>) -> Self {
        self.retry = RetryPolicy::fixed(d.unwrap_or(Duration::ZERO));
        self
    }

    /// Sets the retry policy.
    #[must_use]
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Sets the attempt limit (at least 1).
    #[must_use]
    pub fn with_max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// Sets [`check_attempts_before_handler`](Self::check_attempts_before_handler).
    #[must_use]
    pub fn with_check_attempts_before_handler(mut self, on: bool) -> Self {
        self.check_attempts_before_handler = on;
        self
    }

    /// Sets the [`ConflictPolicy`].
    #[must_use]
    pub fn with_on_conflict(mut self, policy: ConflictPolicy) -> Self {
        self.on_conflict = policy;
        self
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
/// # use idem_core::*;
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

/// Why a delivery past the attempt limit is dead-lettered unrun.
/// `reruns`: the runs recorded, the first included (its own rerun's note counts the
/// first run, which is never recorded).
fn overrun_reason<A>(delivery: &Delivery<A>, reruns: u32, max_attempts: u32) -> RejectReason {
    RejectReason::new(
        ATTEMPTS_EXHAUSTED,
        format!(
            "ran {reruns} times (the limit is {max_attempts}; delivered {} times) and no \
             run settled: each ended its consumer (a crash, an OOM kill, a timeout of the \
             process); not run again",
            delivery.attempt.unwrap_or_default()
        ),
    )
}

/// The reason code of a delivery dead-lettered because its attempts ran out.
pub const ATTEMPTS_EXHAUSTED: &str = "attempts_exhausted";
/// The reason code of a delivery dead-lettered because the store refused it for good.
pub const STORE_REJECTED: &str = "store_rejected";
/// The reason code of a delivery dead-lettered because of another permanent failure.
pub const PERMANENT_FAILURE: &str = "permanent_failure";
/// The reason code of a delivery dead-lettered because its identity was already claimed
/// under another key ([`Outcome::Conflict`]).
pub const CONFLICT: &str = "conflict";

/// The dead-letter reason of a conflict: it names both keys in full (the subject and the
/// timestamp are in the payload; the payload itself never is).
///
/// ```
/// # use idem_core::{IdempotencyKey, gate::conflict_reason};
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

    /// Processes one delivery: see the type's docs. Runs in a `delivery` span (target
    /// `idem::gate`) whose `key` (prefix) and `outcome` fields are filled in, and, for a
    /// delivery with a valid W3C `traceparent` header, `trace_id`, `parent_id` (the
    /// sender's span) and `span_id` (this delivery's own span: the parent of the outbox
    /// events its handler writes, see [`crate::trace`]). A debug event (`delivery
    /// settled`) in the span logs it once it is settled.
    pub async fn process<A: Acker>(&self, delivery: Delivery<A>) -> Outcome {
        let identified = self.identify(delivery);
        self.process_identified_delivery(identified).await
    }

    /// Identifies a delivery (parses it and derives its key) without settling it: the
    /// first half of [`process`](Gate::process), for a caller that must know a delivery's
    /// [claim identity](Identified::identity) before it processes it (the consumer loop
    /// keeps the deliveries of one identity in arrival order, [`crate::consumer`]).
    pub fn identify<A: Acker>(&self, delivery: Delivery<A>) -> Identified<A, H::Input> {
        let submission = self.handler.identify(&delivery.payload, &delivery.headers);
        let identity = submission
            .as_ref()
            .ok()
            .and_then(|sub| self.identity_of(sub));
        Identified {
            delivery,
            submission,
            identity,
        }
    }

    /// A hash of `sub`'s [claim identity](ClaimMeta::identity) ([`Identified::identity`]).
    fn identity_of(&self, sub: &Submission<H::Input>) -> Option<u64> {
        let meta = self.handler.claim_meta(sub);
        meta.identity().map(|(subject, ts)| {
            use std::hash::{Hash as _, Hasher as _};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (subject, ts).hash(&mut h);
            h.finish()
        })
    }

    /// Whether `sub` must wait: an earlier payload of its identity (another key) failed or
    /// was deferred in this process and has not settled since. **The first delivered
    /// wins** through a failed first attempt: the later payload is deferred, not claimed,
    /// until the earlier one settles — or until the time by which the earlier one was due
    /// back has passed with two deferrals' delay to spare (it went to another consumer;
    /// the store's identity check then decides).
    fn held_back(&self, sub: &Submission<H::Input>) -> bool {
        if mutant::active(Mutant::LaterPayloadNotHeld) {
            return false;
        }
        let mut map = lock(&self.unsettled);
        if map.is_empty() {
            return false;
        }
        let Some(id) = self.identity_of(sub) else {
            return false;
        };
        match map.get(&id) {
            Some((k, until)) if *k != sub.key => {
                if self.clock.now() < *until {
                    true
                } else {
                    map.remove(&id);
                    false
                }
            }
            _ => false,
        }
    }

    /// Records whether `sub`'s delivery left its identity unsettled (`settled` false: it
    /// failed or was deferred, and comes back after the delay it was handed back with)
    /// for [`held_back`](Gate::held_back).
    fn track(&self, sub: &Submission<H::Input>, settled: bool) {
        let delay = lock(&self.handed_back).remove(&sub.key);
        let mut map = lock(&self.unsettled);
        if settled && map.is_empty() {
            return;
        }
        let Some(id) = self.identity_of(sub) else {
            return;
        };
        if settled {
            if map.get(&id).is_some_and(|(k, _)| *k == sub.key) {
                map.remove(&id);
            }
            return;
        }
        let now = self.clock.now();
        if map.len() >= ATTEMPT_MEMORY && !map.contains_key(&id) {
            map.retain(|_, (_, until)| now < *until);
            if map.len() >= ATTEMPT_MEMORY {
                map.clear();
            }
        }
        // Due back after its delay; a later payload, deferred for `defer_delay` each time,
        // waits two deferrals past that (a redelivery a little late, or handed back in
        // one batch behind the later payload, still comes first).
        let until = now
            .saturating_add(delay.unwrap_or(self.config.defer_delay))
            .saturating_add(self.config.defer_delay.saturating_mul(2));
        let entry = map.entry(id).or_insert((sub.key, until));
        if entry.0 == sub.key {
            entry.1 = until;
        }
    }

    /// Notes the delay `key`'s delivery was handed back with, for [`track`](Gate::track).
    fn handing_back(&self, key: &IdempotencyKey, delay: Duration) {
        let mut map = lock(&self.handed_back);
        if map.len() >= ATTEMPT_MEMORY {
            map.clear();
        }
        map.insert(*key, delay);
    }

    /// Defers a delivery held back for an earlier payload of its identity.
    async fn hold<A: Acker>(&self, delivery: Delivery<A>, key: IdempotencyKey) -> Outcome {
        tracing::debug!(
            target: "idem::gate",
            key = key.short(),
            "an earlier payload of this submission has not settled; deferred behind it"
        );
        let settle = delivery.acker.defer(self.config.defer_delay).await;
        Outcome::Deferred { key, settle }
    }

    /// [`process`](Gate::process) for a delivery already [identified](Gate::identify).
    pub async fn process_identified_delivery<A: Acker>(
        &self,
        identified: Identified<A, H::Input>,
    ) -> Outcome {
        let Identified {
            delivery,
            submission,
            ..
        } = identified;
        let span = tracing::info_span!(
            target: "idem::gate",
            "delivery",
            key = tracing::field::Empty,
            outcome = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            parent_id = tracing::field::Empty,
            span_id = tracing::field::Empty
        );
        let trace = SpanTrace::of(&delivery.headers);
        if let Some(t) = &trace {
            t.record(&span);
        }
        let outcome = async {
            match submission {
                Ok(sub) => {
                    tracing::Span::current().record("key", sub.key.short().as_str());
                    self.process_identified(delivery, sub, trace.map(|t| t.own))
                        .await
                }
                Err(reason) => self.reject(delivery, None, reason).await,
            }
        }
        .instrument(span.clone())
        .await;
        span.record("outcome", outcome.kind().as_str());
        if tracing::enabled!(target: "idem::gate", tracing::Level::DEBUG) {
            span.in_scope(|| tracing::debug!(target: "idem::gate", "delivery settled"));
        }
        self.observed(outcome)
    }

    async fn reject<A: Acker>(
        &self,
        delivery: Delivery<A>,
        subject: Option<&str>,
        reason: RejectReason,
    ) -> Outcome {
        audit::rejected(subject, reason.code);
        let settle = delivery.dead_letter(&reason).await;
        Outcome::Rejected { reason, settle }
    }

    /// Dead-letters a conflicting delivery (its transaction already rolled back).
    async fn conflict<A: Acker>(
        &self,
        delivery: Delivery<A>,
        key: IdempotencyKey,
        existing: IdempotencyKey,
        subject: &str,
    ) -> Outcome {
        audit::conflict(&key, &existing, subject, ConflictPolicy::DeadLetter);
        tracing::warn!(
            target: "idem::gate",
            key = %key.short(),
            existing = %existing.short(),
            "the same submission was already claimed with another payload; dead-lettered"
        );
        let reason = conflict_reason(&key, &existing);
        let settle = delivery.dead_letter(&reason).await;
        Outcome::Conflict {
            key,
            existing,
            reason,
            settle,
        }
    }

    /// Whether a rerun whose store recorded `reruns` reruns (this one included) is past
    /// the attempt limit: its first run and its reruns never settled, so its handler is
    /// not run again.
    fn overrun(&self, reruns: Option<u32>) -> bool {
        reruns.is_some_and(|r| r >= self.config.max_attempts)
    }

    /// Records a rerun's start ([`ClaimStore::note_run`]); `None` when the store keeps
    /// no record or could not write it (the rerun then runs unchecked: better than
    /// holding it back on a record that cannot be written).
    async fn note_rerun(&self, key: &IdempotencyKey) -> Option<u32> {
        match self.store.note_run(key, RunNote::Started).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(
                    target: "idem::gate",
                    key = key.short(),
                    error = %e,
                    "could not record a rerun's start; it runs without the attempt check"
                );
                None
            }
        }
    }

    /// Best effort: a note that fails leaves a count of one run more, which only
    /// matters if the key comes back unsettled.
    async fn note(&self, key: &IdempotencyKey, reruns: Option<u32>, note: RunNote) {
        if reruns.is_some() {
            if let Err(e) = self.store.note_run(key, note).await {
                tracing::debug!(target: "idem::gate", key = key.short(), error = %e, "run note failed");
            }
        }
    }

    /// Whether `delivery`'s attempt is checked before its handler: on, and a count of
    /// runs.
    fn reruns_checked<A: Acker>(&self, delivery: &Delivery<A>) -> bool {
        self.config.check_attempts_before_handler
            && delivery.acker.attempt_counts_runs()
            && !mutant::active(Mutant::NoAttemptCheckBeforeHandler)
    }

    /// Whether `delivery` is a rerun whose attempt is checked before its handler: an
    /// earlier run failed or ended its process. Such a delivery is processed alone, never
    /// in a batch.
    fn rerun<A: Acker>(&self, delivery: &Delivery<A>) -> bool {
        delivery.attempt.is_some_and(|n| n > 1) && self.reruns_checked(delivery)
    }

    /// The attempt number of a failed delivery: the broker's count, else the gate's own.
    fn attempt_of(&self, delivery_attempt: Option<u32>, key: Option<&IdempotencyKey>) -> u32 {
        if let Some(n) = delivery_attempt {
            return n.max(1);
        }
        let Some(key) = key else { return 1 };
        let mut map = self
            .attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.len() >= ATTEMPT_MEMORY {
            map.clear();
        }
        let n = map.entry(*key).or_insert(0);
        *n += 1;
        *n
    }

    fn forget_attempts(&self, key: &IdempotencyKey) {
        let mut map = lock(&self.attempts);
        if !map.is_empty() {
            map.remove(key);
        }
        drop(map);
        lock(&self.judge).forget(key);
    }

    /// Whether the store answers for itself: a probe ([`ClaimStore::probe`]) that started
    /// after failure number `failure` was recorded committed. Probes are shared: a failure
    /// judged while another's probe runs waits for it, and uses it if it started after
    /// the failure.
    async fn store_works(&self, failure: u64) -> bool {
        let mut last = self.probe.lock().await;
        if let Some((after, ok)) = *last {
            if after >= failure {
                return ok;
            }
        }
        let started = lock(&self.judge).seen;
        let wall = Instant::now();
        let ok = match self.store.probe().await {
            Ok(()) => {
                *lock(&self.proven) = Some(wall);
                true
            }
            Err(e) => {
                tracing::debug!(target: "idem::gate", error = %e, "the store's probe failed: the failure is the store's");
                false
            }
        };
        *last = Some((started, ok));
        ok
    }

    /// Judges a failure on the store's side (see [`Fault::Judged`]) of `key`'s delivery:
    /// returns how many such failures were charged to the key in this process, and
    /// whether this one was. It is charged when it is this message's alone — since the
    /// key's previous failure another delivery committed its handler's writes, or no
    /// other key failed on the store — and the store's own probe commits right after it.
    /// Duplicates (which write nothing) are no evidence, and each failure is judged when
    /// it happens, never later: faults met during an outage are not charged when the store
    /// comes back.
    async fn judge(&self, key: Option<&IdempotencyKey>) -> (u32, bool) {
        let Some(key) = key else { return (0, false) };
        let now = self.clock.now();
        let lookback = self.config.retry.max.max(Duration::from_secs(1));
        let (candidate, failure) = lock(&self.judge).failed(key, now, lookback);
        let charged = mutant::active(Mutant::StoreFaultCharged)
            || (candidate && self.store_works(failure).await);
        let mut judge = lock(&self.judge);
        let n = judge.charge(key, charged);
        (n, charged)
    }

    /// Settles a delivery whose transaction failed (and was rolled back), by the error's
    /// class and whose fault it is: the one place that decides between nack, deferral,
    /// dead letter and stop. `reruns`: the run recorded for a rerun whose handler ran
    /// (taken back when the failure is the store's, which never charges a run).
    async fn fail<A: Acker>(
        &self,
        delivery: Delivery<A>,
        key: Option<IdempotencyKey>,
        subject: Option<&str>,
        error: Error,
        reruns: Option<u32>,
    ) -> Outcome {
        let class = error.class();
        let fault = Fault::of(&error);
        let (attempt, counted) = match fault {
            Fault::Store if !mutant::active(Mutant::StoreFaultCharged) => {
                if let Some(k) = &key {
                    // Never charged, but its retry delay grows like any other's.
                    lock(&self.judge).uncharged(k, self.clock.now());
                }
                (0, false)
            }
            Fault::Store | Fault::Judged => self.judge(key.as_ref()).await,
            Fault::Message => (self.attempt_of(delivery.attempt, key.as_ref()), true),
        };
        if !counted {
            if let Some(k) = &key {
                self.note(k, reruns, RunNote::NotRun).await;
            }
        }
        let dead_letter = match class {
            ErrorClass::Permanent if !mutant::active(Mutant::PermanentErrorNacked) => {
                let code = if matches!(
                    &error,
                    Error::Store(StoreError::Rejected { .. })
                        | Error::Handler(HandlerError::Store(StoreError::Rejected { .. }))
                ) {
                    STORE_REJECTED
                } else {
                    PERMANENT_FAILURE
                };
                Some(RejectReason::new(code, error.to_string()))
            }
            ErrorClass::Transient if counted && attempt >= self.config.max_attempts => {
                Some(RejectReason::new(
                    ATTEMPTS_EXHAUSTED,
                    if fault == Fault::Message {
                        format!("{attempt} attempts; the last failed with: {error}")
                    } else {
                        format!(
                            "{attempt} attempts failed on this message while the store \
                             worked (its own write committed after each, and the failure \
                             was this message's alone); the last failed with: {error}"
                        )
                    },
                ))
            }
            _ => None,
        };
        if let Some(reason) = dead_letter {
            tracing::warn!(
                target: "idem::gate",
                key = key.as_ref().map(IdempotencyKey::short).unwrap_or_default(),
                class = class.as_str(),
                attempt,
                error = %error,
                "delivery failed for good; rolled back and dead-lettered"
            );
            if let Some(k) = &key {
                self.forget_attempts(k);
            }
            return self.reject(delivery, subject, reason).await;
        }
        let delay = self.config.retry.delay(
            key.as_ref(),
            attempt.max(lock(&self.judge).failures(key.as_ref())),
        );
        tracing::warn!(
            target: "idem::gate",
            key = key.as_ref().map(IdempotencyKey::short).unwrap_or_default(),
            class = class.as_str(),
            attempt,
            charged = counted,
            retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            error = %error,
            "delivery failed; rolled back and handed back"
        );
        if let Some(k) = &key {
            self.handing_back(k, delay);
        }
        // A failure on the store's side is not the message's doing: where the broker
        // allows, the delivery is kept and handed back without costing a broker delivery.
        let settle = if fault != Fault::Message && !mutant::active(Mutant::OutageNacked) {
            delivery.acker.defer(delay).await
        } else {
            delivery.acker.nack(Some(delay)).await
        };
        Outcome::Failed { key, error, settle }
    }

    /// Runs the handler, turning a panic into a failed attempt.
    async fn guarded<F>(&self, stage_started: Instant, fut: F) -> Result<(), HandlerError>
    where
        F: std::future::Future<Output = Result<(), HandlerError>>,
    {
        let r = AssertUnwindSafe(fut).catch_unwind().await;
        self.timed(Stage::Handler, stage_started);
        match r {
            Ok(r) => r,
            Err(p) => {
                let e: BoxError = Box::new(HandlerPanic(panic_message(&*p)));
                Err(HandlerError::Transient(e))
            }
        }
    }

    /// `trace`: the delivery's own trace context, current while the handler runs.
    async fn process_identified<A: Acker>(
        &self,
        delivery: Delivery<A>,
        sub: Submission<H::Input>,
        trace: Option<TraceParent>,
    ) -> Outcome {
        if self.held_back(&sub) {
            return self.hold(delivery, sub.key).await;
        }
        let outcome = self.claim_and_settle(delivery, &sub, trace).await;
        let settled = match &outcome {
            Outcome::Failed { error, .. } => {
                matches!(error, Error::Store(e) if e.is_fenced())
            }
            Outcome::Deferred { .. } => false,
            _ => true,
        };
        self.track(&sub, settled);
        outcome
    }

    /// [`process_identified`](Gate::process_identified) once it is the identity's turn.
    async fn claim_and_settle<A: Acker>(
        &self,
        delivery: Delivery<A>,
        sub: &Submission<H::Input>,
        trace: Option<TraceParent>,
    ) -> Outcome {
        let key = sub.key;
        let subject = Some(sub.subject.as_str());
        // A rerun: one at a time, its start recorded before anything runs.
        let rerun = self.rerun(&delivery);
        let _one_rerun = if rerun {
            Some(self.reruns.lock().await)
        } else {
            None
        };
        let reruns = if rerun {
            self.note_rerun(&key).await
        } else {
            None
        };
        let started = Instant::now();
        let mut tx = match self.store.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                self.note(&key, reruns, RunNote::NotRun).await;
                return self
                    .fail(delivery, Some(key), subject, e.into(), None)
                    .await;
            }
        };
        let meta = self.handler.claim_meta(sub);
        let mut claimed = tx.claim(&key, &meta).await;
        if let Ok(ClaimOutcome::Conflict { existing }) = claimed {
            if self.config.on_conflict == ConflictPolicy::Process {
                // The reference behaviour: a submission of its own. Claimed again without
                // the identity, in the same transaction: the key's unique index still
                // serialises its redeliveries.
                audit::conflict(&key, &existing, &sub.subject, ConflictPolicy::Process);
                claimed = tx.claim(&key, &meta.clone().without_identity()).await;
            }
        }
        let claimed = match claimed {
            Ok(c) => {
                self.timed(Stage::Claim, started);
                c
            }
            Err(e) => {
                let _ = tx.rollback().await;
                self.note(&key, reruns, RunNote::NotRun).await;
                return self
                    .fail(delivery, Some(key), subject, e.into(), None)
                    .await;
            }
        };
        // Not claimed: the run recorded for a rerun is taken back once the transaction is
        // over (a store with one writer, SQLite, would wait on its own transaction's lock).
        match claimed {
            ClaimOutcome::Conflict { existing } => {
                let _ = tx.rollback().await;
                self.note(&key, reruns, RunNote::NotRun).await;
                self.forget_attempts(&key);
                self.conflict(delivery, key, existing, &sub.subject).await
            }
            ClaimOutcome::Duplicate => {
                // Roll back first: nothing of this delivery may remain. A failed rollback
                // is harmless (nothing was written), so the duplicate is still acked.
                let mutant_early_ack = mutant::active(Mutant::DuplicateAckBeforeRollback);
                let mut early = None;
                let mut acker = Some(delivery.acker);
                if mutant_early_ack {
                    if let Some(a) = acker.take() {
                        early = Some(a.ack(AckProof::duplicate(key)).await);
                    }
                }
                let _ = tx.rollback().await;
                self.note(&key, reruns, RunNote::NotRun).await;
                self.forget_attempts(&key);
                audit::duplicate(&key, &sub.subject);
                let started = Instant::now();
                let settle = match (acker, early) {
                    (Some(a), _) => a.ack(AckProof::duplicate(key)).await,
                    (None, Some(r)) => r,
                    (None, None) => Ok(()),
                };
                self.timed(Stage::Ack, started);
                Outcome::Duplicate { key, settle }
            }
            ClaimOutcome::InProgress => {
                let _ = tx.rollback().await;
                self.note(&key, reruns, RunNote::NotRun).await;
                let settle = delivery.acker.defer(self.config.defer_delay).await;
                Outcome::Deferred { key, settle }
            }
            ClaimOutcome::Claimed if self.overrun(reruns) => {
                let _ = tx.rollback().await;
                self.forget_attempts(&key);
                // The record stays: a copy of this delivery still in flight elsewhere (a
                // visibility timeout, an ack wait that ran out) is dead-lettered unrun too,
                // not counted from zero and run again.
                let reason = overrun_reason(
                    &delivery,
                    reruns.unwrap_or_default(),
                    self.config.max_attempts,
                );
                tracing::warn!(
                    target: "idem::gate",
                    key = key.short(),
                    attempt = delivery.attempt.unwrap_or_default(),
                    "delivered past the attempt limit without ever settling; dead-lettered unrun"
                );
                self.reject(delivery, subject, reason).await
            }
            ClaimOutcome::Claimed => {
                let scope = trace::single(key, trace);
                let handled = self
                    .guarded(
                        Instant::now(),
                        trace::scoped(scope, self.handler.handle(&mut tx, sub)),
                    )
                    .await;
                match handled {
                    Err(HandlerError::Reject(reason)) => {
                        let _ = tx.rollback().await;
                        self.forget_attempts(&key);
                        self.note(&key, reruns, RunNote::Settled).await;
                        self.reject(delivery, subject, reason).await
                    }
                    Err(e) => {
                        let _ = tx.rollback().await;
                        self.fail(delivery, Some(key), subject, e.into(), reruns)
                            .await
                    }
                    Ok(()) if mutant::active(Mutant::AckBeforeCommit) => {
                        let receipt = CommitReceipt::new();
                        let settle = delivery.acker.ack(AckProof::committed(&receipt, key)).await;
                        let _ = tx.commit().await;
                        Outcome::Processed { key, settle }
                    }
                    Ok(()) => {
                        if let Some(at) = delivery.acker.position() {
                            if let Err(e) = tx.advance_positions(std::slice::from_ref(&at)).await {
                                let _ = tx.rollback().await;
                                if e.is_fenced() {
                                    return fenced(delivery, key, e);
                                }
                                return self
                                    .fail(delivery, Some(key), subject, e.into(), reruns)
                                    .await;
                            }
                        }
                        let started = Instant::now();
                        let committed = tx.commit().await;
                        self.timed(Stage::Commit, started);
                        match committed {
                            // The outcome of a failed commit may be unknown: never ack; the
                            // redelivery finds out through its claim.
                            Err(e) => {
                                self.fail(delivery, Some(key), subject, e.into(), reruns)
                                    .await
                            }
                            Ok(()) => {
                                self.forget_attempts(&key);
                                self.note(&key, reruns, RunNote::Settled).await;
                                let receipt = CommitReceipt::new();
                                audit::processed(&key, &sub.subject);
                                let started = Instant::now();
                                let settle =
                                    delivery.acker.ack(AckProof::committed(&receipt, key)).await;
                                self.timed(Stage::Ack, started);
                                Outcome::Processed { key, settle }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Processes a batch in one transaction: one round-trip claim of every key (where the
    /// store can, in key order so two batches never wait on each other's keys), the
    /// handler on each claimed submission, one commit, then acks for all (duplicates
    /// too). A key twice in one batch is one effect. Bad input is dead-lettered first. If
    /// the claim, the handler or the commit fails, the batch falls back to one-by-one
    /// processing so a poison message cannot hold back its neighbours (a configuration
    /// error, which no delivery can get past, nacks them all instead). Under
    /// [`GateConfig::check_attempts_before_handler`], a rerun on a count of runs
    /// ([`Acker::attempt_counts_runs`], attempt past 1) is processed alone, before the
    /// batch.
    ///
    /// Returns one outcome per delivery, in input order. Each delivery's outcome is
    /// logged in a `delivery` span with the fields of [`process`](Gate::process)'s
    /// (and `batch`, the batch's size); each outbox event gets its own delivery's trace.
    pub async fn process_batch<A: Acker>(&self, deliveries: Vec<Delivery<A>>) -> Vec<Outcome> {
        let identified = deliveries.into_iter().map(|d| self.identify(d)).collect();
        self.process_identified_batch(identified).await
    }

    /// [`process_batch`](Gate::process_batch) for deliveries already
    /// [identified](Gate::identify), in their arrival order.
    pub async fn process_identified_batch<A: Acker>(
        &self,
        deliveries: Vec<Identified<A, H::Input>>,
    ) -> Vec<Outcome> {
        let n = deliveries.len();
        let traces: Vec<Option<SpanTrace>> = deliveries
            .iter()
            .map(|d| SpanTrace::of(&d.delivery.headers))
            .collect();
        let mut outcomes: Vec<Option<Outcome>> = (0..n).map(|_| None).collect();
        let mut valid: Vec<Positioned<A, H::Input>> = Vec::with_capacity(n);
        for (i, d) in deliveries.into_iter().enumerate() {
            match d.submission {
                // A run that did not settle (its batch's process died) goes alone: a
                // message that kills its process costs its neighbours one run at most,
                // and is dead-lettered unrun once past the limit.
                Ok(sub) if self.rerun(&d.delivery) => {
                    outcomes[i] = Some(
                        self.process_identified(d.delivery, sub, own(&traces, i))
                            .await,
                    );
                }
                Ok(sub) => valid.push((i, d.delivery, sub)),
                Err(reason) => outcomes[i] = Some(self.reject(d.delivery, None, reason).await),
            }
        }
        if valid.len() == 1 {
            if let Some((i, d, sub)) = valid.pop() {
                outcomes[i] = Some(self.process_identified(d, sub, own(&traces, i)).await);
            }
        } else if !valid.is_empty() {
            self.batch_identified(valid, &mut outcomes, &traces).await;
        }
        outcomes
            .into_iter()
            .zip(traces)
            .map(|(o, t)| {
                let o = o.unwrap_or_else(unreachable_outcome);
                let span = tracing::info_span!(
                    target: "idem::gate",
                    "delivery",
                    key = o.key().map(IdempotencyKey::short).unwrap_or_default(),
                    outcome = o.kind().as_str(),
                    batch = n,
                    trace_id = tracing::field::Empty,
                    parent_id = tracing::field::Empty,
                    span_id = tracing::field::Empty
                );
                if let Some(t) = &t {
                    t.record(&span);
                }
                let _span = span.entered();
                tracing::debug!(target: "idem::gate", "delivery settled");
                self.observed(o)
            })
            .collect()
    }

    /// `traces`: each delivery's trace, by its position in the batch.
    async fn batch_identified<A: Acker>(
        &self,
        valid: Vec<Positioned<A, H::Input>>,
        outcomes: &mut [Option<Outcome>],
        traces: &[Option<SpanTrace>],
    ) {
        let mut valid = valid;
        if !lock(&self.unsettled).is_empty() {
            // A later payload of a submission whose earlier one has not settled waits.
            let mut kept = Vec::with_capacity(valid.len());
            for (i, d, sub) in valid {
                if self.held_back(&sub) {
                    outcomes[i] = Some(self.hold(d, sub.key).await);
                } else {
                    kept.push((i, d, sub));
                }
            }
            valid = kept;
            if valid.is_empty() {
                return;
            }
        }
        // The first position of each key claims it; later copies are in-batch duplicates.
        let mut first: HashMap<IdempotencyKey, usize> = HashMap::with_capacity(valid.len());
        let mut unique: Vec<usize> = Vec::with_capacity(valid.len());
        for (pos, (_, _, sub)) in valid.iter().enumerate() {
            first.entry(sub.key).or_insert_with(|| {
                unique.push(pos);
                pos
            });
        }
        let mut items: Vec<(IdempotencyKey, ClaimMeta)> = unique
            .iter()
            .map(|&p| (valid[p].2.key, self.handler.claim_meta(&valid[p].2)))
            .collect();
        // Claims take row locks in the order given: in `claim_order` (identity, then key),
        // two batches sharing keys or identities wait on each other in one direction only
        // and can never deadlock.
        if mutant::active(Mutant::KeyOrderBatchClaims) {
            let mut slots: Vec<(usize, (IdempotencyKey, ClaimMeta))> =
                unique.into_iter().zip(items).collect();
            slots.sort_by_key(|(_, (k, _))| *k);
            (unique, items) = slots.into_iter().unzip();
        } else if !mutant::active(Mutant::UnsortedBatchClaims) {
            let order = claim_order(&items);
            let mut slots: Vec<Option<(usize, (IdempotencyKey, ClaimMeta))>> =
                unique.into_iter().zip(items).map(Some).collect();
            (unique, items) = order.iter().filter_map(|&j| slots[j].take()).unzip();
        }

        let claims = match self.try_batch(&valid, &unique, &items, traces).await {
            Ok(c) => c,
            Err(BatchFailure::Config(e) | BatchFailure::Begin(e)) => {
                // Nothing was claimed: every delivery met the same failure (a configuration
                // error, which no delivery can get past, or a store that gave no
                // transaction), and each is settled by it at once — a key's copies in the
                // batch as one failure, not one per copy.
                for (pos, (i, d, sub)) in valid.into_iter().enumerate() {
                    let copy = first.get(&sub.key) != Some(&pos) && e.class() != ErrorClass::Config;
                    let err = Error::Store(if copy {
                        StoreError::Degraded {
                            message: format!(
                                "{e} (a copy of a delivery of this batch, counted once)"
                            ),
                            source: None,
                        }
                    } else {
                        again(&e)
                    });
                    let outcome = self
                        .fail(d, Some(sub.key), Some(&sub.subject), err, None)
                        .await;
                    self.track(&sub, false);
                    outcomes[i] = Some(outcome);
                }
                return;
            }
            Err(BatchFailure::OneByOne) => {
                // Each delivery gets its own transaction, so one poison key fails alone.
                for (i, d, sub) in valid {
                    outcomes[i] = Some(self.process_identified(d, sub, own(traces, i)).await);
                }
                return;
            }
        };
        let receipt = CommitReceipt::new();
        let by_key: HashMap<IdempotencyKey, ClaimOutcome> = unique
            .iter()
            .zip(&claims)
            .map(|(&p, &c)| (valid[p].2.key, c))
            .collect();

        let mut to_ack: Vec<(usize, IdempotencyKey, bool, A)> = Vec::new();
        let mut to_defer: Vec<(usize, IdempotencyKey, A)> = Vec::new();
        let mut conflicts: Vec<(usize, Delivery<A>, IdempotencyKey, IdempotencyKey, String)> =
            Vec::new();
        for (pos, (i, d, sub)) in valid.into_iter().enumerate() {
            let is_first = first.get(&sub.key) == Some(&pos);
            let claim = by_key
                .get(&sub.key)
                .copied()
                .unwrap_or(ClaimOutcome::InProgress);
            self.track(&sub, claim != ClaimOutcome::InProgress);
            match claim {
                ClaimOutcome::Claimed if is_first => {
                    self.forget_attempts(&sub.key);
                    audit::processed(&sub.key, &sub.subject);
                    to_ack.push((i, sub.key, true, d.acker));
                }
                ClaimOutcome::Claimed | ClaimOutcome::Duplicate => {
                    self.forget_attempts(&sub.key);
                    audit::duplicate(&sub.key, &sub.subject);
                    to_ack.push((i, sub.key, false, d.acker));
                }
                ClaimOutcome::InProgress => to_defer.push((i, sub.key, d.acker)),
                // Nothing was claimed for it: the batch committed without it.
                ClaimOutcome::Conflict { existing } => {
                    self.forget_attempts(&sub.key);
                    conflicts.push((i, d, sub.key, existing, sub.subject));
                }
            }
        }
        let mut meta = Vec::with_capacity(to_ack.len());
        let mut items = Vec::with_capacity(to_ack.len());
        for (i, key, processed, acker) in to_ack {
            let proof = if processed {
                AckProof::committed(&receipt, key)
            } else {
                AckProof::duplicate(key)
            };
            meta.push((i, key, processed));
            items.push((acker, proof));
        }
        let started = Instant::now();
        let results = A::ack_all(items).await;
        self.timed(Stage::Ack, started);
        for ((i, key, processed), settle) in meta.into_iter().zip(results) {
            outcomes[i] = Some(if processed {
                Outcome::Processed { key, settle }
            } else {
                Outcome::Duplicate { key, settle }
            });
        }
        for (i, key, acker) in to_defer {
            let settle = acker.defer(self.config.defer_delay).await;
            outcomes[i] = Some(Outcome::Deferred { key, settle });
        }
        for (i, d, key, existing, subject) in conflicts {
            outcomes[i] = Some(self.conflict(d, key, existing, &subject).await);
        }
    }

    /// Under [`ConflictPolicy::Process`], claims the batch's conflicting keys again
    /// without their identity (in the same transaction); otherwise returns `claims` as
    /// they are.
    async fn reclaim_conflicts<A: Acker>(
        &self,
        tx: &mut S::Tx,
        valid: &[Positioned<A, H::Input>],
        unique: &[usize],
        items: &[(IdempotencyKey, ClaimMeta)],
        mut claims: Vec<ClaimOutcome>,
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        if self.config.on_conflict != ConflictPolicy::Process {
            return Ok(claims);
        }
        let mut positions = Vec::new();
        let mut again = Vec::new();
        for (pos, c) in claims.iter().enumerate() {
            if let ClaimOutcome::Conflict { existing } = c {
                let subject = valid[unique[pos]].2.subject.as_str();
                audit::conflict(&items[pos].0, existing, subject, ConflictPolicy::Process);
                positions.push(pos);
                again.push((items[pos].0, items[pos].1.clone().without_identity()));
            }
        }
        if again.is_empty() {
            return Ok(claims);
        }
        let redone = tx.claim_batch(&again).await?;
        if redone.len() != again.len() {
            return Err(StoreError::other(
                "claim_batch returned a different number of outcomes",
                true,
            ));
        }
        for (pos, c) in positions.into_iter().zip(redone) {
            claims[pos] = c;
        }
        Ok(claims)
    }

    async fn try_batch<A: Acker>(
        &self,
        valid: &[Positioned<A, H::Input>],
        unique: &[usize],
        items: &[(IdempotencyKey, ClaimMeta)],
        traces: &[Option<SpanTrace>],
    ) -> Result<Vec<ClaimOutcome>, BatchFailure> {
        let started = Instant::now();
        let mut tx = self.store.begin().await.map_err(BatchFailure::begin)?;
        let claims = match tx.claim_batch(items).await {
            Ok(c) if c.len() == items.len() => {
                let c = match self
                    .reclaim_conflicts(&mut tx, valid, unique, items, c)
                    .await
                {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = tx.rollback().await;
                        return Err(BatchFailure::from_store(e));
                    }
                };
                self.timed(Stage::Claim, started);
                c
            }
            Ok(_) => {
                let _ = tx.rollback().await;
                tracing::warn!(target: "idem::gate", "claim_batch returned a different number of outcomes; falling back to one by one");
                return Err(BatchFailure::OneByOne);
            }
            Err(e) => {
                let _ = tx.rollback().await;
                tracing::debug!(target: "idem::gate", error = %e, "batch claim failed; falling back to one by one");
                return Err(BatchFailure::from_store(e));
            }
        };
        let claimed: Vec<&Submission<H::Input>> = unique
            .iter()
            .zip(&claims)
            .filter(|(_, c)| **c == ClaimOutcome::Claimed)
            .map(|(&p, _)| &valid[p].2)
            .collect();
        if !claimed.is_empty() {
            // Each claimed submission's events get its own delivery's trace.
            let scope = trace::batch(
                unique
                    .iter()
                    .zip(&claims)
                    .filter(|(_, c)| **c == ClaimOutcome::Claimed)
                    .filter_map(|(&p, _)| own(traces, valid[p].0).map(|t| (valid[p].2.key, t))),
            );
            let handled = self
                .guarded(
                    Instant::now(),
                    trace::scoped(scope, self.handler.handle_batch(&mut tx, &claimed)),
                )
                .await;
            if let Err(e) = handled {
                tracing::debug!(target: "idem::gate", error = %e, "handler failed in a batch; falling back to one by one");
                let _ = tx.rollback().await;
                return Err(BatchFailure::OneByOne);
            }
        }
        // Where the settled deliveries stand in their logs, recorded with them.
        let moves: Vec<PositionMove> = unique
            .iter()
            .zip(&claims)
            .filter(|(_, c)| matches!(c, ClaimOutcome::Claimed | ClaimOutcome::Duplicate))
            .filter_map(|(&p, _)| valid[p].1.acker.position())
            .collect();
        if !moves.is_empty() {
            if let Err(e) = tx.advance_positions(&moves).await {
                // Fenced: one by one, each delivery of a partition taken since is fenced
                // alone, and the others commit.
                tracing::debug!(target: "idem::gate", error = %e, "recording the batch's log positions failed; falling back to one by one");
                let _ = tx.rollback().await;
                return Err(BatchFailure::from_store(e));
            }
        }
        let started = Instant::now();
        let committed = tx.commit().await;
        self.timed(Stage::Commit, started);
        match committed {
            Ok(()) => Ok(claims),
            // The outcome of a failed commit is unknown; one by one, each delivery finds
            // out through its own claim (a committed one is then a duplicate).
            Err(e) => {
                tracing::debug!(target: "idem::gate", error = %e, "batch commit failed; falling back to one by one");
                Err(BatchFailure::OneByOne)
            }
        }
    }
}

/// Locks `m`, whatever a panicking holder left in it (every value here stays valid).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whose fault a failure can be, by what it is (see [`Gate::fail`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The store's, whatever the message ([`StoreError::Degraded`]: a lock wait, a
    /// read-only node, a full disk): never charged.
    Store,
    /// The store's side failed (unreachable, a broken connection, a timeout, a
    /// serialization failure, a handler past its deadline): the message's only by the
    /// evidence [`Gate::judge`] weighs.
    Judged,
    /// The message's or its handler's own (a handler's error, a panic, a refusal):
    /// counted by the broker's delivery count, or the gate's where it keeps none.
    Message,
}

impl Fault {
    fn of(error: &Error) -> Self {
        let store = match error {
            Error::Store(e) | Error::Handler(HandlerError::Store(e)) => e,
            _ => return Self::Message,
        };
        if store.is_degraded() {
            Self::Store
        } else {
            Self::Judged
        }
    }
}

/// A key's failures on the store's side in this process.
#[derive(Debug, Clone, Copy)]
struct KeyFaults {
    /// Every such failure.
    failures: u32,
    /// Those charged to the message.
    charged: u32,
    /// When the latest happened (on the gate's clock).
    last: Duration,
}

/// What [`Gate::judge`] weighs: each key's failures, the last keys that failed, and when a
/// delivery last committed its handler's writes.
#[derive(Debug, Default)]
struct Judge {
    keys: HashMap<IdempotencyKey, KeyFaults>,
    /// The two most recent distinct keys that failed on the store's side, latest first.
    recent: [Option<(IdempotencyKey, Duration)>; 2],
    /// When a delivery last ended `Processed` (its handler's writes committed).
    last_processed: Option<Duration>,
    /// How many failures were judged: each failure's number, for the probe that must
    /// start after it.
    seen: u64,
}

impl Judge {
    /// Records a failure of `key` at `now`; returns whether it may be the message's own —
    /// since the key's previous failure (or for `lookback`, at its first) another
    /// delivery committed its writes, or no other key failed — and the failure's number.
    fn failed(&mut self, key: &IdempotencyKey, now: Duration, lookback: Duration) -> (bool, u64) {
        self.seen += 1;
        if self.keys.len() >= ATTEMPT_MEMORY && !self.keys.contains_key(key) {
            self.keys.clear();
        }
        let since = match self.keys.get(key) {
            Some(f) => Some(f.last),
            None => now.checked_sub(lookback),
        };
        let after = |t: Duration| since.is_none_or(|s| t > s);
        let others_failed = self
            .recent
            .iter()
            .flatten()
            .any(|(k, t)| k != key && after(*t));
        let others_processed = self.last_processed.is_some_and(after);
        let entry = self.keys.entry(*key).or_insert(KeyFaults {
            failures: 0,
            charged: 0,
            last: now,
        });
        entry.failures += 1;
        entry.last = now;
        match self.recent {
            [Some((k, _)), _] if k == *key => self.recent[0] = Some((*key, now)),
            [first, _] => self.recent = [Some((*key, now)), first],
        }
        (others_processed || !others_failed, self.seen)
    }

    /// Records a failure of `key` that is the store's whatever the message
    /// ([`Fault::Store`]): never charged, only counted for the retry delay.
    fn uncharged(&mut self, key: &IdempotencyKey, now: Duration) {
        if self.keys.len() >= ATTEMPT_MEMORY && !self.keys.contains_key(key) {
            self.keys.clear();
        }
        let entry = self.keys.entry(*key).or_insert(KeyFaults {
            failures: 0,
            charged: 0,
            last: now,
        });
        entry.failures += 1;
    }

    /// Charges the latest failure of `key` when `charged`; returns the key's charges.
    fn charge(&mut self, key: &IdempotencyKey, charged: bool) -> u32 {
        match self.keys.get_mut(key) {
            Some(f) => {
                if charged {
                    f.charged += 1;
                }
                f.charged
            }
            None => u32::from(charged),
        }
    }

    /// Every failure of `key` on the store's side (for the retry delay).
    fn failures(&self, key: Option<&IdempotencyKey>) -> u32 {
        key.and_then(|k| self.keys.get(k)).map_or(0, |f| f.failures)
    }

    fn forget(&mut self, key: &IdempotencyKey) {
        if !self.keys.is_empty() {
            self.keys.remove(key);
        }
    }
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

enum BatchFailure {
    /// The store is misconfigured: every delivery is handed back.
    Config(StoreError),
    /// No transaction could be begun: every delivery failed on the store at once (one by
    /// one, each would wait on the store again: a batch of 100 would wait 100 times).
    Begin(StoreError),
    /// Anything else: retry each delivery in its own transaction.
    OneByOne,
}

/// `e` again, for each delivery of a batch that met it: the same variant and message,
/// without the driver's source (which cannot be cloned).
fn again(e: &StoreError) -> StoreError {
    let message = e.to_string();
    match e {
        StoreError::Unavailable { .. } => StoreError::Unavailable {
            message,
            source: None,
        },
        StoreError::Degraded { .. } => StoreError::Degraded {
            message,
            source: None,
        },
        StoreError::Conflict { .. } => StoreError::Conflict {
            message,
            source: None,
        },
        StoreError::Rejected { .. } => StoreError::Rejected {
            message,
            source: None,
        },
        StoreError::Config(_) => StoreError::Config(message),
        other => StoreError::other(message, other.is_retryable()),
    }
}

impl BatchFailure {
    fn begin(e: StoreError) -> Self {
        if e.class() == ErrorClass::Config {
            Self::Config(e)
        } else {
            Self::Begin(e)
        }
    }

    fn from_store(e: StoreError) -> Self {
        if e.class() == ErrorClass::Config {
            Self::Config(e)
        } else {
            Self::OneByOne
        }
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
