//! Whose fault a failure is, and what the gate does with a failed attempt.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{
    lock, Gate, Handler, Outcome, ATTEMPTS_EXHAUSTED, ATTEMPT_MEMORY, PERMANENT_FAILURE,
    STORE_REJECTED,
};
use crate::delivery::{Acker, Delivery};
use crate::error::{Error, ErrorClass, HandlerError, RejectReason, StoreError};
use crate::key::IdempotencyKey;
use crate::mutant::{self, Mutant};
use crate::store::{ClaimStore, RunNote};

/// Why a delivery past the attempt limit is dead-lettered unrun.
/// `reruns`: the runs recorded, the first included (its own rerun's note counts the
/// first run, which is never recorded).
pub(super) fn overrun_reason<A>(
    delivery: &Delivery<A>,
    reruns: u32,
    max_attempts: u32,
) -> RejectReason {
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

impl<S, H> Gate<S, H>
where
    S: ClaimStore,
    H: Handler<S::Tx>,
{
    /// Whether a rerun whose store recorded `reruns` reruns (this one included) is past
    /// the attempt limit: its first run and its reruns never settled, so its handler is
    /// not run again.
    pub(super) fn overrun(&self, reruns: Option<u32>) -> bool {
        reruns.is_some_and(|r| r >= self.config.max_attempts)
    }

    /// Records a rerun's start ([`ClaimStore::note_run`]); `None` when the store keeps
    /// no record or could not write it (the rerun then runs unchecked: better than
    /// holding it back on a record that cannot be written).
    pub(super) async fn note_rerun(&self, key: &IdempotencyKey) -> Option<u32> {
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
    pub(super) async fn note(&self, key: &IdempotencyKey, reruns: Option<u32>, note: RunNote) {
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
    pub(super) fn rerun<A: Acker>(&self, delivery: &Delivery<A>) -> bool {
        delivery.attempt.is_some_and(|n| n > 1) && self.reruns_checked(delivery)
    }

    /// The attempt number of a failed delivery: its runs where the store records a
    /// rerun's (`reruns`: the recorded reruns, this one included, so its runs are one
    /// more with the first), else the broker's count, else the gate's own.
    ///
    /// The store's record comes first because the broker also counts the deliveries a
    /// message lost unrun with a process that died of another message (a prefetch, a
    /// Redis Streams claim of a dead consumer's entries): by the broker's count such a
    /// neighbour would be dead-lettered before its handler had run `max_attempts` times.
    fn attempt_of(
        &self,
        delivery_attempt: Option<u32>,
        reruns: Option<u32>,
        key: Option<&IdempotencyKey>,
    ) -> u32 {
        if let Some(r) = reruns {
            return r.saturating_add(1);
        }
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

    pub(super) fn forget_attempts(&self, key: &IdempotencyKey) {
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
    pub(super) async fn fail<A: Acker>(
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
            Fault::Message => (
                self.attempt_of(delivery.attempt, reruns, key.as_ref()),
                true,
            ),
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
    /// counted by its recorded runs, else the broker's delivery count, else the gate's.
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
pub(super) struct Judge {
    keys: HashMap<IdempotencyKey, KeyFaults>,
    /// The two most recent distinct keys that failed on the store's side, latest first.
    recent: [Option<(IdempotencyKey, Duration)>; 2],
    /// When a delivery last ended `Processed` (its handler's writes committed).
    pub(super) last_processed: Option<Duration>,
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
