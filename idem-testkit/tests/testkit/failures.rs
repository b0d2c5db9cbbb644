//! The failure table of docs/operations.md, row by row, on the in-memory store and the simulated
//! broker: what the gate does when the handler panics, the store is down, refuses a
//! message or is misconfigured, and when a message keeps failing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream;
use idem_engine::consumer::{self, ConsumerConfig, ConsumerStats};
use idem_engine::gate::{ATTEMPTS_EXHAUSTED, STORE_REJECTED};
use idem_engine::{
    async_trait, AckError, AckProof, Acker, Delivery, ErrorClass, Gate, GateConfig, Handler,
    HandlerError, Headers, OutcomeKind, RejectReason, StoreError, Submission,
};
use idem_testkit::{
    encode_submission, EffectHandler, EffectInput, MemoryStore, MemoryTx, SimAcker, SimBroker,
    TestStore,
};

/// Decides by the subject's prefix: `panic-` panics, `flaky-` fails transiently, `down-`
/// finds the store unreachable, `locked-` waits out a lock (the store degraded),
/// `refused-` is refused by the store for good, `missing-` meets a missing table, `hang-`
/// counts a run in `runs` and never returns (a message that kills its process: the test
/// drops the future, as the process's death would); anything else finds the store
/// unreachable while `down` is set, meets a serialization failure while `once` holds its
/// amount (once: it is cleared), and otherwise writes its effect.
#[derive(Clone, Default)]
struct Scripted {
    runs: Arc<std::sync::atomic::AtomicU32>,
    down: Arc<std::sync::atomic::AtomicBool>,
    once: Arc<std::sync::atomic::AtomicI64>,
}

#[async_trait]
impl Handler<MemoryTx> for Scripted {
    type Input = EffectInput;

    fn identify(
        &self,
        payload: &[u8],
        _: &Headers,
    ) -> Result<Submission<EffectInput>, RejectReason> {
        EffectHandler::parse(payload)
    }

    fn claim_meta(&self, sub: &Submission<EffectInput>) -> idem_engine::ClaimMeta {
        idem_engine::ClaimMeta::new(sub.subject.clone())
            .with_submission_timestamp(sub.input.timestamp.clone())
    }

    async fn handle(
        &self,
        tx: &mut MemoryTx,
        sub: &Submission<EffectInput>,
    ) -> Result<(), HandlerError> {
        use std::sync::atomic::Ordering::SeqCst;
        let s = sub.subject.as_str();
        if s.starts_with("hang-") {
            self.runs.fetch_add(1, SeqCst);
            return std::future::pending().await;
        }
        if s.starts_with("panic-") {
            panic!("handler bug on {s}");
        }
        if s.starts_with("flaky-") {
            return Err(HandlerError::Transient("a downstream hiccup".into()));
        }
        if s.starts_with("down-") || self.down.load(SeqCst) {
            return Err(HandlerError::Store(StoreError::Unavailable {
                message: "connection refused".into(),
                source: None,
            }));
        }
        if s.starts_with("locked-") {
            return Err(HandlerError::Store(StoreError::Degraded {
                message: "lock not available (SQLSTATE 55P03)".into(),
                source: None,
            }));
        }
        if sub.input.amount != 0
            && self
                .once
                .compare_exchange(sub.input.amount, 0, SeqCst, SeqCst)
                .is_ok()
        {
            return Err(HandlerError::Store(StoreError::Conflict {
                message: "could not serialize access (SQLSTATE 40001)".into(),
                source: None,
            }));
        }
        if s.starts_with("refused-") {
            return Err(HandlerError::Store(StoreError::Rejected {
                message: "value too long for the index".into(),
                source: None,
            }));
        }
        if s.starts_with("missing-") {
            return Err(HandlerError::Store(StoreError::Config(
                "relation \"disbursements\" does not exist".into(),
            )));
        }
        MemoryStore::write_effect(tx, &sub.key, &sub.subject, sub.input.amount).await?;
        Ok(())
    }
}

fn body(subject: &str) -> Vec<u8> {
    encode_submission(subject, "2026-07-01T09:00:00Z", 10)
}

