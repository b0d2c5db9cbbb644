//! Claims: duplicates, concurrency, rollbacks, batches.

use std::time::Duration;

use idem_engine::ClaimTx;
use idem_engine::{ClaimOutcome, Delivery, Gate, IdempotencyKey, OutcomeKind};

use super::{key, meta};
use crate::broker::SimBroker;
use crate::harness::{encode_submission, EffectHandlerFor, TestStore};

/// The key is a pure function of identity and payload.
pub async fn key_is_deterministic<S: TestStore>(_store: S) {
    let a = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{\"x\":1}");
    let b = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{\"x\":1}");
    assert_eq!(a, b, "derivation must be deterministic");
    let c = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{\"x\":2}");
    assert_ne!(a, c, "a different payload must give a different key");
}

/// A second claim of a committed key returns `Duplicate` and adds no row.
pub async fn second_claim_is_duplicate<S: TestStore>(store: S) {
    let k = key("second-claim");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &meta("s")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &meta("s"))
            .await
            .expect("second claim must not error"),
        ClaimOutcome::Duplicate,
        "claiming a committed key must return Duplicate"
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(
        store.claim_count(&k).await.expect("count"),
        1,
        "a duplicate claim added a row"
    );
}

/// Claiming one key twice in one transaction returns `Duplicate` the second time.
pub async fn same_key_twice_in_one_tx<S: TestStore>(store: S) {
    let k = key("twice-in-tx");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &meta("t")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    assert_eq!(
        tx.claim(&k, &meta("t")).await.expect("claim"),
        ClaimOutcome::Duplicate
    );
    tx.commit().await.expect("commit");
    assert_eq!(store.claim_count(&k).await.expect("count"), 1);
}

/// Replaying a committed submission through the gate returns `Duplicate`, and the
/// business row count stays one.
pub async fn replay_is_duplicate_and_effect_stays_one<S: TestStore>(store: S) {
    let broker = SimBroker::new(1);
    let body = encode_submission("replay", "2026-07-01T09:00:00Z", 125_000);
    let gate = Gate::new(store.clone(), EffectHandlerFor::<S>::new());
    broker.publish(body.clone());
    broker.publish(body);
    let mut kinds = Vec::new();
    while let Some(d) = broker.receive() {
        kinds.push(gate.process(d).await.kind());
    }
    assert_eq!(kinds, vec![OutcomeKind::Processed, OutcomeKind::Duplicate]);
    let effects = store.effects().await.expect("effects");
    if store.capabilities().transactional_writes {
        assert_eq!(effects.len(), 1, "replay must not add a business row");
    }
    assert!(broker.is_settled(), "every delivery must be settled");
}

/// A forced failure of the outbox insert rolls back the business row and the claim.
pub async fn failed_outbox_insert_leaves_nothing<S: TestStore>(store: S) {
    if !store.capabilities().transactional_writes {
        eprintln!("skipped for this store: business writes are not in the claim's transaction");
        return;
    }
    let broker = SimBroker::new(2);
    let body = format!("{}|refuse-outbox", "outbox-fails|2026-07-01T09:00:00Z|10").into_bytes();
    let k = crate::harness::EffectHandler::parse(&body)
        .expect("valid")
        .key;
    broker.publish(body);
    let gate = Gate::new(store.clone(), EffectHandlerFor::<S>::new());
    let d = broker.receive().expect("a delivery");
    let outcome = gate.process(d).await;
    // The store refuses the insert for good (a permanent error): the delivery is
    // dead-lettered with the reason instead of nacked into a loop.
    assert_eq!(
        outcome.kind(),
        OutcomeKind::Rejected,
        "a refused outbox insert must dead-letter the delivery"
    );
    assert!(
        store.effects().await.expect("effects").is_empty(),
        "the business row survived a failed outbox insert"
    );
    assert_eq!(
        store.claim_count(&k).await.expect("count"),
        0,
        "the claim survived a failed outbox insert"
    );
    assert_eq!(broker.ready_len(), 0, "a refused delivery must not loop");
    assert_eq!(
        broker.dead_letters().len(),
        1,
        "the refused delivery must be dead-lettered"
    );
}

