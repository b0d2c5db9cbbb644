//! A delivery's handler and acker in the explorer's world.

use std::time::Duration;

use async_trait::async_trait;
use idem_engine::gate::ATTEMPTS_EXHAUSTED;
use idem_engine::{
    AckError, AckProof, AckReason, Acker, ClaimMeta, FilteredTx, Handler, HandlerError, Headers,
    RejectReason, Submission,
};

use super::store::{ExFilter, ExTx};
use super::{
    ident_of, is_recurring, key_index, key_of, lock, Decision, Fault, MsgState, Op, Point, Shared,
    World, TIMESTAMP,
};

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