/// Records the delay of every nack, then settles the simulated delivery.
struct Recording {
    inner: SimAcker,
    nacks: Arc<Mutex<Vec<Option<Duration>>>>,
}

#[async_trait]
impl Acker for Recording {
    async fn ack(self, proof: AckProof) -> Result<(), AckError> {
        self.inner.ack(proof).await
    }

    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.nacks.lock().unwrap().push(delay);
        self.inner.nack(delay).await
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        self.inner.dead_letter(payload, headers, reason).await
    }
}

fn recorded(
    d: Delivery<SimAcker>,
    nacks: &Arc<Mutex<Vec<Option<Duration>>>>,
) -> Delivery<Recording> {
    Delivery {
        payload: d.payload,
        headers: d.headers,
        attempt: d.attempt,
        acker: Recording {
            inner: d.acker,
            nacks: nacks.clone(),
        },
    }
}

/// The detail of the broker's one dead letter, which must be `attempts_exhausted`.
fn exhausted(broker: &SimBroker) -> String {
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].1.code, ATTEMPTS_EXHAUSTED);
    dead[0].1.detail.clone()
}

/// Runs the consumer loop, one delivery at a time, over what the broker has ready now
/// (what it nacks goes back to the broker, not into this run).
async fn consume_ready(
    gate: &Gate<MemoryStore, Scripted>,
    broker: &SimBroker,
) -> Result<ConsumerStats, idem_engine::Error> {
    let ready = broker.receive_many(usize::MAX);
    consumer::run(
        gate,
        stream::iter(ready.into_iter().map(Ok::<_, std::io::Error>)),
        ConsumerConfig::new(1, 1),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
}

/// Delivers until the broker has nothing ready, returning the outcome kinds in order.
async fn drain(gate: &Gate<MemoryStore, Scripted>, broker: &SimBroker) -> Vec<OutcomeKind> {
    let mut kinds = Vec::new();
    while let Some(d) = broker.receive() {
        kinds.push(gate.process(d).await.kind());
        assert!(kinds.len() < 1_000, "looped: {kinds:?}");
    }
    kinds
}

#[tokio::test]
async fn a_handler_panic_is_a_failed_attempt_and_the_consumer_goes_on() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    for s in ["ok-1", "panic-1", "ok-2"] {
        broker.publish(body(s));
    }
    let gate = Gate::new(store.clone(), Scripted::default());
    let stats = consume_ready(&gate, &broker)
        .await
        .expect("a panic does not end the consumer");
    assert_eq!((stats.processed, stats.failed), (2, 1), "{stats:?}");
    assert_eq!(store.effects().await.unwrap().len(), 2);
    assert_eq!(
        store.open_claims(),
        0,
        "the panicking transaction was rolled back"
    );
    assert_eq!(broker.ready_len(), 1, "the panicking delivery was nacked");
}

#[tokio::test]
async fn a_handler_that_always_panics_is_dead_lettered_after_max_attempts() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    broker.publish(body("panic-1"));
    let gate = Gate::with_config(
        store.clone(),
        Scripted::default(),
        GateConfig::default().with_max_attempts(3),
    );
    let kinds = drain(&gate, &broker).await;
    assert_eq!(
        kinds,
        vec![
            OutcomeKind::Failed,
            OutcomeKind::Failed,
            OutcomeKind::Rejected
        ]
    );
    let detail = exhausted(&broker);
    assert!(
        detail.contains("handler bug on panic-1"),
        "the reason carries the panic: {}",
        detail
    );
    assert!(broker.is_settled(), "never looped");
}

