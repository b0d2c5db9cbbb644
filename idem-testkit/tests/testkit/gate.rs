//! The gate's state machine, outcome by outcome, on the in-memory store.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_engine::{
    async_trait, ClaimMeta, ClaimStore, ClaimTx, Gate, GateObserver, Handler, HandlerError,
    Headers, Outcome, OutcomeKind, RejectReason, Stage, Submission,
};
use idem_testkit::{
    encode_submission, EffectHandler, EffectHandlerFor, EffectInput, MemoryStore, MemoryTx,
    SimBroker, TestStore,
};

/// Fails (transiently) for subjects starting with `flaky`, rejects subjects starting with
/// `bad`, writes the effect otherwise.
struct Picky;

#[async_trait]
impl Handler<MemoryTx> for Picky {
    type Input = EffectInput;

    fn identify(
        &self,
        payload: &[u8],
        _: &Headers,
    ) -> Result<Submission<EffectInput>, RejectReason> {
        EffectHandler::parse(payload)
    }

    async fn handle(
        &self,
        tx: &mut MemoryTx,
        sub: &Submission<EffectInput>,
    ) -> Result<(), HandlerError> {
        if sub.subject.starts_with("flaky") {
            return Err(HandlerError::Transient("database hiccup".into()));
        }
        if sub.subject.starts_with("bad") {
            return Err(HandlerError::Reject(RejectReason::new(
                "business_rule",
                "award closed",
            )));
        }
        MemoryStore::write_effect(tx, &sub.key, &sub.subject, sub.input.amount).await?;
        Ok(())
    }
}

fn body(subject: &str) -> Vec<u8> {
    encode_submission(subject, "2026-07-01T09:00:00Z", 10)
}

#[tokio::test]
async fn a_transient_handler_error_rolls_back_and_nacks() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    broker.publish(body("flaky-1"));
    let gate = Gate::new(store.clone(), Picky);
    let o = gate.process(broker.receive().unwrap()).await;
    assert_eq!(o.kind(), OutcomeKind::Failed);
    assert_eq!(store.claim_count(), 0, "the claim was rolled back");
    assert!(store.effects().await.unwrap().is_empty());
    assert_eq!(broker.ready_len(), 1, "nacked for redelivery");
}

#[tokio::test]
async fn a_handler_rejection_dead_letters_with_the_reason() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    broker.publish(body("bad-1"));
    let gate = Gate::new(store.clone(), Picky);
    let o = gate.process(broker.receive().unwrap()).await;
    assert_eq!(o.kind(), OutcomeKind::Rejected);
    assert_eq!(store.claim_count(), 0);
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.code, "business_rule");
    assert!(broker.is_settled(), "never looped");
}

#[tokio::test]
async fn a_key_held_past_the_lock_timeout_is_deferred_not_acked() {
    let store = MemoryStore::new().with_lock_timeout(Duration::from_millis(50));
    let broker = SimBroker::new(1);
    let b = body("held");
    broker.publish(b.clone());
    let key = EffectHandler::parse(&b).unwrap().key;
    let mut holder = store.begin().await.unwrap();
    holder.claim(&key, &ClaimMeta::new("held")).await.unwrap();
    let gate = Gate::new(store.clone(), EffectHandlerFor::<MemoryStore>::new());
    let o = gate.process(broker.receive().unwrap()).await;
    assert_eq!(o.kind(), OutcomeKind::Deferred);
    assert_eq!(broker.ready_len(), 1, "nacked with a delay, not acked");
    holder.rollback().await.unwrap();
    let o = gate.process(broker.receive().unwrap()).await;
    assert_eq!(o.kind(), OutcomeKind::Processed);
}

#[tokio::test]
async fn a_poison_message_in_a_batch_does_not_block_its_neighbours() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    for s in ["ok-1", "flaky-1", "ok-2", "bad-1", "ok-3"] {
        broker.publish(body(s));
    }
    let gate = Gate::new(store.clone(), Picky);
    let outcomes = gate.process_batch(broker.receive_many(10)).await;
    let kinds: Vec<_> = outcomes.iter().map(Outcome::kind).collect();
    assert_eq!(
        kinds,
        vec![
            OutcomeKind::Processed,
            OutcomeKind::Failed,
            OutcomeKind::Processed,
            OutcomeKind::Rejected,
            OutcomeKind::Processed
        ]
    );
    assert_eq!(store.effects().await.unwrap().len(), 3);
}

#[derive(Default)]
struct Counting {
    stages: [AtomicU64; 4],
    outcomes: AtomicU64,
}

impl GateObserver for Counting {
    fn stage(&self, stage: Stage, _elapsed: Duration) {
        let i = match stage {
            Stage::Claim => 0,
            Stage::Handler => 1,
            Stage::Commit => 2,
            Stage::Ack => 3,
        };
        self.stages[i].fetch_add(1, Ordering::Relaxed);
    }

    fn outcome(&self, _o: &Outcome) {
        self.outcomes.fetch_add(1, Ordering::Relaxed);
    }
}

#[tokio::test]
async fn the_observer_sees_every_stage_and_outcome() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    broker.publish(body("one"));
    broker.publish(body("one"));
    let seen = Arc::new(Counting::default());
    let gate = Gate::new(store, EffectHandlerFor::<MemoryStore>::new()).with_observer(seen.clone());
    while let Some(d) = broker.receive() {
        gate.process(d).await;
    }
    let n = |i: usize| seen.stages[i].load(Ordering::Relaxed);
    assert_eq!(
        (n(0), n(1), n(2), n(3)),
        (2, 1, 1, 2),
        "claim×2, handler×1, commit×1, ack×2"
    );
    assert_eq!(seen.outcomes.load(Ordering::Relaxed), 2);
}
