//! An in-memory transactional store: the reference implementation of the claim contract,
//! always available, so property tests run with nothing installed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_engine::{
    Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent,
    OutboxWriter, RunNote, StoreError,
};
use tokio::sync::Notify;

/// A business row: column name → value.
pub type Row = BTreeMap<String, String>;

/// A committed claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRecord {
    /// The claim's subject.
    pub subject: String,
    /// The commit sequence number (a logical clock).
    pub committed_seq: u64,
}

#[derive(Debug, Default)]
struct State {
    claims: HashMap<IdempotencyKey, ClaimRecord>,
    pending: HashMap<IdempotencyKey, u64>,
    /// Committed identities (subject, submission timestamp) → the key that claimed it.
    identities: HashMap<(String, String), IdempotencyKey>,
    /// Identities claimed by open transactions → (transaction, key).
    pending_identities: HashMap<(String, String), (u64, IdempotencyKey)>,
    /// Transaction → the transaction it waits for (a key or an identity it holds).
    waits_for: HashMap<u64, u64>,
    tables: BTreeMap<String, Vec<Row>>,
    /// Sequence number, event, published, committed at.
    outbox: Vec<(u64, OutboxEvent, bool, Instant)>,
    outbox_locked: HashSet<u64>,
    seq: u64,
    /// Recorded reruns per key ([`ClaimStore::note_run`]).
    runs: HashMap<IdempotencyKey, u32>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    released: Notify,
    next_tx: AtomicU64,
    fail_outbox: AtomicBool,
    unavailable: AtomicBool,
    probes_fail: AtomicBool,
    lock_timeout: Mutex<Option<Duration>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread may poison the lock; the state itself stays consistent
        // because every mutation is a single step under the lock.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The in-memory store. Clones share one database.
///
/// Claims behave as Postgres's unique index does: a second claim of a key held by an open
/// transaction waits until that transaction commits (→ `Duplicate`) or rolls back
/// (→ `Claimed`), or answers `InProgress` after the optional lock timeout. Identities
/// ([`ClaimMeta::identity`]) behave as Postgres's partial unique index on them does: a new
/// key of an identity claimed under another key is a `Conflict`, and one held by an open
/// transaction is waited for. Waits that would close a cycle fail at once with a
/// retryable [`StoreError::Conflict`], as Postgres's deadlock detector does (claims in key
/// order cannot deadlock on keys alone, but an identity links two keys).
///
/// ```
/// # tokio_test();
/// # fn tokio_test() { tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
/// use idem_sim::MemoryStore;
///
/// let store = MemoryStore::new();
/// let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").unwrap();
/// let mut tx = store.begin().await.unwrap();
/// assert_eq!(tx.claim(&key, &ClaimMeta::new("A-1")).await.unwrap(), ClaimOutcome::Claimed);
/// tx.commit().await.unwrap();
/// let mut tx = store.begin().await.unwrap();
/// assert_eq!(tx.claim(&key, &ClaimMeta::new("A-1")).await.unwrap(), ClaimOutcome::Duplicate);
/// # }) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Answers `InProgress` when a key stays held by another transaction for `timeout`.
    #[must_use]
    pub fn with_lock_timeout(self, timeout: Duration) -> Self {
        if let Ok(mut t) = self.shared.lock_timeout.lock() {
            *t = Some(timeout);
        }
        self
    }

    /// From now on, every outbox insert fails (to test that the whole transaction rolls
    /// back with it).
    pub fn fail_outbox_inserts(&self, fail: bool) {
        self.shared.fail_outbox.store(fail, Ordering::SeqCst);
    }

    /// From now on (until called with `false`), the store is down for everyone: `begin`
    /// and [`probe`](ClaimStore::probe) fail with [`StoreError::Unavailable`].
    pub fn set_unavailable(&self, down: bool) {
        self.shared.unavailable.store(down, Ordering::SeqCst);
    }