#[tokio::test]
async fn transient_failures_back_off_and_are_dead_lettered_when_attempts_run_out() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    broker.publish(body("flaky-1"));
    broker.publish(body("ok-1"));
    let gate = Gate::with_config(
        store.clone(),
        Scripted::default(),
        GateConfig::default().with_max_attempts(6),
    );
    let nacks = Arc::new(Mutex::new(Vec::new()));
    let mut kinds = Vec::new();
    while let Some(d) = broker.receive() {
        kinds.push(gate.process(recorded(d, &nacks)).await.kind());
        assert!(kinds.len() < 100, "looped: {kinds:?}");
    }
    let delays: Vec<Duration> = nacks
        .lock()
        .unwrap()
        .iter()
        .map(|d| d.expect("a delay"))
        .collect();
    assert_eq!(delays.len(), 5, "nacked on attempts 1..=5: {delays:?}");
    // The default policy: 200 ms doubling, jittered into [½, 1] of the full delay, so
    // each delay is at least the one before and within its bounds.
    for (i, d) in delays.iter().enumerate() {
        let full = Duration::from_millis(200 << i);
        assert!(*d >= full / 2 && *d <= full, "attempt {}: {d:?}", i + 1);
    }
    assert!(
        delays.windows(2).all(|w| w[0] <= w[1]),
        "growing: {delays:?}"
    );
    let detail = exhausted(&broker);
    assert!(detail.starts_with("6 attempts"), "{}", detail);
    assert_eq!(
        store.effects().await.unwrap().len(),
        1,
        "its neighbour went through"
    );
    assert!(broker.is_settled());
}

#[tokio::test]
async fn an_unreachable_store_is_never_dead_lettered() {
    let store = MemoryStore::new();
    // The store's own write fails too: the store is down for everyone.
    store.fail_probes(true);
    let broker = SimBroker::new(1);
    broker.publish(body("down-1"));
    let gate = Gate::with_config(
        store.clone(),
        Scripted::default(),
        GateConfig::default().with_max_attempts(2),
    );
    // Five deliveries, far past max_attempts: each is nacked, none dead-lettered.
    for _ in 0..5 {
        let o = gate.process(broker.receive().expect("redelivered")).await;
        assert_eq!(o.kind(), OutcomeKind::Failed);
    }
    assert!(
        broker.dead_letters().is_empty(),
        "a store outage is not the message's fault"
    );
    assert_eq!(broker.ready_len(), 1);
}

#[tokio::test]
async fn a_message_the_store_refuses_for_good_is_dead_lettered_at_once() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    broker.publish(body("refused-1"));
    broker.publish(body("ok-1"));
    let gate = Gate::new(store.clone(), Scripted::default());
    let kinds = drain(&gate, &broker).await;
    assert_eq!(kinds, vec![OutcomeKind::Rejected, OutcomeKind::Processed]);
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.code, STORE_REJECTED);
    assert_eq!(store.effects().await.unwrap().len(), 1);
    assert!(broker.is_settled());
}

#[tokio::test]
async fn a_configuration_error_stops_the_consumer_with_nothing_acked() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    for s in ["missing-1", "ok-1", "ok-2"] {
        broker.publish(body(s));
    }
    let gate = Gate::new(store.clone(), Scripted::default());
    let err = consume_ready(&gate, &broker)
        .await
        .expect_err("a missing table stops the consumer");
    assert_eq!(err.class(), ErrorClass::Config, "{err}");
    assert!(
        store.effects().await.unwrap().is_empty(),
        "nothing after the error ran"
    );
    assert!(broker.dead_letters().is_empty(), "nothing dead-lettered");
    assert_eq!(
        broker.ready_len(),
        3,
        "every delivery is back at the broker"
    );
}

/// Runs `gate` on the next delivery of `broker` (a process holding one delivery at a
/// time), as a process that dies after 50 ms: an unsettled future is dropped with its
/// delivery.
async fn run_or_die(gate: &Gate<MemoryStore, Scripted>, broker: &SimBroker) -> bool {
    let Some(d) = broker.receive() else {
        return true;
    };
    tokio::time::timeout(Duration::from_millis(50), gate.process(d))
        .await
        .is_ok()
}

