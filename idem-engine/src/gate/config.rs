//! The gate's configuration: [`GateConfig`], its [`RetryPolicy`] and [`ConflictPolicy`].

use std::time::Duration;

use crate::key::IdempotencyKey;

#[cfg(doc)]
use super::{Outcome, OutcomeKind, CONFLICT};
#[cfg(doc)]
use crate::delivery::{Acker, Delivery};
#[cfg(doc)]
use crate::error::StoreError;
#[cfg(doc)]
use crate::store::{ClaimMeta, ClaimOutcome, ClaimStore};

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
/// use idem_engine::gate::RetryPolicy;
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
    /// - the handler's own errors and panics are the message's, counted by its runs: on a
    ///   rerun whose store records runs ([`ClaimStore::note_run`]), the recorded runs with
    ///   its first; otherwise the broker's delivery count ([`Delivery::attempt`]) where
    ///   it keeps one (a delivery lost unrun with a process that died of another message
    ///   is counted by the broker, never by the record), else the gate's own count;
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
/// use idem_engine::gate::ConflictPolicy;
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
