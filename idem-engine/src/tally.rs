//! The outcome tally: how many deliveries ended processed, duplicate, conflict or
//! dead-lettered (by reason) per UTC day, counted in memory by a [`GateObserver`]
//! ([`OutcomeTally`]) and added to the store's `idem_outcome_counts` table now and then
//! ([`OutcomeTally::flush`] into an [`OutcomeCountStore`]), so that an audit report can
//! show what the store itself cannot: a duplicate's transaction rolls back and leaves no
//! row, and a dead letter lives in the broker's `NAME.dead-letter`.
//!
//! # What the counts are, and what they are not
//! They are **operational evidence**, not the exact evidence of the claims and business
//! rows:
//! - counted in the consumer's memory and flushed periodically (`idem consume` and
//!   `idem demo`: every second and at exit), so a process that dies loses the counts since
//!   its last flush (at most about a second's);
//! - a delivery whose worker dies after its commit but before the gate returns is not
//!   counted (its claim is the evidence), and its redelivery is counted as a duplicate;
//! - a flush whose result is unknown (the connection broke after the commit, a timeout
//!   dropped it while the store went on) is retried with the same [`FlushId`] and the same
//!   counts, and the store adds a flush id once ([`OutcomeCountStore`]): never counted
//!   twice;
//! - a dead letter is counted once the broker accepted it; the dead letters themselves,
//!   with their reasons, are in the broker's dead-letter queue;
//! - a consumer that does not tally (the reference consumer, a process without a
//!   durable store) adds nothing.
//!
//! A failed flush keeps its counts for the next one; the tally never fails or delays a
//! delivery (the observer takes a short mutex on a map of a few entries per day).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::StoreError;
use crate::gate::{GateObserver, Outcome, OutcomeKind, Stage};
use crate::record::{OutcomeCount, Timestamp};

pub use idem_core::tally::{FlushId, OutcomeCountStore};

/// A random writer id (128 bits, hex) for a new tally: the standard library's random
/// hasher keys, over the process id, the time and a counter.
fn new_writer_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let mut halves = [0_u64; 2];
    for (i, half) in (0_u8..).zip(halves.iter_mut()) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(n);
        h.write_u128(nanos);
        h.write_u32(std::process::id());
        h.write_u8(i);
        *half = h.finish();
    }
    format!("{:016x}{:016x}", halves[0], halves[1])
}

/// Days since the Unix epoch of a timestamp.
fn day_number(t: Timestamp) -> i64 {
    t.unix_micros().div_euclid(86_400_000_000)
}

fn day_name(day: i64) -> String {
    Timestamp::from_unix_micros(day * 86_400_000_000).day()
}

/// `(day, outcome, reason)` of the counts not yet flushed.
type HeldKey = (String, String, String);

#[derive(Debug, Default)]
struct Inner {
    /// Counted since the last drain, keyed without allocating.
    live: HashMap<(i64, OutcomeKind, &'static str), u64>,
    /// Given back by [`OutcomeTally::restore`], to go with the next flush.
    held: BTreeMap<HeldKey, u64>,
    /// A flush sent whose outcome is not known to be a success (it failed, or was
    /// dropped): sent again, as it is, before anything else.
    unsent: Option<(FlushId, Vec<OutcomeCount>)>,
}

/// Counts outcomes per (UTC day, outcome kind, dead-letter reason code) in memory: a
/// [`GateObserver`] to give a gate (with [`FanOut`] beside another observer), drained
/// into a store by [`flush`](OutcomeTally::flush). See the [module](self) for what the
/// counts mean.
///
/// ```
/// use idem_engine::record::Timestamp;
/// use idem_engine::tally::OutcomeTally;
/// use idem_engine::{IdempotencyKey, Outcome, RejectReason};
///
/// let tally = OutcomeTally::new();
/// let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").unwrap();
/// let at = Timestamp::parse_rfc3339("2026-07-01T09:00:00Z").unwrap();
/// tally.record_at(at, &Outcome::Duplicate { key, settle: Ok(()) });
/// tally.record_at(at, &Outcome::Rejected { reason: RejectReason::new("not_json", "x"), settle: Ok(()) });
/// let counts = tally.drain();
/// assert_eq!(counts.len(), 2);
/// assert_eq!((counts[0].day.as_str(), counts[0].outcome.as_str()), ("2026-07-01", "duplicate"));
/// assert_eq!((counts[1].outcome.as_str(), counts[1].reason.as_str()), ("rejected", "not_json"));
/// assert!(tally.drain().is_empty());
/// ```
#[derive(Debug)]
pub struct OutcomeTally {
    inner: Mutex<Inner>,
    /// This tally's writer id ([`FlushId::writer`]).
    writer: String,
    /// The last flush sequence number given out.
    seq: AtomicU64,
    /// Held by a flush while it runs: one tally's flushes never overlap.
    flushing: futures::lock::Mutex<()>,
}

impl Default for OutcomeTally {
    fn default() -> Self {
        Self {
            inner: Mutex::default(),
            writer: new_writer_id(),
            seq: AtomicU64::new(0),
            flushing: futures::lock::Mutex::new(()),
        }
    }
}

impl OutcomeTally {
    /// An empty tally, with a new random writer id.
    pub fn new() -> Self {
        Self::default()
    }