#[tokio::test]
async fn a_message_that_kills_its_process_is_dead_lettered_unrun_past_max_attempts() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1).counting_runs();
    for s in ["ok-1", "hang-1", "ok-2"] {
        broker.publish(body(s));
    }
    let handler = Scripted::default();
    let gate = Gate::with_config(
        store.clone(),
        handler.clone(),
        GateConfig::default()
            .with_max_attempts(3)
            .with_check_attempts_before_handler(true),
    );
    let mut deaths = 0;
    while !broker.is_settled() {
        if !run_or_die(&gate, &broker).await {
            deaths += 1;
        }
        assert!(deaths < 20, "run for ever");
    }
    assert_eq!(
        handler.runs.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "run max_attempts times, then never again"
    );
    assert_eq!(deaths, 3);
    let detail = exhausted(&broker);
    assert!(detail.contains("not run again"), "{}", detail);
    assert_eq!(
        store.effects().await.unwrap().len(),
        2,
        "its neighbours went through"
    );
    assert_eq!(store.open_claims(), 0, "every dead run was rolled back");
}

/// In a batch, a rerun is processed alone, so its batch's neighbours are not held back by
/// it (and the check before the handler applies to it).
#[tokio::test]
async fn a_rerun_past_max_attempts_in_a_batch_is_dead_lettered_unrun_and_its_neighbours_go_on() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1).counting_runs();
    broker.publish(body("hang-1"));
    let handler = Scripted::default();
    let gate = Gate::with_config(
        store.clone(),
        handler.clone(),
        GateConfig::default()
            .with_max_attempts(2)
            .with_check_attempts_before_handler(true),
    );
    for _ in 0..2 {
        assert!(!run_or_die(&gate, &broker).await, "it kills its process");
    }
    for s in ["ok-1", "ok-2"] {
        broker.publish(body(s));
    }
    let batch = broker.receive_many(usize::MAX);
    assert_eq!(batch.len(), 3);
    let kinds: Vec<OutcomeKind> =
        tokio::time::timeout(Duration::from_secs(5), gate.process_batch(batch))
            .await
            .expect("the rerun past the limit was run again, and killed its batch")
            .iter()
            .map(|o| o.kind())
            .collect();
    assert_eq!(
        kinds,
        vec![
            OutcomeKind::Rejected,
            OutcomeKind::Processed,
            OutcomeKind::Processed
        ]
    );
    assert_eq!(handler.runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert!(broker.is_settled());
}

/// The broker counts a delivery for every message the dying process held; only the
/// runs the store recorded count: a neighbour that sat in the buffer beside a message
/// that kills its process is processed, however often the broker delivered it. With the
/// gate's defaults (the check on), and without it the killer runs for ever.
#[tokio::test]
async fn the_neighbours_held_by_a_dying_process_are_not_charged_its_runs() {
    for check in [true, false] {
        let store = MemoryStore::new();
        let broker = SimBroker::new(1).counting_runs();
        broker.publish(body("hang-1"));
        broker.publish(body("ok-1"));
        let handler = Scripted::default();
        let mut config = GateConfig::default().with_max_attempts(3);
        if !check {
            config = config.with_check_attempts_before_handler(false);
        }
        let gate = Gate::with_config(store.clone(), handler.clone(), config);
        let killer = body("hang-1");
        let mut deaths = 0;
        let mut neighbour_attempt = None;
        // Each process takes both messages, runs the killer first and dies holding the
        // other one.
        while !broker.is_settled() && deaths < 8 {
            let mut held = broker.receive_many(usize::MAX);
            let Some(i) = held.iter().position(|d| d.payload == killer) else {
                for d in held {
                    neighbour_attempt = d.attempt;
                    gate.process(d).await;
                }
                continue;
            };
            let first = held.remove(i);
            if tokio::time::timeout(Duration::from_millis(50), gate.process(first))
                .await
                .is_err()
            {
                deaths += 1;
                drop(held);
                continue;
            }
            for d in held {
                neighbour_attempt = d.attempt;
                gate.process(d).await;
            }
        }
        let runs = handler.runs.load(std::sync::atomic::Ordering::SeqCst);
        if !check {
            assert_eq!(deaths, 8, "without the check the killer runs on");
            assert_eq!(runs, 8);
            continue;
        }
        assert_eq!(deaths, 3, "the killer ran max_attempts times");
        assert_eq!(runs, 3);
        assert!(broker.is_settled());
        let detail = exhausted(&broker);
        assert!(detail.starts_with("ran 3 times"), "{}", detail);
        assert_eq!(
            store.effects().await.unwrap().len(),
            1,
            "the neighbour was processed"
        );
        assert!(
            neighbour_attempt.is_some_and(|n| n > 3),
            "the broker counted the neighbour past the limit: {neighbour_attempt:?}"
        );
    }
}

