//! A front filter: a fast cache of *committed* keys in front of a durable store.
//!
//! [`Filtered`] asks its [`DoneFilter`] before the durable claim and answers
//! [`ClaimOutcome::Duplicate`] only for keys the filter has seen committed. The mark is
//! written *after* the durable commit, so "the filter says done, the store has no row"
//! cannot happen by construction; a miss, an error or a timeout from the filter falls
//! through to the durable claim, and opens a circuit breaker: for
//! [`BREAKER_COOL_DOWN`] every claim goes straight to the durable store, so an outage of the
//! filter costs one timeout per cool-down rather than one per claim. (Marking before the commit would lose a message when the
//! worker dies between the mark and the commit: the redelivery would be skipped.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::clock::{self, SharedClock};
use crate::error::StoreError;
use crate::key::IdempotencyKey;
use crate::mutant::{self, Mutant};
use crate::outbox::OutboxEvent;
use crate::store::{Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, OutboxWriter};

pub use idem_core::filter::DoneFilter;

/// Counters of a [`Filtered`] store, and its circuit breaker.
#[derive(Debug)]
pub struct FilterStats {
    hits: AtomicU64,
    errors: AtomicU64,
    bypassed: AtomicU64,
    /// Milliseconds of `clock` until which the filter is bypassed after an error.
    open_until_ms: AtomicU64,
    clock: SharedClock,
}

impl Default for FilterStats {
    fn default() -> Self {
        Self::with_clock(clock::system())
    }
}

impl FilterStats {
    /// Counters whose circuit breaker reads `clock`.
    pub fn with_clock(clock: SharedClock) -> Self {
        Self {
            hits: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            bypassed: AtomicU64::new(0),
            open_until_ms: AtomicU64::new(0),
            clock,
        }
    }

    /// Claims answered `Duplicate` by the filter alone.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Filter errors that fell through to the durable store.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Lookups and marks skipped while the breaker was open (after an error).
    pub fn bypassed(&self) -> u64 {
        self.bypassed.load(Ordering::Relaxed)
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock.now().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether the filter should be skipped now (the breaker is open).
    fn is_open(&self) -> bool {
        let open = self.now_ms() < self.open_until_ms.load(Ordering::Relaxed);
        if open {
            self.bypassed.fetch_add(1, Ordering::Relaxed);
        }
        open
    }

    /// Records an error and opens the breaker for [`BREAKER_COOL_DOWN`].
    fn trip(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let until = self
            .now_ms()
            .saturating_add(u64::try_from(BREAKER_COOL_DOWN.as_millis()).unwrap_or(1000));
        self.open_until_ms.store(until, Ordering::Relaxed);
    }
}

/// After a filter error, how long the filter is skipped (every claim goes straight to the
/// durable store) before it is tried again. A filter outage then costs one timeout per
/// cool-down, not one per claim.
pub const BREAKER_COOL_DOWN: Duration = Duration::from_secs(1);

/// A durable store behind a [`DoneFilter`]. Clones share the filter and its counters.
#[derive(Debug)]
pub struct Filtered<S, F> {
    store: S,
    filter: Arc<F>,
    stats: Arc<FilterStats>,
}

impl<S: Clone, F> Clone for Filtered<S, F> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            filter: self.filter.clone(),
            stats: self.stats.clone(),
        }
    }
}

impl<S: ClaimStore, F: DoneFilter> Filtered<S, F> {
    /// Puts `filter` in front of `store`.
    pub fn new(store: S, filter: F) -> Self {
        Self {
            store,
            filter: Arc::new(filter),
            stats: Arc::default(),
        }
    }

    /// Puts `filter` in front of `store`, with a circuit breaker that reads `clock`.
    pub fn with_clock(store: S, filter: F, clock: SharedClock) -> Self {
        Self {
            store,
            filter: Arc::new(filter),
            stats: Arc::new(FilterStats::with_clock(clock)),
        }
    }

    /// The durable store.
    pub fn inner(&self) -> &S {
        &self.store
    }

    /// The filter.
    pub fn filter(&self) -> &F {
        &self.filter
    }

    /// Hit and error counters.
    pub fn stats(&self) -> &FilterStats {
        &self.stats
    }

    /// A shared handle on the counters, to read them while the store is in use.
    pub fn stats_handle(&self) -> Arc<FilterStats> {
        self.stats.clone()
    }
}

