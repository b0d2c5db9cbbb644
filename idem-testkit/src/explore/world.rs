//! The explorer's world: a store, a broker and a filter modelled in memory, and the
//! wrappers through which the real `Gate` reaches them. Every call through a wrapper is a
//! choice point: it stays pending until the explorer grants it a [`Decision`].

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::gate::ATTEMPTS_EXHAUSTED;
use idem_core::{
    AckError, AckProof, AckReason, Acker, Capabilities, ClaimMeta, ClaimOutcome, ClaimStore,
    ClaimTx, Clock, DoneFilter, FilteredTx, Handler, HandlerError, Headers, IdempotencyKey,
    OutboxEvent, OutboxWriter, RejectReason, StoreError, Submission,
};

/// A task of the explorer (a worker process): its index and its incarnation.
pub(crate) type TaskId = u64;

/// The error classes the explorer injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    /// The store is unreachable (a transient error).
    Unavailable,
    /// A serialization failure or deadlock (transient).
    Conflict,
    /// The store or handler refuses this message for good (permanent; it stays refused).
    Rejected,
    /// The deployment is wrong (a missing table): the consumer must stop.
    Config,
}

impl Fault {
    /// A failure on the store's side that the gate judges by the store's evidence
    /// (`Unavailable`, `Conflict`), as opposed to a refusal or a configuration error.
    pub(crate) fn judged(self) -> bool {
        matches!(self, Self::Unavailable | Self::Conflict)
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Unavailable => "unavailable",
            Self::Conflict => "conflict",
            Self::Rejected => "rejected",
            Self::Config => "config",
        }
    }

    fn error(self, what: &str) -> StoreError {
        match self {
            Self::Unavailable => StoreError::Unavailable {
                message: format!("{what}: injected outage"),
                source: None,
            },
            Self::Conflict => StoreError::Conflict {
                message: format!("{what}: injected serialization failure"),
                source: None,
            },
            Self::Rejected => StoreError::Rejected {
                message: format!("{what}: injected refusal"),
                source: None,
            },
            Self::Config => StoreError::Config(format!("{what}: injected missing table")),
        }
    }
}

/// What a wrapper call is about to do.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    /// A worker asks the broker for up to `max` deliveries.
    Receive { max: usize },
    /// Begin a transaction.
    Begin,
    /// Claim `key` in transaction `tx`; `ident`: the claim records and checks the key's
    /// identity ([`ClaimMeta::identity`]).
    Claim { tx: u64, key: u8, ident: bool },
    /// The handler's write of `key` in transaction `tx`.
    Handle { tx: u64, key: u8 },
    /// Commit transaction `tx`.
    Commit { tx: u64 },
    /// Ack delivery `tag`.
    Ack { tag: u64 },
    /// The store's probe (`ClaimStore::probe`): a write of its own that commits, or not.
    Probe,
}

/// The explorer's answer to a choice point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Decision {
    /// Go ahead.
    Proceed,
    /// Take `k` ready messages, in reverse order when `reverse`.
    Take { k: usize, reverse: bool },
    /// Return this error.
    Fail(Fault),
    /// A claim waiting on a lock gives up: `InProgress`.
    LockTimeout,
    /// The commit takes effect, then the process dies before it hears of it.
    CommitThenCrash,
    /// The commit takes effect but the client sees an error (the outcome is unknown).
    CommitUnknown,
    /// The ack is sent and lost: the broker redelivers.
    AckLost,
    /// The commit applies nothing (the transaction was aborted inside, Postgres's
    /// 25P02), and the store adapter reports it as a `Conflict` (under the
    /// `void-commit-reported-ok` mutant: as a success).
    CommitVoid,
}

/// A pending choice point.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) id: u64,
    pub(crate) task: TaskId,
    pub(crate) op: Op,
    pub(crate) decision: Option<Decision>,
    pub(crate) waker: Option<Waker>,
}