    /// From now on (until called with `false`), the store's own
    /// [probe](ClaimStore::probe) fails while transactions still begin: with a handler
    /// whose writes fail on the store, a store failing for everyone.
    pub fn fail_probes(&self, fail: bool) {
        self.shared.probes_fail.store(fail, Ordering::SeqCst);
    }

    fn check_available(&self, what: &str) -> Result<(), StoreError> {
        if self.shared.unavailable.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable {
                message: format!("{what}: the in-memory store is down"),
                source: None,
            });
        }
        Ok(())
    }

    /// The committed claim of `key`.
    pub fn claim_record(&self, key: &IdempotencyKey) -> Option<ClaimRecord> {
        self.shared.lock().claims.get(key).cloned()
    }

    /// How many claims are committed.
    pub fn claim_count(&self) -> usize {
        self.shared.lock().claims.len()
    }

    /// The committed rows of `table`.
    pub fn rows(&self, table: &str) -> Vec<Row> {
        self.shared
            .lock()
            .tables
            .get(table)
            .cloned()
            .unwrap_or_default()
    }

    /// Every committed outbox event with whether it has been published.
    pub fn outbox(&self) -> Vec<(OutboxEvent, bool)> {
        self.shared
            .lock()
            .outbox
            .iter()
            .map(|(_, e, p, _)| (e.clone(), *p))
            .collect()
    }

    /// How many transactions hold claims right now.
    pub fn open_claims(&self) -> usize {
        self.shared.lock().pending.len()
    }
}

/// A transaction of a [`MemoryStore`]: writes are staged and vanish on rollback or drop.
#[derive(Debug)]
pub struct MemoryTx {
    shared: Arc<Shared>,
    id: u64,
    claimed: Vec<(IdempotencyKey, String)>,
    identities: Vec<(String, String)>,
    rows: Vec<(String, Row)>,
    outbox: Vec<OutboxEvent>,
    finished: bool,
}

impl MemoryTx {
    /// Stages a business row in `table`.
    pub fn insert(&mut self, table: &str, row: Row) {
        self.rows.push((table.to_owned(), row));
    }

    fn release(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let mut st = self.shared.lock();
        st.waits_for.remove(&self.id);
        for (k, _) in &self.claimed {
            if st.pending.get(k) == Some(&self.id) {
                st.pending.remove(k);
            }
        }
        for ident in &self.identities {
            if st.pending_identities.get(ident).map(|(tx, _)| *tx) == Some(self.id) {
                st.pending_identities.remove(ident);
            }
        }
        drop(st);
        self.shared.released.notify_waiters();
    }
}

impl Drop for MemoryTx {
    fn drop(&mut self) {
        self.release();
    }
}

#[async_trait]
impl ClaimStore for MemoryStore {
    type Tx = MemoryTx;

    async fn begin(&self) -> Result<MemoryTx, StoreError> {
        self.check_available("begin")?;
        Ok(MemoryTx {
            shared: self.shared.clone(),
            id: self.shared.next_tx.fetch_add(1, Ordering::Relaxed) + 1,
            claimed: Vec::new(),
            identities: Vec::new(),
            rows: Vec::new(),
            outbox: Vec::new(),
            finished: false,
        })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::TRANSACTIONAL
    }

    /// Commits at once unless the store is [down](MemoryStore::set_unavailable) or its
    /// probes [fail](MemoryStore::fail_probes).
    async fn probe(&self) -> Result<(), StoreError> {
        self.check_available("probe")?;
        if self.shared.probes_fail.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable {
                message: "probe: the in-memory store fails its own writes".into(),
                source: None,
            });
        }
        Ok(())
    }

    /// Kept beside the claims: like them, a simulated crash of the consumer leaves it.
    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: RunNote,
    ) -> Result<Option<u32>, StoreError> {
        let mut st = self.shared.lock();
        Ok(Some(match note {
            RunNote::Started => {
                let n = st.runs.entry(*key).or_insert(0);
                *n += 1;
                *n
            }
            RunNote::NotRun => {
                let n = st.runs.entry(*key).or_insert(0);
                *n = n.saturating_sub(1);
                *n
            }
            RunNote::Settled => {
                st.runs.remove(key);
                0
            }
        }))
    }
}