/// Two concurrent claims of one key: exactly one `Claimed`; the other waits and sees
/// `Duplicate` once the first commits (or answers `InProgress` on a lease store).
pub async fn concurrent_claims_one_winner<S: TestStore>(store: S) {
    let k = key("concurrent");
    let mut t1 = store.begin().await.expect("begin");
    assert_eq!(
        t1.claim(&k, &meta("c")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    let s2 = store.clone();
    let second = tokio::spawn(async move {
        let mut t2 = s2.begin().await.expect("begin");
        let out = t2.claim(&k, &meta("c")).await.expect("claim");
        let _ = t2.rollback().await;
        out
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let answered_before_commit = second.is_finished();
    t1.commit().await.expect("commit");
    let out = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the second claim must finish once the first commits")
        .expect("task");
    match out {
        // `Duplicate` is only true once the first claim committed: answered earlier, it
        // would skip a key whose first claim could still roll back. So it must have waited.
        ClaimOutcome::Duplicate => assert!(
            !answered_before_commit,
            "the second claim said Duplicate before the first committed: it did not wait"
        ),
        // A lease store answers at once that the key is held.
        ClaimOutcome::InProgress => {}
        other => panic!("the second concurrent claim got {other:?}"),
    }
    assert_eq!(store.claim_count(&k).await.expect("count"), 1);
}

/// A concurrent claim waiting on a transaction that rolls back gets the key.
pub async fn concurrent_claim_after_rollback_wins<S: TestStore>(store: S) {
    let k = key("concurrent-rollback");
    let mut t1 = store.begin().await.expect("begin");
    assert_eq!(
        t1.claim(&k, &meta("c")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    let s2 = store.clone();
    let second = tokio::spawn(async move {
        let mut t2 = s2.begin().await.expect("begin");
        let out = t2.claim(&k, &meta("c")).await.expect("claim");
        (out, t2)
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    t1.rollback().await.expect("rollback");
    let (out, t2) = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the second claim must finish once the first rolls back")
        .expect("task");
    match out {
        ClaimOutcome::Claimed => t2.commit().await.expect("commit"),
        ClaimOutcome::InProgress => {
            // A lease store answered at once; after the rollback the key is free again.
            let _ = t2.rollback().await;
            let mut t3 = store.begin().await.expect("begin");
            assert_eq!(
                t3.claim(&k, &meta("c")).await.expect("claim"),
                ClaimOutcome::Claimed
            );
            t3.commit().await.expect("commit");
        }
        ClaimOutcome::Duplicate => panic!("a rolled-back claim made the waiter see Duplicate"),
        ClaimOutcome::Conflict { .. } => panic!("one key with one identity is no conflict"),
    }
    assert_eq!(store.claim_count(&k).await.expect("count"), 1);
}

/// A rolled-back claim can be claimed again.
pub async fn rolled_back_claim_can_be_reclaimed<S: TestStore>(store: S) {
    let k = key("rollback");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &meta("r")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(
        store.claim_count(&k).await.expect("count"),
        0,
        "a rolled-back claim persisted"
    );
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &meta("r")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");
}

/// A transaction dropped without commit or rollback releases its claim (a crash).
pub async fn dropped_tx_releases_claim<S: TestStore>(store: S) {
    let k = key("dropped");
    {
        let mut tx = store.begin().await.expect("begin");
        assert_eq!(
            tx.claim(&k, &meta("d")).await.expect("claim"),
            ClaimOutcome::Claimed
        );
    }
    let mut tx = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let mut tx = store.begin().await.expect("begin");
            match tx.claim(&k, &meta("d")).await.expect("claim") {
                ClaimOutcome::Claimed => return tx,
                ClaimOutcome::InProgress => {
                    let _ = tx.rollback().await;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                ClaimOutcome::Duplicate => panic!("a dropped transaction's claim was committed"),
                ClaimOutcome::Conflict { .. } => {
                    panic!("a dropped transaction's identity was committed")
                }
            }
        }
    })
    .await
    .expect("the dropped transaction's claim must be released");
    let _ = &mut tx;
    tx.commit().await.expect("commit");
    assert_eq!(store.claim_count(&k).await.expect("count"), 1);
}

/// A batch claim answers like single claims, in input order, and a repeated key is one
/// claim.
pub async fn batch_claim_matches_single_claims<S: TestStore>(store: S) {
    let (a, b, c) = (key("batch-a"), key("batch-b"), key("batch-c"));
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&c, &meta("c")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");
    let mut tx = store.begin().await.expect("begin");
    let out = tx
        .claim_batch(&[
            (a, meta("a")),
            (b, meta("b")),
            (a, meta("a")),
            (c, meta("c")),
        ])
        .await
        .expect("claim_batch");
    assert_eq!(
        out,
        vec![
            ClaimOutcome::Claimed,
            ClaimOutcome::Claimed,
            ClaimOutcome::Duplicate,
            ClaimOutcome::Duplicate
        ]
    );
    tx.commit().await.expect("commit");
    for k in [a, b, c] {
        assert_eq!(store.claim_count(&k).await.expect("count"), 1);
    }
}

/// A batch through the gate: one effect per distinct key, duplicates acked, poison
/// dead-lettered, nothing left unsettled.
pub async fn gate_batch_is_exactly_once<S: TestStore>(store: S) {
    let broker = SimBroker::new(3);
    for i in 0..20 {
        broker.publish(encode_submission(
            &format!("B-{}", i % 15),
            "2026-07-01T09:00:00Z",
            100 + i64::from(i % 15),
        ));
    }
    broker.publish(b"not a submission".to_vec());
    let gate = Gate::new(store.clone(), EffectHandlerFor::<S>::new());
    let mut batch: Vec<Delivery<_>> = Vec::new();
    while let Some(d) = broker.receive() {
        batch.push(d);
    }
    let outcomes = gate.process_batch(batch).await;
    let count = |k: OutcomeKind| outcomes.iter().filter(|o| o.kind() == k).count();
    assert_eq!(count(OutcomeKind::Processed), 15);
    assert_eq!(count(OutcomeKind::Duplicate), 5);
    assert_eq!(count(OutcomeKind::Rejected), 1);
    if store.capabilities().transactional_writes {
        assert_eq!(store.effects().await.expect("effects").len(), 15);
    }
    assert!(broker.is_settled());
    assert_eq!(broker.dead_letters().len(), 1);
}