/// Where a message is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum MsgState {
    Ready(u64),
    InFlight(u64),
    Delayed(u64),
    Acked,
    Dead(&'static str),
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct Msg {
    /// The key index, or `None` for bad input.
    pub(crate) key: Option<u8>,
    /// The broker's delivery count: raised by every delivery but those a `defer` handed
    /// back on a broker that counts runs (the delivery's `attempt`).
    pub(crate) deliveries: u32,
    /// Of those, the deliveries a store outage cost it: nacks (not deferrals) after the
    /// delivery's transaction met a store outage (tracked in process mode).
    pub(crate) outage_nacks: u32,
    /// Of those, the deliveries a killer message cost it: it was held by a process that
    /// another message's handler killed.
    pub(crate) collateral: u32,
    /// Store outages injected while a delivery of it was held.
    pub(crate) outages_met: u32,
    /// Failures on the store's side that met it, each followed by a probe of the store
    /// that committed (`ClaimStore::probe`): the store's evidence that the failure was
    /// this message's, the only ground for dead-lettering it for them.
    pub(crate) proven: u32,
    pub(crate) state: MsgState,
}

impl Msg {
    pub(crate) fn new(key: Option<u8>) -> Self {
        Self {
            key,
            state: MsgState::Ready(0),
            ..Self::default()
        }
    }

    /// The deliveries that count against the message: all but those a store outage cost
    /// it (a neighbour that killed their process costs it one at most, checked then).
    pub(crate) fn charged(&self) -> u32 {
        self.deliveries.saturating_sub(self.outage_nacks)
    }
}

impl Default for MsgState {
    fn default() -> Self {
        Self::Ready(0)
    }
}

/// The durable part of the store (what a backup holds).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct Durable {
    pub(crate) committed: BTreeSet<u8>,
    /// Identity → the key whose committed claim recorded it.
    pub(crate) identities: BTreeMap<u8, u8>,
    pub(crate) effects: BTreeMap<u8, u32>,
    pub(crate) outbox: BTreeMap<u8, u32>,
    /// The store's identity (rotated by the restore runbook).
    pub(crate) identity: u64,
    /// Recorded reruns per key (`ClaimStore::note_run`), kept like the claims.
    pub(crate) runs: BTreeMap<u8, u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct OpenTx {
    pub(crate) task: TaskId,
    pub(crate) claimed: Vec<u8>,
    /// `(identity, key)` for the claims that recorded their identity.
    pub(crate) idents: Vec<(u8, u8)>,
    pub(crate) effects: Vec<u8>,
}

/// Everything the explorer's world holds.
#[derive(Debug, Default)]
pub(crate) struct World {
    pub(crate) now_ms: u64,
    pub(crate) durable: Durable,
    pub(crate) snapshots: Vec<Durable>,
    pub(crate) locks: BTreeMap<u8, u64>,
    /// Identity → (transaction, key): the uncommitted claim that recorded it (the identity
    /// index's entry).
    pub(crate) ident_locks: BTreeMap<u8, (u64, u8)>,
    pub(crate) txs: BTreeMap<u64, OpenTx>,
    pub(crate) next_tx: u64,
    pub(crate) msgs: Vec<Msg>,
    /// Delivery tag → (message index, live).
    pub(crate) tags: BTreeMap<u64, (usize, bool)>,
    /// Delivery tag → the task that received it.
    pub(crate) tag_task: BTreeMap<u64, TaskId>,
    pub(crate) next_tag: u64,
    pub(crate) next_seq: u64,
    pub(crate) marks: BTreeSet<(u64, u8)>,
    pub(crate) filter_up: bool,
    /// Keys the store or handler refuses for good (injected `Rejected`).
    pub(crate) poisoned: BTreeSet<u8>,
    /// (task, key): the task's current delivery of the key met the refusal.
    pub(crate) refused: BTreeSet<(TaskId, u8)>,
    /// Tasks whose current transaction met a store outage (cleared at its next begin).
    pub(crate) outage: BTreeSet<TaskId>,
    /// `GateConfig::max_attempts` of the gates explored.
    pub(crate) max_attempts: u32,
    /// The broker ends a message it would deliver more than this many times.
    pub(crate) broker_limit: u32,
    /// Whether the broker counts runs only (`Acker::attempt_counts_runs`).
    pub(crate) counts_runs: bool,
    /// The gate checks the attempt before the handler
    /// (`GateConfig::check_attempts_before_handler`): on in the killer passes, off (the
    /// default a user gets) elsewhere.
    pub(crate) check_before_handler: bool,
    /// Whether the store reports a commit that applied nothing as a success (a mutant).
    pub(crate) void_commit_ok: bool,
    /// Per killer key: how many times its handler ran (each run killed its process).
    pub(crate) killer_runs: BTreeMap<u8, u32>,
    /// Keys whose commit a restore took away after all their messages were settled: the
    /// loss a restore from backup always causes, not idem's.
    pub(crate) lost_to_restore: BTreeSet<u8>,
    pub(crate) requests: BTreeMap<u64, Request>,
    pub(crate) next_request: u64,
    pub(crate) current_task: TaskId,
    /// Per task: a running hash of what it was granted (its position).
    pub(crate) history: BTreeMap<TaskId, u64>,
    pub(crate) violations: Vec<String>,
    pub(crate) trace: Vec<String>,
    /// Whether the per-task "ack while own transaction open" check applies (one
    /// delivery or batch at a time per task).
    pub(crate) per_task_tx_check: bool,
    /// Whether filter marks ignore the store identity (a mutant).
    pub(crate) unscoped_marks: bool,
    /// Streams end (consumer mode) once the explorer says the run is over.
    pub(crate) closed: bool,
    /// Whether a conflicting resubmission is dead-lettered (the default policy) rather
    /// than processed: then at most one effect per identity.
    pub(crate) conflicts_dead_letter: bool,
    /// With [`Config::first_wins`](super::Config::first_wins): each identity's key first
    /// received by a worker. The identity's effect must be that key's, unless that key's
    /// message was dead-lettered first.
    pub(crate) first_received: Option<BTreeMap<u8, u8>>,
}

/// The shared world.
pub(crate) type Shared = Arc<Mutex<World>>;

pub(crate) fn lock(w: &Shared) -> MutexGuard<'_, World> {
    w.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The first key index of the conflicting resubmissions: key `CONFLICT_BASE + j` is
/// another payload of key `j`'s submission (the same subject and timestamp, so the same
/// identity, another key).
pub(crate) const CONFLICT_BASE: u8 = 100;

/// The first key index of the killer messages: each run of such a key's handler kills
/// the process running it.
pub(crate) const KILLER_BASE: u8 = 50;

/// The first key index of the recurring-failure messages: such a key's handler fails
/// with a transient error on every attempt.
pub(crate) const RECURRING_BASE: u8 = 70;

/// The dead-letter code of a message the broker ended at its own delivery limit (the
/// broker gives no reason; the code only names the place).
pub(crate) const BROKER_LIMIT: &str = "broker_limit";

/// Whether key `k`'s handler kills its process on every run.
pub(crate) fn is_killer(k: u8) -> bool {
    (KILLER_BASE..RECURRING_BASE).contains(&k)
}

/// Whether key `k`'s handler fails transiently on every attempt.
pub(crate) fn is_recurring(k: u8) -> bool {
    (RECURRING_BASE..CONFLICT_BASE).contains(&k)
}

/// The submission timestamp of every explored submission.
pub(crate) const TIMESTAMP: &str = "2026-07-01T09:00:00Z";

/// Key `i`'s identity: its submission's index.
pub(crate) fn ident_of(i: u8) -> u8 {
    if i >= CONFLICT_BASE {
        i - CONFLICT_BASE
    } else {
        i
    }
}

pub(crate) fn key_of(i: u8) -> IdempotencyKey {
    let payload = payload_of(i);
    IdempotencyKey::derive(&format!("S-{}", ident_of(i)), TIMESTAMP, &payload)
        .unwrap_or_else(|_| IdempotencyKey::from_bytes([i; 32]))
}

pub(crate) fn payload_of(i: u8) -> Vec<u8> {
    format!("k{i}").into_bytes()
}

fn key_index(k: &IdempotencyKey) -> u8 {
    // Keys are few; find the index by derivation.
    (0..=u8::MAX).find(|&i| key_of(i) == *k).unwrap_or(u8::MAX)
}

impl World {
    pub(crate) fn violate(&mut self, what: String) {
        self.trace.push(format!("VIOLATION: {what}"));
        self.violations.push(what);
    }

    pub(crate) fn record(&mut self, task: TaskId, what: impl Hash) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.history.get(&task).copied().unwrap_or(0).hash(&mut h);
        what.hash(&mut h);
        self.now_ms.hash(&mut h);
        self.history.insert(task, h.finish());
    }

    /// The transaction key `k`'s claim by transaction `tx` would wait on, if any: another
    /// transaction's uncommitted row with the same key, or (`ident`: the claim records the
    /// identity, not yet committed under any key) with the same identity.
    pub(crate) fn claim_waits_on(&self, tx: u64, k: u8, ident: bool) -> Option<u64> {
        if self.durable.committed.contains(&k) || self.poisoned.contains(&k) {
            return None;
        }
        if let Some(&holder) = self.locks.get(&k).filter(|&&h| h != tx) {
            return Some(holder);
        }
        let i = ident_of(k);
        if ident && !self.durable.identities.contains_key(&i) {
            if let Some(&(holder, _)) = self.ident_locks.get(&i).filter(|(h, _)| *h != tx) {
                return Some(holder);
            }
        }
        None
    }

    /// Whether key `k`'s claim by transaction `tx` would wait on another transaction.
    pub(crate) fn claim_blocked(&self, tx: u64, k: u8, ident: bool) -> bool {
        self.claim_waits_on(tx, k, ident).is_some()
    }

    /// The effects per identity (the sum over its keys).
    pub(crate) fn identity_effects(&self) -> BTreeMap<u8, u32> {
        let mut out: BTreeMap<u8, u32> = BTreeMap::new();
        for (k, n) in &self.durable.effects {
            *out.entry(ident_of(*k)).or_insert(0) += n;
        }
        out
    }

    pub(crate) fn ready_count(&self) -> usize {
        self.msgs
            .iter()
            .filter(|m| matches!(m.state, MsgState::Ready(_)))
            .count()
    }

    fn release_tx(&mut self, tx: u64) {
        if let Some(open) = self.txs.remove(&tx) {
            for k in open.claimed {
                if self.locks.get(&k) == Some(&tx) {
                    self.locks.remove(&k);
                }
            }
            for (i, _) in open.idents {
                if self.ident_locks.get(&i).is_some_and(|(h, _)| *h == tx) {
                    self.ident_locks.remove(&i);
                }
            }
        }
    }

    /// The messages whose live deliveries `task` holds.
    pub(crate) fn held_by(&self, task: TaskId) -> Vec<usize> {
        self.tags
            .iter()
            .filter(|(tag, (_, live))| *live && self.tag_task.get(tag) == Some(&task))
            .map(|(_, (idx, _))| *idx)
            .collect()
    }

    /// A store outage injected into `task`'s transaction: the messages it holds met it.
    pub(crate) fn note_outage(&mut self, task: TaskId) {
        self.outage.insert(task);
        for idx in self.held_by(task) {
            self.msgs[idx].outages_met += 1;
        }
    }

    /// A probe of the store committed while `task`'s transaction had met a failure on
    /// the store's side: the messages it holds have the store's evidence for that one.
    pub(crate) fn note_proof(&mut self, task: TaskId) {
        if self.outage.remove(&task) {
            for idx in self.held_by(task) {
                self.msgs[idx].proven += 1;
            }
        }
    }

    pub(crate) fn make_ready(&mut self, idx: usize) {
        self.next_seq += 1;
        self.msgs[idx].state = MsgState::Ready(self.next_seq);
    }

    /// A valid message (index `idx`, key `k`) dead-lettered by `task` because its
    /// attempts ran out: lawful only if the deliveries that count against the message
    /// itself reached the limit, or (the gate's count of failures on the store's side)
    /// at least the limit of such failures met it, each with the store's evidence that it
    /// worked (a probe that committed after it), counted over the copies of its key. A
    /// store failure without that evidence never charges the message.
    fn check_exhausted(&mut self, task: TaskId, tag: u64, idx: usize, k: u8) {
        let m = &self.msgs[idx];
        let max = self.max_attempts;
        // The gate counts a key's failures on the store's side, whichever of its copies
        // (messages of one key) met them.
        let proven: u32 = self
            .msgs
            .iter()
            .filter(|o| o.key == m.key)
            .map(|o| o.proven)
            .sum();
        if m.charged() >= max || proven >= max {
            return;
        }
        let what = format!(
            "t{task}: d{tag} (k{k}) dead-lettered ({ATTEMPTS_EXHAUSTED}) after {} of its \
             deliveries counted against it, the limit being {max} ({} deliveries, {} of \
             them cost by store outages; {} store failures met, {} with the store's \
             evidence that it worked)",
            m.charged(),
            m.deliveries,
            m.outage_nacks,
            m.outages_met,
            m.proven,
        );
        self.violate(what);
    }

    /// The identity-scoped mark of key `k` for a filter created under `scope`.
    fn mark_scope(&self, scope: u64) -> u64 {
        if self.unscoped_marks {
            0
        } else {
            scope
        }
    }
}