impl MemoryTx {
    /// `Ok(Some(outcome))`, or `Ok(None)` to wait for another transaction, or `Err` when
    /// that wait would be a deadlock.
    fn try_claim(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let mut st = self.shared.lock();
        st.waits_for.remove(&self.id);
        let blocked = |st: &mut State, owner: u64, id: u64| {
            // Follow the chain of waits from the owner: reaching us is a cycle.
            let mut cur = owner;
            for _ in 0..=st.waits_for.len() {
                if cur == id {
                    return Err(StoreError::Conflict {
                        message: "deadlock detected (in-memory store): a key and an identity \
                                  claimed in opposite orders"
                            .into(),
                        source: None,
                    });
                }
                match st.waits_for.get(&cur) {
                    Some(&next) => cur = next,
                    None => break,
                }
            }
            st.waits_for.insert(id, owner);
            Ok(None)
        };
        if st.claims.contains_key(key) {
            return Ok(Some(ClaimOutcome::Duplicate));
        }
        match st.pending.get(key) {
            Some(&owner) if owner == self.id => return Ok(Some(ClaimOutcome::Duplicate)),
            Some(&owner) => return blocked(&mut st, owner, self.id),
            None => {}
        }
        let ident = meta.identity().map(|(s, t)| (s.to_owned(), t.to_owned()));
        if let Some(ident) = &ident {
            if let Some(existing) = st.identities.get(ident) {
                return Ok(Some(ClaimOutcome::Conflict {
                    existing: *existing,
                }));
            }
            match st.pending_identities.get(ident) {
                Some(&(owner, existing)) if owner == self.id => {
                    return Ok(Some(ClaimOutcome::Conflict { existing }));
                }
                Some(&(owner, _)) => return blocked(&mut st, owner, self.id),
                None => {}
            }
        }
        st.pending.insert(*key, self.id);
        if let Some(ident) = ident {
            st.pending_identities.insert(ident.clone(), (self.id, *key));
            self.identities.push(ident);
        }
        drop(st);
        self.claimed.push((*key, meta.subject.clone()));
        Ok(Some(ClaimOutcome::Claimed))
    }

    async fn claim_waiting(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        let shared = self.shared.clone();
        loop {
            let notified = shared.released.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(out) = self.try_claim(key, meta)? {
                return Ok(out);
            }
            notified.await;
        }
    }
}

#[async_trait]
impl ClaimTx for MemoryTx {
    async fn claim(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        if self.finished {
            return Err(StoreError::other("transaction already finished", false));
        }
        let timeout = self.shared.lock_timeout.lock().ok().and_then(|t| *t);
        match timeout {
            None => self.claim_waiting(key, meta).await,
            Some(t) => match tokio::time::timeout(t, self.claim_waiting(key, meta)).await {
                Ok(out) => out,
                Err(_) => {
                    self.shared.lock().waits_for.remove(&self.id);
                    Ok(ClaimOutcome::InProgress)
                }
            },
        }
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        if self.finished {
            return Err(StoreError::other("transaction already finished", false));
        }
        {
            let mut st = self.shared.lock();
            st.seq += 1;
            let seq = st.seq;
            for (k, subject) in &self.claimed {
                st.pending.remove(k);
                st.claims.insert(
                    *k,
                    ClaimRecord {
                        subject: subject.clone(),
                        committed_seq: seq,
                    },
                );
            }
            for ident in self.identities.drain(..) {
                if let Some((_, key)) = st.pending_identities.remove(&ident) {
                    st.identities.insert(ident, key);
                }
            }
            for (table, row) in self.rows.drain(..) {
                st.tables.entry(table).or_default().push(row);
            }
            let now = Instant::now();
            for ev in self.outbox.drain(..) {
                st.seq += 1;
                let s = st.seq;
                st.outbox.push((s, ev, false, now));
            }
        }
        self.finished = true;
        self.shared.released.notify_waiters();
        Ok(())
    }

