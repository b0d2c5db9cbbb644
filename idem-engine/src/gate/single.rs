//! One delivery at a time: identify, claim, run the handler, commit, settle.

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use tracing::Instrument as _;

use super::judge::overrun_reason;
use super::{
    conflict_reason, fenced, lock, panic_message, ConflictPolicy, Gate, Handler, HandlerPanic,
    Identified, Outcome, SpanTrace, Stage, Submission, ATTEMPT_MEMORY,
};
use crate::audit;
use crate::delivery::{commit, AckProof, Acker, Delivery};
use crate::error::{BoxError, Error, HandlerError, RejectReason};
use crate::key::IdempotencyKey;
use crate::mutant::{self, Mutant};
use crate::store::{ClaimOutcome, ClaimStore, ClaimTx, RunNote};
use crate::trace::{self, TraceParent};

impl<S, H> Gate<S, H>
where
    S: ClaimStore,
    H: Handler<S::Tx>,
{
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
    pub(super) fn held_back(&self, sub: &Submission<H::Input>) -> bool {
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
    pub(super) fn track(&self, sub: &Submission<H::Input>, settled: bool) {
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
    pub(super) fn handing_back(&self, key: &IdempotencyKey, delay: Duration) {
        let mut map = lock(&self.handed_back);
        if map.len() >= ATTEMPT_MEMORY {
            map.clear();
        }
        map.insert(*key, delay);
    }

    /// Defers a delivery held back for an earlier payload of its identity.
    pub(super) async fn hold<A: Acker>(
        &self,
        delivery: Delivery<A>,
        key: IdempotencyKey,
    ) -> Outcome {
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

    pub(super) async fn reject<A: Acker>(
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
    pub(super) async fn conflict<A: Acker>(
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

    /// Runs the handler, turning a panic into a failed attempt.
    pub(super) async fn guarded<F>(
        &self,
        stage_started: Instant,
        fut: F,
    ) -> Result<(), HandlerError>
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
    pub(super) async fn process_identified<A: Acker>(
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
                        early = Some(a.ack(duplicate_proof(key)).await);
                    }
                }
                let _ = tx.rollback().await;
                self.note(&key, reruns, RunNote::NotRun).await;
                self.forget_attempts(&key);
                audit::duplicate(&key, &sub.subject);
                let started = Instant::now();
                let settle = match (acker, early) {
                    (Some(a), _) => a.ack(duplicate_proof(key)).await,
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
                        // The mutant acks with a proof it has no right to: the claim
                        // answered `Claimed`, not `Duplicate`.
                        let settle = delivery.acker.ack(duplicate_proof(key)).await;
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
                        let committed = commit(tx).await;
                        self.timed(Stage::Commit, started);
                        match committed {
                            // The outcome of a failed commit may be unknown: never ack; the
                            // redelivery finds out through its claim.
                            Err(e) => {
                                self.fail(delivery, Some(key), subject, e.into(), reruns)
                                    .await
                            }
                            Ok(receipt) => {
                                self.forget_attempts(&key);
                                self.note(&key, reruns, RunNote::Settled).await;
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
}

/// The proof for a key whose claim answered `Duplicate`.
fn duplicate_proof(key: IdempotencyKey) -> AckProof {
    AckProof::duplicate(key, ClaimOutcome::Duplicate).expect("a duplicate claim proves the ack")
}