#[tokio::test]
async fn a_store_outage_costs_no_run_and_dead_letters_nothing() {
    use std::sync::atomic::Ordering::SeqCst;
    let store = MemoryStore::new();
    let broker = SimBroker::new(1).counting_runs();
    broker.publish(body("ok-1"));
    let handler = Scripted::default();
    handler.down.store(true, SeqCst);
    store.fail_probes(true);
    let gate = Gate::with_config(
        store.clone(),
        handler.clone(),
        GateConfig::default().with_max_attempts(2),
    );
    // Ten failures on the store, far past max_attempts: each is deferred.
    for _ in 0..10 {
        let d = broker.receive().expect("handed back");
        assert_eq!(d.attempt, Some(1), "an outage is no run");
        assert_eq!(gate.process(d).await.kind(), OutcomeKind::Failed);
    }
    assert_eq!(broker.stats().deferrals, 10);
    handler.down.store(false, SeqCst);
    store.fail_probes(false);
    let d = broker.receive().expect("handed back");
    assert_eq!(gate.process(d).await.kind(), OutcomeKind::Processed);
    assert!(broker.dead_letters().is_empty());
    assert!(broker.is_settled());
}

/// Whose fault a failure on the store's side is, by the store's evidence: a message that
/// fails alone while the store works (its probe commits, the others committed before) is
/// dead-lettered after its attempts, with its reason. Before, only another commit after
/// its first failure counted as evidence, so it was deferred for ever.
#[tokio::test]
async fn a_message_that_fails_alone_while_the_store_works_is_dead_lettered() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    for s in ["ok-1", "ok-2", "ok-3", "down-1"] {
        broker.publish(body(s));
    }
    let gate = Gate::with_config(
        store.clone(),
        Scripted::default(),
        GateConfig::default().with_max_attempts(3),
    );
    let kinds = drain(&gate, &broker).await;
    assert_eq!(
        kinds,
        [
            OutcomeKind::Processed,
            OutcomeKind::Processed,
            OutcomeKind::Processed,
            OutcomeKind::Failed,
            OutcomeKind::Failed,
            OutcomeKind::Rejected
        ]
    );
    let detail = exhausted(&broker);
    assert!(
        detail.starts_with("3 attempts failed on this message while the store worked")
            && detail.contains("connection refused"),
        "{}",
        detail
    );
    assert!(gate.store_proven().is_some(), "the probe committed");
    assert!(broker.is_settled());
}

/// Several messages failing on the store together, with nothing committing between their
/// failures, are a store failing for everyone even when its own probe commits (a slow
/// business table, a trigger): none is dead-lettered, and each is processed once the
/// store recovers.
#[tokio::test]
async fn messages_failing_together_on_the_store_are_never_dead_lettered() {
    use std::sync::atomic::Ordering::SeqCst;
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    for i in 0..5 {
        broker.publish(body(&format!("ok-{i}")));
    }
    let handler = Scripted::default();
    handler.down.store(true, SeqCst);
    let gate = Gate::with_config(
        store.clone(),
        handler.clone(),
        GateConfig::default().with_max_attempts(2),
    );
    for _ in 0..6 {
        for d in broker.receive_many(usize::MAX) {
            assert_eq!(gate.process(d).await.kind(), OutcomeKind::Failed);
        }
    }
    assert!(
        broker.dead_letters().is_empty(),
        "{:?}",
        broker.dead_letters()
    );
    handler.down.store(false, SeqCst);
    let kinds = drain(&gate, &broker).await;
    assert_eq!(kinds, [OutcomeKind::Processed; 5]);
    assert!(broker.is_settled());
}

