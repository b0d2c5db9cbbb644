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

use idem_engine::gate::ATTEMPTS_EXHAUSTED;
use idem_engine::{Clock, IdempotencyKey, StoreError};

mod delivery;
mod store;

pub(crate) use delivery::{ExAcker, ExHandler};
pub(crate) use store::{ExFilter, ExStore};

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