    /// This tally's writer id (see [`FlushId`]).
    pub fn writer(&self) -> &str {
        &self.writer
    }

    /// Counts `outcome` as of `at` (the observer uses now). A `rejected` or `conflict`
    /// outcome whose dead letter the broker refused is not counted: the delivery stays
    /// in the source and is counted when its dead letter lands.
    pub fn record_at(&self, at: Timestamp, outcome: &Outcome) {
        let reason = match outcome {
            Outcome::Rejected { reason, settle } | Outcome::Conflict { reason, settle, .. } => {
                if settle.is_err() {
                    return;
                }
                reason.code
            }
            _ => "",
        };
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        *inner
            .live
            .entry((day_number(at), outcome.kind(), reason))
            .or_insert(0) += 1;
    }

    /// Takes every count not yet written (those of a failed flush included — which, if
    /// its outcome was unknown, may have been written after all), ordered by day, outcome
    /// and reason; the tally starts again from zero.
    pub fn drain(&self) -> Vec<OutcomeCount> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, counts)) = inner.unsent.take() {
            for c in counts {
                *inner.held.entry((c.day, c.outcome, c.reason)).or_insert(0) += c.count;
            }
        }
        Self::drain_new(&mut inner)
    }

    /// Takes the counts not yet given to a flush (counted, or given back).
    fn drain_new(inner: &mut Inner) -> Vec<OutcomeCount> {
        let live = std::mem::take(&mut inner.live);
        let mut held = std::mem::take(&mut inner.held);
        for ((day, kind, reason), n) in live {
            *held
                .entry((day_name(day), kind.as_str().to_owned(), reason.to_owned()))
                .or_insert(0) += n;
        }
        held.into_iter()
            .map(|((day, outcome, reason), count)| OutcomeCount::new(day, outcome, reason, count))
            .collect()
    }

    /// Gives back counts taken by [`drain`](Self::drain) that could not be written: the
    /// next drain returns them again (added to what was counted meanwhile).
    pub fn restore(&self, counts: Vec<OutcomeCount>) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        for c in counts {
            *inner.held.entry((c.day, c.outcome, c.reason)).or_insert(0) += c.count;
        }
    }

    /// Whether nothing is waiting to be written.
    pub fn is_empty(&self) -> bool {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.live.is_empty() && inner.held.is_empty() && inner.unsent.is_none()
    }

    /// Writes the tally into `store`: first the flush whose outcome is unknown, if any
    /// (a failed or dropped one), again with its id and its counts, then what was counted
    /// since, as a new flush. Returns how many deliveries the written counts cover (0
    /// when there was nothing to write, without a round trip). A flush applied before and
    /// sent again is added once (the [`OutcomeCountStore`] contract), so the counts are
    /// never added twice. One tally's flushes run one at a time.
    ///
    /// Cancel-safe: a flush dropped before it finished (a timeout around it, say) is kept
    /// as it is, with its id, for the next one, as a failed one is.
    ///
    /// # Errors
    /// The store's error; the counts are then kept for the next flush, never lost.
    pub async fn flush(&self, store: &dyn OutcomeCountStore) -> Result<u64, StoreError> {
        let _one_at_a_time = self.flushing.lock().await;
        let mut written = 0;
        loop {
            let (id, counts) = {
                let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(unsent) = inner.unsent.clone() {
                    unsent
                } else {
                    let counts = Self::drain_new(&mut inner);
                    if counts.is_empty() {
                        return Ok(written);
                    }
                    let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
                    let id = FlushId::new(self.writer.clone(), seq);
                    // Recorded before the write: a dropped flush is sent again as it is.
                    inner.unsent = Some((id.clone(), counts.clone()));
                    (id, counts)
                }
            };
            store.add_outcome_counts(&id, &counts).await?;
            written += counts.iter().map(|c| c.count).sum::<u64>();
            let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            if inner.unsent.as_ref().is_some_and(|(u, _)| *u == id) {
                inner.unsent = None;
            }
        }
    }
}