    async fn rollback(mut self) -> Result<(), StoreError> {
        self.release();
        Ok(())
    }
}

#[async_trait]
impl OutboxWriter for MemoryTx {
    async fn enqueue(&mut self, event: &OutboxEvent) -> Result<(), StoreError> {
        if self.shared.fail_outbox.load(Ordering::SeqCst) {
            return Err(StoreError::Rejected {
                message: "outbox insert refused (injected)".into(),
                source: None,
            });
        }
        if !self.outbox.iter().any(|e| e.event_id == event.event_id) {
            self.outbox.push(event.clone());
        }
        Ok(())
    }
}

/// A relay source over a [`MemoryStore`]'s outbox (for relay tests without a database).
#[derive(Debug, Clone)]
pub struct MemoryOutbox {
    store: MemoryStore,
    poll: Duration,
}

impl MemoryOutbox {
    /// A source that polls every `poll` when idle.
    pub fn new(store: MemoryStore, poll: Duration) -> Self {
        Self { store, poll }
    }
}

/// A leased batch of a [`MemoryOutbox`].
#[derive(Debug)]
pub struct MemoryOutboxBatch {
    shared: Arc<Shared>,
    seqs: Vec<u64>,
    events: Vec<OutboxEvent>,
    done: bool,
}

impl MemoryOutboxBatch {
    fn unlock(&mut self, publish: bool) {
        if self.done {
            return;
        }
        self.done = true;
        let mut st = self.shared.lock();
        for s in &self.seqs {
            st.outbox_locked.remove(s);
        }
        if publish {
            for row in st.outbox.iter_mut() {
                if self.seqs.contains(&row.0) {
                    row.2 = true;
                }
            }
        }
    }
}

impl Drop for MemoryOutboxBatch {
    fn drop(&mut self) {
        self.unlock(false);
    }
}

#[async_trait]
impl idem_engine::OutboxBatch for MemoryOutboxBatch {
    fn events(&self) -> &[OutboxEvent] {
        &self.events
    }

    async fn mark_published(mut self) -> Result<(), StoreError> {
        self.unlock(true);
        Ok(())
    }

    async fn release(mut self) -> Result<(), StoreError> {
        self.unlock(false);
        Ok(())
    }
}

#[async_trait]
impl idem_engine::OutboxSource for MemoryOutbox {
    type Batch = MemoryOutboxBatch;

    async fn lease(&self, max: usize) -> Result<MemoryOutboxBatch, StoreError> {
        let shared = self.store.shared.clone();
        let mut st = shared.lock();
        let mut blocked: HashSet<String> = HashSet::new();
        let mut seqs = Vec::new();
        let mut events = Vec::new();
        for (seq, ev, published, _) in &st.outbox {
            if *published {
                continue;
            }
            // A subject with an earlier event held elsewhere waits: order per subject.
            if st.outbox_locked.contains(seq) {
                blocked.insert(ev.subject.clone());
                continue;
            }
            if blocked.contains(&ev.subject) || seqs.len() >= max {
                blocked.insert(ev.subject.clone());
                continue;
            }
            seqs.push(*seq);
            events.push(ev.clone());
        }
        for s in &seqs {
            st.outbox_locked.insert(*s);
        }
        drop(st);
        Ok(MemoryOutboxBatch {
            shared,
            seqs,
            events,
            done: false,
        })
    }

    async fn wait(&self) -> Result<(), StoreError> {
        tokio::time::sleep(self.poll).await;
        Ok(())
    }

    async fn backlog(&self) -> Result<idem_engine::OutboxBacklog, StoreError> {
        let st = self.store.shared.lock();
        let mut unpublished = st.outbox.iter().filter(|row| !row.2);
        let oldest = unpublished.next().map(|row| row.3.elapsed());
        Ok(idem_engine::OutboxBacklog {
            pending: u64::from(oldest.is_some()) + unpublished.count() as u64,
            oldest_age: oldest,
        })
    }
}