/// A choice point: pending until the explorer decides.
pub(crate) struct Point {
    world: Shared,
    op: Option<Op>,
    id: Option<u64>,
}

impl Point {
    pub(crate) fn new(world: &Shared, op: Op) -> Self {
        Self {
            world: world.clone(),
            op: Some(op),
            id: None,
        }
    }
}

impl Future for Point {
    type Output = Decision;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Decision> {
        let world = self.world.clone();
        let mut w = lock(&world);
        match self.id {
            None => {
                w.next_request += 1;
                let id = w.next_request;
                let task = w.current_task;
                let op = self.op.take().unwrap_or(Op::Begin);
                w.requests.insert(
                    id,
                    Request {
                        id,
                        task,
                        op,
                        decision: None,
                        waker: Some(cx.waker().clone()),
                    },
                );
                self.id = Some(id);
                Poll::Pending
            }
            Some(id) => match w.requests.get_mut(&id) {
                Some(r) => match r.decision {
                    Some(d) => {
                        w.requests.remove(&id);
                        self.id = None;
                        Poll::Ready(d)
                    }
                    None => {
                        r.waker = Some(cx.waker().clone());
                        Poll::Pending
                    }
                },
                None => Poll::Ready(Decision::Proceed),
            },
        }
    }
}

impl Drop for Point {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            lock(&self.world).requests.remove(&id);
        }
    }
}

