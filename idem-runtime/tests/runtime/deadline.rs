//! A handler that never returns: with a [`Deadline`] its attempts fail and it is
//! dead-lettered after `max_attempts`, while its neighbours are processed; without one
//! the delivery is never settled.

use std::time::Duration;

use async_trait::async_trait;
use idem_engine::{
    ClaimMeta, Gate, GateConfig, Handler, HandlerError, Headers, RejectReason, Submission,
};
use idem_runtime::Deadline;
use idem_testkit::{encode_submission, EffectHandlerFor, EffectInput, MemoryStore, SimBroker};

/// The testkit's handler, except that a submission whose subject starts with `HANG`
/// never returns.
#[derive(Debug, Clone, Default)]
struct Hangs(EffectHandlerFor<MemoryStore>);

#[async_trait]
impl Handler<<MemoryStore as idem_engine::ClaimStore>::Tx> for Hangs {
    type Input = EffectInput;

    fn identify(
        &self,
        payload: &[u8],
        headers: &Headers,
    ) -> Result<Submission<EffectInput>, RejectReason> {
        self.0.identify(payload, headers)
    }

    fn claim_meta(&self, sub: &Submission<EffectInput>) -> ClaimMeta {
        self.0.claim_meta(sub)
    }

    async fn handle(
        &self,
        tx: &mut <MemoryStore as idem_engine::ClaimStore>::Tx,
        sub: &Submission<EffectInput>,
    ) -> Result<(), HandlerError> {
        if sub.subject.starts_with("HANG") {
            std::future::pending::<()>().await;
        }
        self.0.handle(tx, sub).await
    }
}

fn publish(broker: &SimBroker) {
    let ts = "2026-07-01T09:00:00Z";
    broker.publish(encode_submission("HANG-1", ts, 1));
    for i in 0..3 {
        broker.publish(encode_submission(&format!("OK-{i}"), ts, i));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_past_its_deadline_fails_the_attempt_and_is_dead_lettered_after_max_attempts() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(9);
    publish(&broker);
    let gate = Gate::with_config(
        store.clone(),
        Deadline::new(Hangs::default(), Duration::from_millis(100)),
        GateConfig::default().with_max_attempts(3),
    );
    for _ in 0..10 {
        if broker.is_settled() {
            break;
        }
        for d in broker.receive_many(100) {
            gate.process(d).await;
        }
    }
    assert!(
        broker.is_settled(),
        "the hanging delivery was never settled"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.code, idem_engine::gate::ATTEMPTS_EXHAUSTED);
    assert!(
        dead[0].1.detail.contains("deadline"),
        "the reason names the deadline: {}",
        dead[0].1
    );
    use idem_testkit::TestStore as _;
    assert_eq!(store.effects().await.expect("effects").len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_deadline_a_hanging_handler_holds_its_delivery() {
    let broker = SimBroker::new(9);
    publish(&broker);
    let gate = Gate::with_config(MemoryStore::new(), Hangs::default(), GateConfig::default());
    let d = broker.receive().expect("the hanging delivery comes first");
    let waited = tokio::time::timeout(Duration::from_millis(300), gate.process(d)).await;
    assert!(
        waited.is_err(),
        "a handler that never returns holds its delivery"
    );
}