/// A lock wait anywhere in the transaction, a read-only node, a full disk
/// (`StoreError::Degraded`) is the store's fault whatever the message: never counted, even
/// with one attempt allowed and the store's probe committing.
#[tokio::test]
async fn a_degraded_store_never_charges_the_message() {
    let store = MemoryStore::new();
    let broker = SimBroker::new(1).counting_runs();
    broker.publish(body("locked-1"));
    let gate = Gate::with_config(
        store.clone(),
        Scripted::default(),
        GateConfig::default().with_max_attempts(1),
    );
    for _ in 0..5 {
        let d = broker.receive().expect("handed back");
        assert_eq!(d.attempt, Some(1), "deferred, at no broker delivery");
        assert_eq!(gate.process(d).await.kind(), OutcomeKind::Failed);
    }
    assert!(broker.dead_letters().is_empty());
    assert_eq!(broker.stats().deferrals, 5);
}

/// Reruns (their first run's process died) through a store failing for everyone: the run
/// each records before its handler is taken back when the failure after the claim is the
/// store's, so none is dead-lettered as a message that kills its consumer. Before, every
/// message in flight during a restart in a slow store was dead-lettered unrun.
#[tokio::test]
async fn reruns_through_a_store_failing_for_everyone_are_deferred_not_dead_lettered() {
    use std::sync::atomic::Ordering::SeqCst;
    let store = MemoryStore::new();
    let broker = SimBroker::new(1).counting_runs();
    for i in 0..5 {
        broker.publish(body(&format!("ok-{i}")));
    }
    // The consumer that held them dies: each comes back as a rerun (attempt 2).
    drop(broker.receive_many(usize::MAX));
    let handler = Scripted::default();
    handler.down.store(true, SeqCst);
    store.fail_probes(true);
    let gate = Gate::with_config(
        store.clone(),
        handler.clone(),
        GateConfig::default()
            .with_max_attempts(3)
            .with_check_attempts_before_handler(true),
    );
    for _ in 0..6 {
        for d in broker.receive_many(usize::MAX) {
            assert_eq!(d.attempt, Some(2), "a rerun, deferred since");
            assert_eq!(gate.process(d).await.kind(), OutcomeKind::Failed);
        }
    }
    assert!(
        broker.dead_letters().is_empty(),
        "{:?}",
        broker.dead_letters()
    );
    handler.down.store(false, SeqCst);
    store.fail_probes(false);
    let kinds = drain(&gate, &broker).await;
    assert_eq!(kinds, [OutcomeKind::Processed; 5]);
    assert_eq!(store.effects().await.unwrap().len(), 5);
}

/// The first delivered wins through a failed first attempt: of two payloads of one
/// submission, the first fails once (a serialization failure), the second arrives
/// meanwhile and waits for it, so the first is paid and the second is the conflict.
/// Before, the second claimed the identity while the first waited for its redelivery.
#[tokio::test]
async fn the_first_delivered_payload_wins_when_its_first_attempt_fails() {
    use std::sync::atomic::Ordering::SeqCst;
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    let ts = "2026-07-01T09:00:00Z";
    broker.publish(encode_submission("A-1", ts, 100));
    broker.publish(encode_submission("A-1", ts, 9999));
    let handler = Scripted::default();
    handler.once.store(100, SeqCst);
    let gate = Gate::new(store.clone(), handler);
    let first = broker.receive().expect("100");
    let second = broker.receive().expect("9999");
    assert_eq!(gate.process(first).await.kind(), OutcomeKind::Failed);
    assert_eq!(
        gate.process(second).await.kind(),
        OutcomeKind::Deferred,
        "the later payload waits for the earlier one"
    );
    let kinds = drain(&gate, &broker).await;
    assert!(kinds.contains(&OutcomeKind::Conflict), "{kinds:?}");
    let effects = store.effects().await.unwrap();
    assert_eq!(effects.len(), 1);
    assert_eq!(
        effects[0].amount, 100,
        "the first delivered is the one paid"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].0.payload, encode_submission("A-1", ts, 9999));
    assert!(broker.is_settled());
}