/// The explorer's clock: the world's logical time.
#[derive(Debug)]
pub(crate) struct WorldClock(pub(crate) Shared);

impl Clock for WorldClock {
    fn now(&self) -> Duration {
        Duration::from_millis(lock(&self.0).now_ms)
    }
}

/// The explorer's transactional store (Postgres's claim semantics).
#[derive(Debug, Clone)]
pub(crate) struct ExStore(pub(crate) Shared);

/// A transaction of [`ExStore`].
#[derive(Debug)]
pub(crate) struct ExTx {
    world: Shared,
    id: u64,
    done: bool,
}

impl Drop for ExTx {
    fn drop(&mut self) {
        if !self.done {
            lock(&self.world).release_tx(self.id);
        }
    }
}

#[async_trait]
impl ClaimStore for ExStore {
    type Tx = ExTx;

    async fn begin(&self) -> Result<ExTx, StoreError> {
        let d = Point::new(&self.0, Op::Begin).await;
        let mut w = lock(&self.0);
        let task = w.current_task;
        w.record(task, ("begin", d));
        // A refusal or an outage counts for the transaction that met it only.
        w.refused.retain(|(t, _)| *t != task);
        w.outage.remove(&task);
        if let Decision::Fail(f) = d {
            if f.judged() {
                w.note_outage(task);
            }
            w.trace
                .push(format!("t{task}: begin fails ({})", f.as_str()));
            return Err(f.error("begin"));
        }
        w.next_tx += 1;
        let id = w.next_tx;
        w.txs.insert(
            id,
            OpenTx {
                task,
                ..OpenTx::default()
            },
        );
        w.trace.push(format!("t{task}: begin tx{id}"));
        Ok(ExTx {
            world: self.0.clone(),
            id,
            done: false,
        })
    }