/// The transaction of a [`Filtered`] store: the durable transaction plus the keys to mark
/// after its commit.
#[derive(Debug)]
pub struct FilteredTx<T, F> {
    inner: T,
    filter: Arc<F>,
    stats: Arc<FilterStats>,
    claimed: Vec<IdempotencyKey>,
}

impl<T, F> FilteredTx<T, F> {
    /// The durable transaction, for the handler's business writes.
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

#[async_trait]
impl<S, F> ClaimStore for Filtered<S, F>
where
    S: ClaimStore,
    F: DoneFilter + 'static,
{
    type Tx = FilteredTx<S::Tx, F>;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        Ok(FilteredTx {
            inner: self.store.begin().await?,
            filter: self.filter.clone(),
            stats: self.stats.clone(),
            claimed: Vec::new(),
        })
    }

    fn capabilities(&self) -> Capabilities {
        self.store.capabilities()
    }

    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: crate::RunNote,
    ) -> Result<Option<u32>, StoreError> {
        self.store.note_run(key, note).await
    }

    /// The durable store's probe: the filter is no evidence that the store works.
    async fn probe(&self) -> Result<(), StoreError> {
        self.store.probe().await
    }
}

async fn lookup<F: DoneFilter>(
    filter: &F,
    stats: &FilterStats,
    keys: &[IdempotencyKey],
) -> Vec<bool> {
    if stats.is_open() {
        return vec![false; keys.len()];
    }
    match filter.seen(keys).await {
        Ok(v) if v.len() == keys.len() => v,
        Ok(_) | Err(_) => {
            stats.trip();
            vec![false; keys.len()]
        }
    }
}

#[async_trait]
impl<T, F> ClaimTx for FilteredTx<T, F>
where
    T: ClaimTx,
    F: DoneFilter + 'static,
{
    async fn claim(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        if lookup(&*self.filter, &self.stats, std::slice::from_ref(key)).await[0] {
            self.stats.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(ClaimOutcome::Duplicate);
        }
        let out = self.inner.claim(key, meta).await?;
        if out == ClaimOutcome::Claimed {
            if mutant::active(Mutant::FilterMarkBeforeCommit) {
                let _ = self.filter.mark_done(std::slice::from_ref(key)).await;
            }
            self.claimed.push(*key);
        }
        Ok(out)
    }

    async fn claim_batch(
        &mut self,
        items: &[(IdempotencyKey, ClaimMeta)],
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        let keys: Vec<IdempotencyKey> = items.iter().map(|(k, _)| *k).collect();
        let seen = lookup(&*self.filter, &self.stats, &keys).await;
        let misses: Vec<(IdempotencyKey, ClaimMeta)> = items
            .iter()
            .zip(&seen)
            .filter(|(_, s)| !**s)
            .map(|(i, _)| i.clone())
            .collect();
        let mut inner = if misses.is_empty() {
            Vec::new().into_iter()
        } else {
            self.inner.claim_batch(&misses).await?.into_iter()
        };
        let mut out = Vec::with_capacity(items.len());
        for ((key, _), hit) in items.iter().zip(seen) {
            if hit {
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                out.push(ClaimOutcome::Duplicate);
            } else {
                let o = inner.next().ok_or_else(|| {
                    StoreError::other("inner claim_batch returned too few outcomes", false)
                })?;
                if o == ClaimOutcome::Claimed {
                    self.claimed.push(*key);
                }
                out.push(o);
            }
        }
        Ok(out)
    }

    async fn advance_positions(
        &mut self,
        moves: &[crate::position::PositionMove],
    ) -> Result<(), StoreError> {
        self.inner.advance_positions(moves).await
    }

    async fn commit(self) -> Result<(), StoreError> {
        self.inner.commit().await?;
        // Only now is the key durably done; a failed mark is a cache miss later, nothing more.
        if !self.claimed.is_empty()
            && !self.stats.is_open()
            && self.filter.mark_done(&self.claimed).await.is_err()
        {
            self.stats.trip();
        }
        Ok(())
    }

    async fn rollback(self) -> Result<(), StoreError> {
        self.inner.rollback().await
    }
}

#[async_trait]
impl<T, F> OutboxWriter for FilteredTx<T, F>
where
    T: OutboxWriter,
    F: DoneFilter + 'static,
{
    async fn enqueue(&mut self, event: &OutboxEvent) -> Result<(), StoreError> {
        self.inner.enqueue(event).await
    }
}
