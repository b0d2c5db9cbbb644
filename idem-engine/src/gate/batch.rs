//! A batch in one transaction, and its fallbacks.

use std::collections::HashMap;
use std::time::Instant;

use super::{
    lock, own, unreachable_outcome, ConflictPolicy, Gate, Handler, Identified, Outcome, Positioned,
    SpanTrace, Stage, Submission,
};
use crate::audit;
use crate::delivery::{commit, AckProof, Acker, CommitReceipt, Delivery};
use crate::error::{Error, ErrorClass, StoreError};
use crate::key::IdempotencyKey;
use crate::mutant::{self, Mutant};
use crate::position::PositionMove;
use crate::store::{claim_order, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx};
use crate::trace::{self};

#[cfg(doc)]
use super::GateConfig;

impl<S, H> Gate<S, H>
where
    S: ClaimStore,
    H: Handler<S::Tx>,
{
    /// Processes a batch in one transaction: one round-trip claim of every key (where the
    /// store can, in key order so two batches never wait on each other's keys), the
    /// handler on each claimed submission, one commit, then acks for all (duplicates
    /// too). A key twice in one batch is one effect. Bad input is dead-lettered first. If
    /// the claim, the handler or the commit fails, the batch falls back to one-by-one
    /// processing so a poison message cannot hold back its neighbours (a configuration
    /// error, which no delivery can get past, nacks them all instead). Under
    /// [`GateConfig::check_attempts_before_handler`], a rerun on a count of runs
    /// ([`Acker::attempt_counts_runs`], attempt past 1) is processed alone, before the
    /// batch.
    ///
    /// Returns one outcome per delivery, in input order. Each delivery's outcome is
    /// logged in a `delivery` span with the fields of [`process`](Gate::process)'s
    /// (and `batch`, the batch's size); each outbox event gets its own delivery's trace.
    pub async fn process_batch<A: Acker>(&self, deliveries: Vec<Delivery<A>>) -> Vec<Outcome> {
        let identified = deliveries.into_iter().map(|d| self.identify(d)).collect();
        self.process_identified_batch(identified).await
    }

    /// [`process_batch`](Gate::process_batch) for deliveries already
    /// [identified](Gate::identify), in their arrival order.
    pub async fn process_identified_batch<A: Acker>(
        &self,
        deliveries: Vec<Identified<A, H::Input>>,
    ) -> Vec<Outcome> {
        let n = deliveries.len();
        let traces: Vec<Option<SpanTrace>> = deliveries
            .iter()
            .map(|d| SpanTrace::of(&d.delivery.headers))
            .collect();
        let mut outcomes: Vec<Option<Outcome>> = (0..n).map(|_| None).collect();
        let mut valid: Vec<Positioned<A, H::Input>> = Vec::with_capacity(n);
        for (i, d) in deliveries.into_iter().enumerate() {
            match d.submission {
                // A run that did not settle (its batch's process died) goes alone: a
                // message that kills its process costs its neighbours one run at most,
                // and is dead-lettered unrun once past the limit.
                Ok(sub) if self.rerun(&d.delivery) => {
                    outcomes[i] = Some(
                        self.process_identified(d.delivery, sub, own(&traces, i))
                            .await,
                    );
                }
                Ok(sub) => valid.push((i, d.delivery, sub)),
                Err(reason) => outcomes[i] = Some(self.reject(d.delivery, None, reason).await),
            }
        }
        if valid.len() == 1 {
            if let Some((i, d, sub)) = valid.pop() {
                outcomes[i] = Some(self.process_identified(d, sub, own(&traces, i)).await);
            }
        } else if !valid.is_empty() {
            self.batch_identified(valid, &mut outcomes, &traces).await;
        }
        outcomes
            .into_iter()
            .zip(traces)
            .map(|(o, t)| {
                let o = o.unwrap_or_else(unreachable_outcome);
                let span = tracing::info_span!(
                    target: "idem::gate",
                    "delivery",
                    key = o.key().map(IdempotencyKey::short).unwrap_or_default(),
                    outcome = o.kind().as_str(),
                    batch = n,
                    trace_id = tracing::field::Empty,
                    parent_id = tracing::field::Empty,
                    span_id = tracing::field::Empty
                );
                if let Some(t) = &t {
                    t.record(&span);
                }
                let _span = span.entered();
                tracing::debug!(target: "idem::gate", "delivery settled");
                self.observed(o)
            })
            .collect()
    }

    /// `traces`: each delivery's trace, by its position in the batch.
    async fn batch_identified<A: Acker>(
        &self,
        valid: Vec<Positioned<A, H::Input>>,
        outcomes: &mut [Option<Outcome>],
        traces: &[Option<SpanTrace>],
    ) {
        let mut valid = valid;
        if !lock(&self.unsettled).is_empty() {
            // A later payload of a submission whose earlier one has not settled waits.
            let mut kept = Vec::with_capacity(valid.len());
            for (i, d, sub) in valid {
                if self.held_back(&sub) {
                    outcomes[i] = Some(self.hold(d, sub.key).await);
                } else {
                    kept.push((i, d, sub));
                }
            }
            valid = kept;
            if valid.is_empty() {
                return;
            }
        }
        // The first position of each key claims it; later copies are in-batch duplicates.
        let mut first: HashMap<IdempotencyKey, usize> = HashMap::with_capacity(valid.len());
        let mut unique: Vec<usize> = Vec::with_capacity(valid.len());
        for (pos, (_, _, sub)) in valid.iter().enumerate() {
            first.entry(sub.key).or_insert_with(|| {
                unique.push(pos);
                pos
            });
        }
        let mut items: Vec<(IdempotencyKey, ClaimMeta)> = unique
            .iter()
            .map(|&p| (valid[p].2.key, self.handler.claim_meta(&valid[p].2)))
            .collect();
        // Claims take row locks in the order given: in `claim_order` (identity, then key),
        // two batches sharing keys or identities wait on each other in one direction only
        // and can never deadlock.
        if mutant::active(Mutant::KeyOrderBatchClaims) {
            let mut slots: Vec<(usize, (IdempotencyKey, ClaimMeta))> =
                unique.into_iter().zip(items).collect();
            slots.sort_by_key(|(_, (k, _))| *k);
            (unique, items) = slots.into_iter().unzip();
        } else if !mutant::active(Mutant::UnsortedBatchClaims) {
            let order = claim_order(&items);
            let mut slots: Vec<Option<(usize, (IdempotencyKey, ClaimMeta))>> =
                unique.into_iter().zip(items).map(Some).collect();
            (unique, items) = order.iter().filter_map(|&j| slots[j].take()).unzip();
        }

        let (claims, receipt) = match self.try_batch(&valid, &unique, &items, traces).await {
            Ok(done) => done,
            Err(BatchFailure::Config(e) | BatchFailure::Begin(e)) => {
                // Nothing was claimed: every delivery met the same failure (a configuration
                // error, which no delivery can get past, or a store that gave no
                // transaction), and each is settled by it at once — a key's copies in the
                // batch as one failure, not one per copy.
                for (pos, (i, d, sub)) in valid.into_iter().enumerate() {
                    let copy = first.get(&sub.key) != Some(&pos) && e.class() != ErrorClass::Config;
                    let err = Error::Store(if copy {
                        StoreError::Degraded {
                            message: format!(
                                "{e} (a copy of a delivery of this batch, counted once)"
                            ),
                            source: None,
                        }
                    } else {
                        again(&e)
                    });
                    let outcome = self
                        .fail(d, Some(sub.key), Some(&sub.subject), err, None)
                        .await;
                    self.track(&sub, false);
                    outcomes[i] = Some(outcome);
                }
                return;
            }
            Err(BatchFailure::OneByOne) => {
                // Each delivery gets its own transaction, so one poison key fails alone.
                for (i, d, sub) in valid {
                    outcomes[i] = Some(self.process_identified(d, sub, own(traces, i)).await);
                }
                return;
            }
        };
        let by_key: HashMap<IdempotencyKey, ClaimOutcome> = unique
            .iter()
            .zip(&claims)
            .map(|(&p, &c)| (valid[p].2.key, c))
            .collect();

        let mut to_ack: Vec<(usize, IdempotencyKey, bool, A)> = Vec::new();
        let mut to_defer: Vec<(usize, IdempotencyKey, A)> = Vec::new();
        let mut conflicts: Vec<(usize, Delivery<A>, IdempotencyKey, IdempotencyKey, String)> =
            Vec::new();
        for (pos, (i, d, sub)) in valid.into_iter().enumerate() {
            let is_first = first.get(&sub.key) == Some(&pos);
            let claim = by_key
                .get(&sub.key)
                .copied()
                .unwrap_or(ClaimOutcome::InProgress);
            self.track(&sub, claim != ClaimOutcome::InProgress);
            match claim {
                ClaimOutcome::Claimed if is_first => {
                    self.forget_attempts(&sub.key);
                    audit::processed(&sub.key, &sub.subject);
                    to_ack.push((i, sub.key, true, d.acker));
                }
                ClaimOutcome::Claimed | ClaimOutcome::Duplicate => {
                    self.forget_attempts(&sub.key);
                    audit::duplicate(&sub.key, &sub.subject);
                    to_ack.push((i, sub.key, false, d.acker));
                }
                ClaimOutcome::InProgress => to_defer.push((i, sub.key, d.acker)),
                // Nothing was claimed for it: the batch committed without it.
                ClaimOutcome::Conflict { existing } => {
                    self.forget_attempts(&sub.key);
                    conflicts.push((i, d, sub.key, existing, sub.subject));
                }
            }
        }
        let mut meta = Vec::with_capacity(to_ack.len());
        let mut items = Vec::with_capacity(to_ack.len());
        for (i, key, processed, acker) in to_ack {
            let proof = if processed {
                AckProof::committed(&receipt, key)
            } else {
                AckProof::duplicate_within(&receipt, key)
            };
            meta.push((i, key, processed));
            items.push((acker, proof));
        }
        let started = Instant::now();
        let results = A::ack_all(items).await;
        self.timed(Stage::Ack, started);
        for ((i, key, processed), settle) in meta.into_iter().zip(results) {
            outcomes[i] = Some(if processed {
                Outcome::Processed { key, settle }
            } else {
                Outcome::Duplicate { key, settle }
            });
        }
        for (i, key, acker) in to_defer {
            let settle = acker.defer(self.config.defer_delay).await;
            outcomes[i] = Some(Outcome::Deferred { key, settle });
        }
        for (i, d, key, existing, subject) in conflicts {
            outcomes[i] = Some(self.conflict(d, key, existing, &subject).await);
        }
    }

    /// Under [`ConflictPolicy::Process`], claims the batch's conflicting keys again
    /// without their identity (in the same transaction); otherwise returns `claims` as
    /// they are.
    async fn reclaim_conflicts<A: Acker>(
        &self,
        tx: &mut S::Tx,
        valid: &[Positioned<A, H::Input>],
        unique: &[usize],
        items: &[(IdempotencyKey, ClaimMeta)],
        mut claims: Vec<ClaimOutcome>,
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        if self.config.on_conflict != ConflictPolicy::Process {
            return Ok(claims);
        }
        let mut positions = Vec::new();
        let mut again = Vec::new();
        for (pos, c) in claims.iter().enumerate() {
            if let ClaimOutcome::Conflict { existing } = c {
                let subject = valid[unique[pos]].2.subject.as_str();
                audit::conflict(&items[pos].0, existing, subject, ConflictPolicy::Process);
                positions.push(pos);
                again.push((items[pos].0, items[pos].1.clone().without_identity()));
            }
        }
        if again.is_empty() {
            return Ok(claims);
        }
        let redone = tx.claim_batch(&again).await?;
        if redone.len() != again.len() {
            return Err(StoreError::other(
                "claim_batch returned a different number of outcomes",
                true,
            ));
        }
        for (pos, c) in positions.into_iter().zip(redone) {
            claims[pos] = c;
        }
        Ok(claims)
    }

    async fn try_batch<A: Acker>(
        &self,
        valid: &[Positioned<A, H::Input>],
        unique: &[usize],
        items: &[(IdempotencyKey, ClaimMeta)],
        traces: &[Option<SpanTrace>],
    ) -> Result<(Vec<ClaimOutcome>, CommitReceipt), BatchFailure> {
        let started = Instant::now();
        let mut tx = self.store.begin().await.map_err(BatchFailure::begin)?;
        let claims = match tx.claim_batch(items).await {
            Ok(c) if c.len() == items.len() => {
                let c = match self
                    .reclaim_conflicts(&mut tx, valid, unique, items, c)
                    .await
                {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = tx.rollback().await;
                        return Err(BatchFailure::from_store(e));
                    }
                };
                self.timed(Stage::Claim, started);
                c
            }
            Ok(_) => {
                let _ = tx.rollback().await;
                tracing::warn!(target: "idem::gate", "claim_batch returned a different number of outcomes; falling back to one by one");
                return Err(BatchFailure::OneByOne);
            }
            Err(e) => {
                let _ = tx.rollback().await;
                tracing::debug!(target: "idem::gate", error = %e, "batch claim failed; falling back to one by one");
                return Err(BatchFailure::from_store(e));
            }
        };
        let claimed: Vec<&Submission<H::Input>> = unique
            .iter()
            .zip(&claims)
            .filter(|(_, c)| **c == ClaimOutcome::Claimed)
            .map(|(&p, _)| &valid[p].2)
            .collect();
        if !claimed.is_empty() {
            // Each claimed submission's events get its own delivery's trace.
            let scope = trace::batch(
                unique
                    .iter()
                    .zip(&claims)
                    .filter(|(_, c)| **c == ClaimOutcome::Claimed)
                    .filter_map(|(&p, _)| own(traces, valid[p].0).map(|t| (valid[p].2.key, t))),
            );
            let handled = self
                .guarded(
                    Instant::now(),
                    trace::scoped(scope, self.handler.handle_batch(&mut tx, &claimed)),
                )
                .await;
            if let Err(e) = handled {
                tracing::debug!(target: "idem::gate", error = %e, "handler failed in a batch; falling back to one by one");
                let _ = tx.rollback().await;
                return Err(BatchFailure::OneByOne);
            }
        }
        // Where the settled deliveries stand in their logs, recorded with them.
        let moves: Vec<PositionMove> = unique
            .iter()
            .zip(&claims)
            .filter(|(_, c)| matches!(c, ClaimOutcome::Claimed | ClaimOutcome::Duplicate))
            .filter_map(|(&p, _)| valid[p].1.acker.position())
            .collect();
        if !moves.is_empty() {
            if let Err(e) = tx.advance_positions(&moves).await {
                // Fenced: one by one, each delivery of a partition taken since is fenced
                // alone, and the others commit.
                tracing::debug!(target: "idem::gate", error = %e, "recording the batch's log positions failed; falling back to one by one");
                let _ = tx.rollback().await;
                return Err(BatchFailure::from_store(e));
            }
        }
        let started = Instant::now();
        let committed = commit(tx).await;
        self.timed(Stage::Commit, started);
        match committed {
            Ok(receipt) => Ok((claims, receipt)),
            // The outcome of a failed commit is unknown; one by one, each delivery finds
            // out through its own claim (a committed one is then a duplicate).
            Err(e) => {
                tracing::debug!(target: "idem::gate", error = %e, "batch commit failed; falling back to one by one");
                Err(BatchFailure::OneByOne)
            }
        }
    }
}