    /// Like Postgres with the identity column: claims record the submission's identity
    /// and a second key for it is a `Conflict`.
    fn capabilities(&self) -> Capabilities {
        Capabilities::TRANSACTIONAL.with_conflict_detection(true)
    }

    /// A choice point: the probe commits (the messages of a transaction that met a
    /// failure on the store's side get the store's evidence for it) or meets an outage.
    async fn probe(&self) -> Result<(), StoreError> {
        let d = Point::new(&self.0, Op::Probe).await;
        let mut w = lock(&self.0);
        let task = w.current_task;
        w.record(task, ("probe", d));
        if let Decision::Fail(f) = d {
            w.trace
                .push(format!("t{task}: probe fails ({})", f.as_str()));
            return Err(f.error("probe"));
        }
        w.note_proof(task);
        w.trace.push(format!("t{task}: probe commits"));
        Ok(())
    }

    /// One atomic, durable step (an autocommitted upsert): no fault, no interleaving
    /// inside it; a crash before or after it is explored at the gate's next point.
    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: idem_core::RunNote,
    ) -> Result<Option<u32>, StoreError> {
        let k = key_index(key);
        let mut w = lock(&self.0);
        let task = w.current_task;
        let n = match note {
            idem_core::RunNote::Started => {
                let n = w.durable.runs.entry(k).or_insert(0);
                *n += 1;
                *n
            }
            idem_core::RunNote::NotRun => {
                let n = w.durable.runs.entry(k).or_insert(0);
                *n = n.saturating_sub(1);
                *n
            }
            idem_core::RunNote::Settled => {
                w.durable.runs.remove(&k);
                0
            }
        };
        w.trace
            .push(format!("t{task}: note run of k{k} {note:?}: {n}"));
        Ok(Some(n))
    }
}

impl ExTx {
    /// Applies a granted commit to the world (or fails it).
    fn apply_commit(&mut self, d: Decision) -> Result<(), StoreError> {
        let mut w = lock(&self.world);
        let task = w.current_task;
        w.record(task, ("commit", d));
        if let Decision::Fail(f) = d {
            if f.judged() {
                w.note_outage(task);
            }
            w.trace.push(format!(
                "t{task}: commit tx{} fails ({})",
                self.id,
                f.as_str()
            ));
            w.release_tx(self.id);
            self.done = true;
            return Err(f.error("commit"));
        }
        if d == Decision::CommitVoid {
            w.release_tx(self.id);
            self.done = true;
            if w.void_commit_ok {
                w.trace.push(format!(
                    "t{task}: commit tx{} applies nothing and reports success",
                    self.id
                ));
                return Ok(());
            }
            w.trace.push(format!(
                "t{task}: commit tx{} applies nothing (aborted inside): Conflict",
                self.id
            ));
            w.note_outage(task);
            return Err(Fault::Conflict.error("commit (the transaction was aborted: 25P02)"));
        }
        if d == Decision::CommitUnknown {
            w.note_outage(task);
        }
        let open = w.txs.get(&self.id).cloned().unwrap_or_default();
        let before = w.durable.clone();
        w.snapshots.push(before);
        for k in &open.claimed {
            w.durable.committed.insert(*k);
        }
        for (i, k) in &open.idents {
            w.durable.identities.insert(*i, *k);
        }
        let late: Vec<(u8, u8, u8)> = w
            .first_received
            .as_ref()
            .map(|first| {
                open.idents
                    .iter()
                    .filter_map(|(i, k)| first.get(i).filter(|f| *f != k).map(|f| (*i, *k, *f)))
                    // A first payload dead-lettered (its attempts ran out, refused for
                    // good) has given the identity up.
                    .filter(|(_, _, f)| {
                        !w.msgs
                            .iter()
                            .any(|m| m.key == Some(*f) && matches!(m.state, MsgState::Dead(_)))
                    })
                    .collect()
            })
            .unwrap_or_default();
        for (i, k, f) in late {
            w.violate(format!(
                "t{task}: identity {i} took effect under k{k}, but k{f} was delivered first \
                 (the first delivered must win)"
            ));
        }
        for k in &open.effects {
            *w.durable.effects.entry(*k).or_insert(0) += 1;
            *w.durable.outbox.entry(*k).or_insert(0) += 1;
        }
        w.release_tx(self.id);
        self.done = true;
        w.trace.push(format!(
            "t{task}: commit tx{} (claims {:?}){}",
            self.id,
            open.claimed,
            match d {
                Decision::CommitThenCrash => ", then the process dies",
                Decision::CommitUnknown => ", but the client sees an error",
                _ => "",
            }
        ));
        for (k, n) in &w.durable.effects.clone() {
            if *n > 1 {
                w.violate(format!("k{k} has {n} effects"));
            }
        }
        if w.conflicts_dead_letter {
            for (i, n) in w.identity_effects() {
                if n > 1 {
                    w.violate(format!(
                        "submission S-{i} has {n} effects (a conflicting payload was processed)"
                    ));
                }
            }
        }
        Ok(())
    }
}

