//! The record of reruns.

use idem_engine::ClaimTx;
use idem_engine::{
    ClaimMeta, ClaimOutcome, Gate, GateConfig, IdempotencyKey, Outcome, OutcomeKind, RunNote,
};

use super::conflicts::CONFLICT_TS;
use super::key;
use crate::broker::SimBroker;
use crate::harness::{encode_submission, EffectHandlerFor, TestStore};

/// The record of reruns ([`ClaimStore::note_run`](idem_engine::ClaimStore::note_run)):
/// each `Started` adds one and answers the count, `NotRun` takes one back (never below
/// zero), `Settled` forgets the key; keys are counted apart. Through the gate, on a
/// broker that counts runs: a rerun whose recorded runs reach `max_attempts` claims its
/// key and is dead-lettered unrun, and its record stays (a copy in flight elsewhere is
/// dead-lettered unrun too); a rerun below the limit runs and commits. A store that keeps
/// no record answers `None` and skips this check, saying so.
pub async fn reruns_are_recorded<S: TestStore>(store: S) {
    let k = key("reruns-one");
    let note = |n| {
        let store = store.clone();
        async move { store.note_run(&k, n).await.expect("note_run") }
    };
    let Some(first) = note(RunNote::Started).await else {
        eprintln!("reruns_are_recorded: skipped, the store keeps no record of reruns");
        return;
    };
    assert_eq!(first, 1, "a first rerun counts one");
    assert_eq!(note(RunNote::Started).await, Some(2), "each rerun adds one");
    assert_eq!(
        note(RunNote::NotRun).await,
        Some(1),
        "a rerun that did not run is taken back"
    );
    let other = key("reruns-other");
    assert_eq!(
        store
            .note_run(&other, RunNote::NotRun)
            .await
            .expect("note_run"),
        Some(0),
        "never below zero, and keys are counted apart"
    );
    assert_eq!(note(RunNote::Settled).await, Some(0));
    assert_eq!(
        note(RunNote::Started).await,
        Some(1),
        "a settled key starts over"
    );

    // Through the gate: "killer" has run twice (its first run, and one recorded rerun),
    // "ok" once; each process that held them died.
    let broker = SimBroker::new(1).counting_runs();
    let killer = encode_submission("reruns-killer", CONFLICT_TS, 1);
    broker.publish(killer.clone());
    broker.publish(encode_submission("reruns-ok", CONFLICT_TS, 2));
    drop(broker.receive_many(usize::MAX));
    let killer_key =
        IdempotencyKey::derive("reruns-killer", CONFLICT_TS, &killer).expect("valid identity");
    store
        .note_run(&killer_key, RunNote::Started)
        .await
        .expect("note_run");
    drop(broker.receive_many(usize::MAX));
    let gate = Gate::with_config(
        store.clone(),
        EffectHandlerFor::<S>::new(),
        GateConfig::default().with_max_attempts(2),
    );
    let outcomes = gate.process_batch(broker.receive_many(usize::MAX)).await;
    let kinds: Vec<OutcomeKind> = outcomes.iter().map(Outcome::kind).collect();
    assert_eq!(
        kinds,
        vec![OutcomeKind::Rejected, OutcomeKind::Processed],
        "the killer's third run would pass max_attempts 2: dead-lettered unrun; the other \
         message's first recorded run goes on"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].1.code, idem_engine::gate::ATTEMPTS_EXHAUSTED);
    assert!(broker.is_settled());
    assert_eq!(
        store
            .note_run(&killer_key, RunNote::Started)
            .await
            .expect("note_run"),
        Some(3),
        "the dead-lettered key's record stays: a copy still in flight is dead-lettered too"
    );
}

/// A rerun of a message its dead process had committed (not acked) is a duplicate, acked
/// at once: the run recorded for it is taken back after its transaction is over, not
/// while the transaction still holds the store (on SQLite, one writer: the take-back
/// waited on its own transaction's lock for the whole busy timeout, 30 s, and a consumer
/// restarted after a kill stalled on every such message).
pub async fn a_rerun_of_a_committed_message_is_a_duplicate_at_once<S: TestStore>(store: S) {
    let broker = SimBroker::new(1).counting_runs();
    let body = encode_submission("rerun-committed", CONFLICT_TS, 1);
    broker.publish(body.clone());
    // The first process committed the claim and died before its ack.
    let key =
        IdempotencyKey::derive("rerun-committed", CONFLICT_TS, &body).expect("valid identity");
    let mut tx = store.begin().await.expect("begin");
    let meta = ClaimMeta::new("rerun-committed").with_submission_timestamp(CONFLICT_TS);
    assert_eq!(
        tx.claim(&key, &meta).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");
    drop(broker.receive_many(usize::MAX));
    let gate = Gate::new(store.clone(), EffectHandlerFor::<S>::new());
    let rerun = broker.receive().expect("redelivered");
    assert!(rerun.attempt.unwrap_or(1) > 1, "a rerun");
    let started = std::time::Instant::now();
    let outcome = tokio::time::timeout(std::time::Duration::from_secs(60), gate.process(rerun))
        .await
        .expect("the rerun settles");
    assert_eq!(outcome.kind(), OutcomeKind::Duplicate, "{outcome:?}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "a duplicate rerun waited {:?}",
        started.elapsed()
    );
    assert!(broker.is_settled());
}

/// A message is charged its own runs, not its deliveries: one whose handler fails (a
/// transient error) and whose deliveries were also lost with processes that died of
/// other messages (a Redis Streams consumer that claimed it among a dead consumer's
/// entries, a NATS or SQS prefetch) runs `max_attempts` times before it is dead-lettered
/// `attempts_exhausted`, whatever the broker's count says: a delivery that never ran is
/// not an attempt. A store that keeps no record of reruns counts by the broker and
/// skips this check, saying so.
pub async fn a_failure_is_counted_by_its_runs_not_its_deliveries<S: TestStore>(store: S) {
    if store
        .note_run(&key("runs-probe"), RunNote::Settled)
        .await
        .expect("note_run")
        .is_none()
    {
        eprintln!(
            "a_failure_is_counted_by_its_runs_not_its_deliveries: skipped, the store keeps \
             no record of reruns"
        );
        return;
    }
    let broker = SimBroker::new(1).counting_runs();
    broker.publish(encode_submission("flaky", CONFLICT_TS, 1));
    let gate = Gate::with_config(
        store.clone(),
        crate::FailingEffects::<S>::new("flaky", u32::MAX),
        GateConfig::default().with_max_attempts(3),
    );
    let first = gate.process(broker.receive().expect("delivered")).await;
    assert_eq!(first.kind(), OutcomeKind::Failed, "{first:?}");
    // Two processes died of other messages while this one sat in their buffers.
    drop(broker.receive().expect("redelivered"));
    drop(broker.receive().expect("redelivered"));
    let mut kinds = Vec::new();
    while let Some(delivery) = broker.receive() {
        assert!(kinds.len() < 10, "looped: {kinds:?}");
        kinds.push(gate.process(delivery).await.kind());
    }
    let runs = gate.handler().failures();
    assert_eq!(
        (runs, kinds.last()),
        (3, Some(&OutcomeKind::Rejected)),
        "the handler runs max_attempts (3) times before its message is dead-lettered; the \
         two deliveries lost unrun are not attempts (outcomes after the first: {kinds:?})"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].1.code, idem_engine::gate::ATTEMPTS_EXHAUSTED);
    assert!(
        dead[0].1.detail.starts_with("3 attempts"),
        "the reason counts its runs: {}",
        dead[0].1.detail
    );
    assert!(broker.is_settled());
}
