//! The explorer's store and front filter: [`ExStore`], its transaction [`ExTx`], and
//! [`ExFilter`].

use async_trait::async_trait;
use idem_engine::{
    Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, DoneFilter, IdempotencyKey,
    OutboxEvent, OutboxWriter, StoreError,
};

use super::{
    ident_of, key_index, key_of, lock, Decision, Fault, MsgState, Op, OpenTx, Point, Shared,
};

/// The explorer's transactional store (Postgres's claim semantics).
#[derive(Debug, Clone)]
pub(crate) struct ExStore(pub(crate) Shared);

/// A transaction of [`ExStore`].
#[derive(Debug)]
pub(crate) struct ExTx {
    world: Shared,
    pub(super) id: u64,
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
        note: idem_engine::RunNote,
    ) -> Result<Option<u32>, StoreError> {
        let k = key_index(key);
        let mut w = lock(&self.0);
        let task = w.current_task;
        let n = match note {
            idem_engine::RunNote::Started => {
                let n = w.durable.runs.entry(k).or_insert(0);
                *n += 1;
                *n
            }
            idem_engine::RunNote::NotRun => {
                let n = w.durable.runs.entry(k).or_insert(0);
                *n = n.saturating_sub(1);
                *n
            }
            idem_engine::RunNote::Settled => {
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