#[async_trait]
impl ClaimTx for ExTx {
    async fn claim(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        let k = key_index(key);
        let ident = meta.identity().is_some();
        let d = Point::new(
            &self.world,
            Op::Claim {
                tx: self.id,
                key: k,
                ident,
            },
        )
        .await;
        let mut w = lock(&self.world);
        let task = w.current_task;
        w.record(task, ("claim", k, d));
        if w.poisoned.contains(&k) && !w.durable.committed.contains(&k) {
            w.refused.insert((task, k));
            w.trace.push(format!(
                "t{task}: claim k{k} in tx{} refused for good",
                self.id
            ));
            return Err(Fault::Rejected.error("claim"));
        }
        match d {
            Decision::Fail(f) => {
                if f == Fault::Rejected {
                    w.poisoned.insert(k);
                    w.refused.insert((task, k));
                }
                if f.judged() {
                    w.note_outage(task);
                }
                w.trace.push(format!(
                    "t{task}: claim k{k} in tx{} fails ({})",
                    self.id,
                    f.as_str()
                ));
                Err(f.error("claim"))
            }
            Decision::LockTimeout => {
                w.trace.push(format!(
                    "t{task}: claim k{k} in tx{} times out waiting",
                    self.id
                ));
                Ok(ClaimOutcome::InProgress)
            }
            _ => {
                let i = ident_of(k);
                // The identity's row: committed, or this transaction's own (an in-batch
                // conflict: the first claimed wins).
                let holder = w.durable.identities.get(&i).copied().or_else(|| {
                    w.ident_locks
                        .get(&i)
                        .filter(|(h, _)| *h == self.id)
                        .map(|(_, e)| *e)
                });
                let out = if w.durable.committed.contains(&k) || w.locks.get(&k) == Some(&self.id) {
                    ClaimOutcome::Duplicate
                } else if let Some(e) = holder.filter(|&e| ident && e != k) {
                    ClaimOutcome::Conflict {
                        existing: key_of(e),
                    }
                } else {
                    w.locks.insert(k, self.id);
                    if ident {
                        w.ident_locks.insert(i, (self.id, k));
                    }
                    if let Some(t) = w.txs.get_mut(&self.id) {
                        t.claimed.push(k);
                        if ident {
                            t.idents.push((i, k));
                        }
                    }
                    ClaimOutcome::Claimed
                };
                w.trace
                    .push(format!("t{task}: claim k{k} in tx{} → {out:?}", self.id));
                Ok(out)
            }
        }
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        let d = Point::new(&self.world, Op::Commit { tx: self.id }).await;
        self.apply_commit(d)?;
        match d {
            Decision::CommitUnknown => Err(Fault::Unavailable.error("commit (outcome unknown)")),
            Decision::CommitThenCrash => {
                // Never returns: the explorer drops this task before it is polled again.
                std::future::pending::<()>().await;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    async fn rollback(mut self) -> Result<(), StoreError> {
        let mut w = lock(&self.world);
        let task = w.current_task;
        w.trace.push(format!("t{task}: rollback tx{}", self.id));
        w.release_tx(self.id);
        self.done = true;
        Ok(())
    }
}

#[async_trait]
impl OutboxWriter for ExTx {
    async fn enqueue(&mut self, _event: &OutboxEvent) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The front filter: marks in a Redis-like map, keyed by the store identity.
#[derive(Debug)]
pub(crate) struct ExFilter {
    pub(crate) world: Shared,
    /// The store identity this filter was built with (read at the worker's start).
    pub(crate) scope: u64,
}

#[async_trait]
impl DoneFilter for ExFilter {
    async fn seen(&self, keys: &[IdempotencyKey]) -> Result<Vec<bool>, StoreError> {
        let mut w = lock(&self.world);
        let task = w.current_task;
        if !w.filter_up {
            w.record(task, "seen: error");
            return Err(Fault::Unavailable.error("filter lookup"));
        }
        let scope = w.mark_scope(self.scope);
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let k = key_index(key);
            let hit = w.marks.contains(&(scope, k));
            if hit && !w.durable.committed.contains(&k) {
                let task = w.current_task;
                w.violate(format!(
                    "t{task}: the filter answered 'done' for k{k}, which this store has not committed"
                ));
            }
            out.push(hit);
        }
        w.record(task, ("seen", &out));
        Ok(out)
    }

    async fn mark_done(&self, keys: &[IdempotencyKey]) -> Result<(), StoreError> {
        let mut w = lock(&self.world);
        let task = w.current_task;
        if !w.filter_up {
            w.record(task, "mark: error");
            return Err(Fault::Unavailable.error("filter mark"));
        }
        w.record(task, "mark");
        let scope = w.mark_scope(self.scope);
        for key in keys {
            let k = key_index(key);
            if !w.durable.committed.contains(&k) || w.durable.identity != self.scope {
                w.violate(format!(
                    "t{task}: the filter marked k{k} done without a commit of it in this store"
                ));
            }
            w.marks.insert((scope, k));
        }
        Ok(())
    }
}

/// The handler: one effect row and one outbox row per submission. Payloads are `k<i>`;
/// anything else is bad input.
#[derive(Debug, Clone)]
pub(crate) struct ExHandler(pub(crate) Shared);

#[async_trait]
impl Handler<FilteredTx<ExTx, ExFilter>> for ExHandler {
    type Input = u8;

    fn identify(&self, payload: &[u8], _h: &Headers) -> Result<Submission<u8>, RejectReason> {
        let text = std::str::from_utf8(payload).unwrap_or("");
        let i: u8 = text
            .strip_prefix('k')
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| RejectReason::new("malformed", "not a k<i> payload"))?;
        Ok(Submission {
            key: key_of(i),
            subject: format!("S-{}", ident_of(i)),
            input: i,
        })
    }

    fn claim_meta(&self, sub: &Submission<u8>) -> ClaimMeta {
        ClaimMeta::new(sub.subject.clone()).with_submission_timestamp(TIMESTAMP)
    }

    async fn handle(
        &self,
        tx: &mut FilteredTx<ExTx, ExFilter>,
        sub: &Submission<u8>,
    ) -> Result<(), HandlerError> {
        let id = tx.inner_mut().id;
        let k = sub.input;
        let d = Point::new(&self.0, Op::Handle { tx: id, key: k }).await;
        let mut w = lock(&self.0);
        let task = w.current_task;
        w.record(task, ("handle", k, d));
        if w.poisoned.contains(&k) {
            w.refused.insert((task, k));
            w.trace
                .push(format!("t{task}: handler refuses k{k} for good"));
            return Err(HandlerError::Store(Fault::Rejected.error("handler write")));
        }
        if is_recurring(k) {
            w.trace.push(format!(
                "t{task}: handler fails on k{k} (transient, as always)"
            ));
            return Err(HandlerError::Transient(
                "injected failure that recurs on every attempt".into(),
            ));
        }
        match d {
            Decision::Fail(Fault::Rejected) => {
                w.poisoned.insert(k);
                w.refused.insert((task, k));
                w.trace
                    .push(format!("t{task}: handler refuses k{k} (rejected)"));
                Err(HandlerError::Store(Fault::Rejected.error("handler write")))
            }
            Decision::Fail(Fault::Unavailable) => {
                w.trace
                    .push(format!("t{task}: handler fails on k{k} (transient)"));
                Err(HandlerError::Transient("injected transient failure".into()))
            }
            Decision::Fail(f) => {
                w.trace
                    .push(format!("t{task}: handler fails on k{k} ({})", f.as_str()));
                Err(HandlerError::Store(f.error("handler write")))
            }
            _ => {
                if let Some(t) = w.txs.get_mut(&id) {
                    t.effects.push(k);
                }
                w.trace
                    .push(format!("t{task}: handler writes k{k} in tx{id}"));
                Ok(())
            }
        }
    }
}

/// A delivery's acker.
#[derive(Debug)]
pub(crate) struct ExAcker {
    pub(crate) world: Shared,
    pub(crate) tag: u64,
    pub(crate) settled: bool,
}

impl ExAcker {
    fn message(w: &World, tag: u64) -> Option<(usize, bool)> {
        w.tags.get(&tag).copied()
    }
}

impl ExAcker {
    /// Hands the delivery back to the broker, after `delay` (`kept`: without raising its
    /// delivery count, a deferral on a broker that counts runs).
    fn hand_back(&mut self, delay: Option<Duration>, kept: bool) {
        let mut w = lock(&self.world);
        let task = w.current_task;
        self.settled = true;
        let Some((idx, live)) = ExAcker::message(&w, self.tag) else {
            return;
        };
        if let Some(k) = w.msgs[idx].key {
            if w.per_task_tx_check && w.refused.remove(&(task, k)) {
                w.violate(format!(
                    "t{task}: d{} (k{k}) handed back after the store refused it for good: it would loop",
                    self.tag
                ));
            }
        }
        w.tags.insert(self.tag, (idx, false));
        if !live {
            return;
        }
        let ms = delay.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        if kept {
            // The delivery is kept: the next one carries the same count.
            w.msgs[idx].deliveries = w.msgs[idx].deliveries.saturating_sub(1);
        } else if w.per_task_tx_check && w.outage.contains(&task) {
            w.msgs[idx].outage_nacks += 1;
        }
        if ms == 0 {
            w.make_ready(idx);
        } else {
            let due = w.now_ms.saturating_add(ms);
            w.msgs[idx].state = MsgState::Delayed(due);
        }
        w.trace.push(format!(
            "t{task}: {} d{} (delay {ms} ms)",
            if kept { "defer" } else { "nack" },
            self.tag
        ));
    }
}

impl Drop for ExAcker {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let mut w = lock(&self.world);
        if let Some((idx, live)) = ExAcker::message(&w, self.tag) {
            if live {
                w.tags.insert(self.tag, (idx, false));
                w.make_ready(idx);
                let task = w.current_task;
                w.trace.push(format!(
                    "t{task}: delivery d{} dropped unsettled → requeued",
                    self.tag
                ));
            }
        }
    }
}

#[async_trait]
impl Acker for ExAcker {
    async fn ack(mut self, proof: AckProof) -> Result<(), AckError> {
        let d = Point::new(&self.world, Op::Ack { tag: self.tag }).await;
        let mut w = lock(&self.world);
        let task = w.current_task;
        w.record(task, ("ack", d));
        self.settled = true;
        let k = key_index(proof.key());
        if !w.durable.committed.contains(&k) {
            w.violate(format!(
                "t{task}: d{} acked ({:?}) while k{k} is not committed",
                self.tag,
                proof.reason()
            ));
        }
        if w.per_task_tx_check && w.txs.values().any(|t| t.task == task) {
            w.violate(format!(
                "t{task}: d{} acked while its own transaction is still open",
                self.tag
            ));
        }
        let _ = AckReason::Committed;
        let Some((idx, live)) = ExAcker::message(&w, self.tag) else {
            return Ok(());
        };
        w.tags.insert(self.tag, (idx, false));
        if !live {
            w.trace.push(format!(
                "t{task}: ack d{} (stale receipt: no effect)",
                self.tag
            ));
            return Ok(());
        }
        if d == Decision::AckLost {
            w.make_ready(idx);
            w.trace.push(format!(
                "t{task}: ack d{} sent and lost → redelivered",
                self.tag
            ));
        } else {
            w.msgs[idx].state = MsgState::Acked;
            w.trace.push(format!("t{task}: ack d{}", self.tag));
        }
        Ok(())
    }