impl GateObserver for OutcomeTally {
    fn outcome(&self, outcome: &Outcome) {
        self.record_at(Timestamp::now(), outcome);
    }
}

/// Several observers as one: each call goes to every one of them, in order (a gate takes
/// one observer: the metrics and an [`OutcomeTally`], say).
#[derive(Clone, Default)]
pub struct FanOut(Vec<Arc<dyn GateObserver>>);

impl FanOut {
    /// The observers, called in this order.
    pub fn new(observers: Vec<Arc<dyn GateObserver>>) -> Self {
        Self(observers)
    }
}

impl std::fmt::Debug for FanOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FanOut")
            .field("observers", &self.0.len())
            .finish()
    }
}

impl GateObserver for FanOut {
    fn stage(&self, stage: Stage, elapsed: std::time::Duration) {
        for o in &self.0 {
            o.stage(stage, elapsed);
        }
    }

    fn outcome(&self, outcome: &Outcome) {
        for o in &self.0 {
            o.outcome(outcome);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{AckError, RejectReason};
    use crate::gate::{ATTEMPTS_EXHAUSTED, CONFLICT};
    use crate::IdempotencyKey;
    use async_trait::async_trait;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn key(i: u8) -> IdempotencyKey {
        IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", &[i]).expect("key")
    }

    fn at(s: &str) -> Timestamp {
        Timestamp::parse_rfc3339(s).expect("timestamp")
    }

    fn rejected(code: &'static str, ok: bool) -> Outcome {
        Outcome::Rejected {
            reason: RejectReason::new(code, "x"),
            settle: if ok {
                Ok(())
            } else {
                Err(AckError::new("down", false, None))
            },
        }
    }

    /// A store that fails `fail` times, then adds what it is given, once per flush id
    /// (the highest sequence number applied per writer); `lose` answers of flushes it
    /// applied are lost (an error after the commit).
    #[derive(Default)]
    struct Store {
        fail: AtomicU64,
        lose: AtomicU64,
        applied: Mutex<HashMap<String, u64>>,
        rows: Mutex<BTreeMap<HeldKey, u64>>,
    }

    #[async_trait]
    impl OutcomeCountStore for Store {
        async fn add_outcome_counts(
            &self,
            flush: &FlushId,
            counts: &[OutcomeCount],
        ) -> Result<(), StoreError> {
            if self.fail.load(Ordering::SeqCst) > 0 {
                self.fail.fetch_sub(1, Ordering::SeqCst);
                return Err(StoreError::other("down", true));
            }
            let mut applied = self.applied.lock().expect("applied");
            let last = applied.entry(flush.writer().to_owned()).or_insert(0);
            if *last < flush.seq() {
                *last = flush.seq();
                let mut rows = self.rows.lock().expect("rows");
                for c in counts {
                    *rows
                        .entry((c.day.clone(), c.outcome.clone(), c.reason.clone()))
                        .or_insert(0) += c.count;
                }
            }
            if self.lose.load(Ordering::SeqCst) > 0 {
                self.lose.fetch_sub(1, Ordering::SeqCst);
                return Err(StoreError::other("connection broke after the commit", true));
            }
            Ok(())
        }
    }

    #[test]
    fn a_flush_whose_answer_was_lost_is_sent_again_and_added_once() {
        futures::executor::block_on(async {
            let t = OutcomeTally::new();
            let store = Store::default();
            let d = at("2026-07-01T09:00:00Z");
            t.record_at(d, &rejected("not_json", true));
            t.record_at(d, &rejected("not_json", true));
            store.lose.store(1, Ordering::SeqCst);
            assert!(t.flush(&store).await.is_err(), "applied, answer lost");
            // Counted meanwhile: goes in a flush of its own, after the one sent again.
            t.record_at(d, &rejected("not_json", true));
            assert_eq!(t.flush(&store).await.expect("flush"), 3);
            assert!(t.is_empty());
            let rows = store.rows.lock().expect("rows").clone();
            assert_eq!(rows.values().sum::<u64>(), 3, "the lost flush added once");
            assert_eq!(store.applied.lock().expect("applied")[t.writer()], 2);
            // Two tallies never share a writer id.
            assert_ne!(t.writer(), OutcomeTally::new().writer());
        });
    }

    #[test]
    fn outcomes_are_counted_per_day_kind_and_reason() {
        let t = OutcomeTally::new();
        let (d1, d2) = (
            at("2026-07-01T23:59:59.999999Z"),
            at("2026-07-02T00:00:00Z"),
        );
        for _ in 0..3 {
            t.record_at(
                d1,
                &Outcome::Processed {
                    key: key(1),
                    settle: Ok(()),
                },
            );
        }
        // An ack that failed after the commit: still processed (the commit is there).
        t.record_at(
            d1,
            &Outcome::Processed {
                key: key(1),
                settle: Err(AckError::new("x", false, None)),
            },
        );
        t.record_at(
            d2,
            &Outcome::Duplicate {
                key: key(2),
                settle: Ok(()),
            },
        );
        t.record_at(d2, &rejected("not_json", true));
        t.record_at(d2, &rejected("not_json", true));
        t.record_at(d2, &rejected(ATTEMPTS_EXHAUSTED, true));
        // Not dead-lettered: it stays in the source and comes back.
        t.record_at(d2, &rejected("not_json", false));
        t.record_at(
            d2,
            &Outcome::Conflict {
                key: key(3),
                existing: key(4),
                reason: crate::gate::conflict_reason(&key(3), &key(4)),
                settle: Ok(()),
            },
        );
        let got: Vec<(String, String, String, u64)> = t
            .drain()
            .into_iter()
            .map(|c| (c.day, c.outcome, c.reason, c.count))
            .collect();
        let s = |a: &str, b: &str, c: &str, n| (a.to_owned(), b.to_owned(), c.to_owned(), n);
        assert_eq!(
            got,
            vec![
                s("2026-07-01", "processed", "", 4),
                s("2026-07-02", "conflict", CONFLICT, 1),
                s("2026-07-02", "duplicate", "", 1),
                s("2026-07-02", "rejected", ATTEMPTS_EXHAUSTED, 1),
                s("2026-07-02", "rejected", "not_json", 2),
            ]
        );
        assert!(t.is_empty());
    }

    #[test]
    fn a_failed_flush_keeps_its_counts_for_the_next() {
        futures::executor::block_on(async {
            let t = OutcomeTally::new();
            let store = Store::default();
            assert_eq!(t.flush(&store).await.expect("nothing to flush"), 0);
            let d = at("2026-07-01T09:00:00Z");
            t.record_at(d, &rejected("not_json", true));
            t.record_at(d, &rejected("not_json", true));
            store.fail.store(2, Ordering::SeqCst);
            assert!(t.flush(&store).await.is_err());
            // Counted meanwhile, then a second failure: nothing lost, nothing doubled.
            t.record_at(d, &rejected("not_json", true));
            assert!(t.flush(&store).await.is_err());
            assert!(!t.is_empty());
            assert_eq!(t.flush(&store).await.expect("flush"), 3);
            assert!(t.is_empty());
            let rows = store.rows.lock().expect("rows").clone();
            assert_eq!(rows.len(), 1);
            assert_eq!(rows.values().sum::<u64>(), 3);
        });
    }

    /// A store whose write never finishes.
    struct Stuck;

    #[async_trait]
    impl OutcomeCountStore for Stuck {
        async fn add_outcome_counts(
            &self,
            _: &FlushId,
            _: &[OutcomeCount],
        ) -> Result<(), StoreError> {
            futures::future::pending().await
        }
    }

    #[test]
    fn a_cancelled_flush_gives_its_counts_back() {
        use futures::FutureExt as _;
        let t = OutcomeTally::new();
        t.record_at(at("2026-07-01T09:00:00Z"), &rejected("not_json", true));
        {
            let flush = t.flush(&Stuck);
            futures::pin_mut!(flush);
            assert!(flush.as_mut().now_or_never().is_none(), "still writing");
        } // dropped: a timeout around it fired
        assert!(!t.is_empty(), "kept for the next flush");
        // The next flush sends the dropped one again, with its id.
        let store = Store::default();
        store
            .applied
            .lock()
            .expect("applied")
            .insert(t.writer().to_owned(), 1);
        assert_eq!(
            futures::executor::block_on(t.flush(&store)).expect("flush"),
            1,
            "sent again"
        );
        assert_eq!(
            store.rows.lock().expect("rows").values().sum::<u64>(),
            0,
            "as flush 1"
        );
        t.record_at(at("2026-07-01T09:00:00Z"), &rejected("not_json", true));
        let counts = t.drain();
        assert_eq!(counts.len(), 1);
        assert_eq!(counts[0].count, 1);
    }

    #[test]
    fn fan_out_calls_every_observer() {
        let a = Arc::new(OutcomeTally::new());
        let b = Arc::new(OutcomeTally::new());
        let fan = FanOut::new(vec![a.clone(), b.clone()]);
        fan.outcome(&Outcome::Duplicate {
            key: key(1),
            settle: Ok(()),
        });
        fan.stage(Stage::Claim, std::time::Duration::from_millis(1));
        assert_eq!(a.drain().len(), 1);
        assert_eq!(b.drain().len(), 1);
    }
}