enum BatchFailure {
    /// The store is misconfigured: every delivery is handed back.
    Config(StoreError),
    /// No transaction could be begun: every delivery failed on the store at once (one by
    /// one, each would wait on the store again: a batch of 100 would wait 100 times).
    Begin(StoreError),
    /// Anything else: retry each delivery in its own transaction.
    OneByOne,
}

/// `e` again, for each delivery of a batch that met it: the same variant and message,
/// without the driver's source (which cannot be cloned).
fn again(e: &StoreError) -> StoreError {
    let message = e.to_string();
    match e {
        StoreError::Unavailable { .. } => StoreError::Unavailable {
            message,
            source: None,
        },
        StoreError::Degraded { .. } => StoreError::Degraded {
            message,
            source: None,
        },
        StoreError::Conflict { .. } => StoreError::Conflict {
            message,
            source: None,
        },
        StoreError::Rejected { .. } => StoreError::Rejected {
            message,
            source: None,
        },
        StoreError::Config(_) => StoreError::Config(message),
        other => StoreError::other(message, other.is_retryable()),
    }
}

impl BatchFailure {
    fn begin(e: StoreError) -> Self {
        if e.class() == ErrorClass::Config {
            Self::Config(e)
        } else {
            Self::Begin(e)
        }
    }

    fn from_store(e: StoreError) -> Self {
        if e.class() == ErrorClass::Config {
            Self::Config(e)
        } else {
            Self::OneByOne
        }
    }
}