    async fn nack(mut self, delay: Option<Duration>) -> Result<(), AckError> {
        self.hand_back(delay, false);
        Ok(())
    }

    /// On a broker that counts runs, the delivery goes back without raising its count
    /// (what the NATS, SQS and RabbitMQ adapters do); otherwise a nack.
    async fn defer(mut self, delay: Duration) -> Result<(), AckError> {
        let kept = lock(&self.world).counts_runs;
        self.hand_back(Some(delay), kept);
        Ok(())
    }

    fn attempt_counts_runs(&self) -> bool {
        lock(&self.world).counts_runs
    }

    async fn dead_letter(
        mut self,
        _payload: &[u8],
        _headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let mut w = lock(&self.world);
        let task = w.current_task;
        self.settled = true;
        let Some((idx, live)) = ExAcker::message(&w, self.tag) else {
            return Ok(());
        };
        w.tags.insert(self.tag, (idx, false));
        if let Some(k) = w.msgs[idx].key {
            w.refused.remove(&(task, k));
            if live && reason.code == ATTEMPTS_EXHAUSTED && !w.poisoned.contains(&k) {
                w.check_exhausted(task, self.tag, idx, k);
            }
        }
        if live {
            w.msgs[idx].state = MsgState::Dead(reason.code);
            w.trace.push(format!(
                "t{task}: dead-letter d{} ({})",
                self.tag, reason.code
            ));
        }
        Ok(())
    }
}
