//! The conformance suite every store runs: plain async functions, one call list.
//!
//! A store's `tests/conformance.rs` is one line — here the in-memory store's; an
//! expression that makes a fresh, isolated store (it may `.await`) goes in the call:
//!
//! ```
//! idem_testkit::conformance_tests!(idem_testkit::MemoryStore::new());
//! # fn main() {}
//! ```
//!
//! which expands to one `#[tokio::test]` per check. Each check panics with a message
//! naming the broken rule. Checks that need business writes in the claim's transaction
//! skip themselves on stores whose [`Capabilities::transactional_writes`] is false (a
//! lease store), and say so.
//!
//! [`Capabilities::transactional_writes`]: idem_core::Capabilities

use std::time::Duration;

use idem_core::{ClaimMeta, ClaimOutcome, ClaimTx, Delivery, Gate, IdempotencyKey, OutcomeKind};

use crate::broker::SimBroker;
use crate::harness::{encode_submission, EffectHandlerFor, TestStore};

fn key(n: &str) -> IdempotencyKey {
    IdempotencyKey::derive(n, "2026-07-01T09:00:00Z", n.as_bytes()).expect("valid identity")
}

/// The claims carry the timestamp their keys are derived from, so a partitioned store
/// files them under a real month (July 2026), not its catch-all partition.
fn meta(n: &str) -> ClaimMeta {
    ClaimMeta::new(n).with_submission_timestamp("2026-07-01T09:00:00Z")
}

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

/// Runs every check in order against stores from `make` (for a quick single-test run).
pub async fn run_all<S, F, Fut>(make: F)
where
    S: TestStore,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = S>,
{
    key_is_deterministic(make().await).await;
    second_claim_is_duplicate(make().await).await;
    same_key_twice_in_one_tx(make().await).await;
    replay_is_duplicate_and_effect_stays_one(make().await).await;
    failed_outbox_insert_leaves_nothing(make().await).await;
    concurrent_claims_one_winner(make().await).await;
    concurrent_claim_after_rollback_wins(make().await).await;
    rolled_back_claim_can_be_reclaimed(make().await).await;
    dropped_tx_releases_claim(make().await).await;
    batch_claim_matches_single_claims(make().await).await;
    gate_batch_is_exactly_once(make().await).await;
}

/// Expands to one `#[tokio::test]` per conformance check. `$make` is an expression
/// (it may `.await`) giving a fresh, isolated store; it is evaluated once per test.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@each $make;
            key_is_deterministic,
            second_claim_is_duplicate,
            same_key_twice_in_one_tx,
            replay_is_duplicate_and_effect_stays_one,
            failed_outbox_insert_leaves_nothing,
            concurrent_claims_one_winner,
            concurrent_claim_after_rollback_wins,
            rolled_back_claim_can_be_reclaimed,
            dropped_tx_releases_claim,
            batch_claim_matches_single_claims,
            gate_batch_is_exactly_once
        );
    };
    (@each $make:expr; $($name:ident),+) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let store = $make;
                $crate::conformance::$name(store).await;
            }
        )+
    };
}

/// An outbox source's [`backlog`](idem_core::OutboxSource::backlog) follows the relay:
/// empty at first; after three committed events, three pending with a small age; after a
/// batch of two is published, one; after the rest, none. `store` and `source` must share
/// one fresh outbox (a store and a relay source over it).
pub async fn outbox_backlog_tracks_the_relay<S, O>(store: S, source: O)
where
    S: idem_core::ClaimStore,
    S::Tx: idem_core::OutboxWriter,
    O: idem_core::OutboxSource,
{
    use idem_core::{OutboxBatch as _, OutboxEvent, OutboxWriter as _};

    let empty = source.backlog().await.expect("backlog");
    assert_eq!(
        empty,
        idem_core::OutboxBacklog::default(),
        "a fresh outbox has no backlog"
    );
    // A rolled-back event is no backlog.
    let mut tx = store.begin().await.expect("begin");
    let k = key("backlog-rolled-back");
    tx.enqueue(&OutboxEvent::new(k, "backlog.test", "B-0", b"{}".to_vec()))
        .await
        .expect("enqueue");
    tx.rollback().await.expect("rollback");
    for i in 1..=3 {
        let name = format!("backlog-{i}");
        let k = key(&name);
        let mut tx = store.begin().await.expect("begin");
        assert!(
            matches!(
                tx.claim(&k, &meta(&name)).await.expect("claim"),
                ClaimOutcome::Claimed
            ),
            "fresh key"
        );
        tx.enqueue(&OutboxEvent::new(k, "backlog.test", name, b"{}".to_vec()))
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
    }
    let three = source.backlog().await.expect("backlog");
    assert_eq!(
        three.pending, 3,
        "three committed events are pending: {three:?}"
    );
    let age = three.oldest_age.expect("an age while events are pending");
    assert!(
        age < Duration::from_secs(60),
        "the oldest pending event was committed just now, not {age:?} ago"
    );

    let batch = source.lease(2).await.expect("lease");
    assert_eq!(batch.events().len(), 2, "lease of two");
    batch.mark_published().await.expect("mark");
    let one = source.backlog().await.expect("backlog");
    assert_eq!(one.pending, 1, "one left after publishing two: {one:?}");
    assert!(one.oldest_age.is_some(), "an age while one is pending");

    let batch = source.lease(10).await.expect("lease");
    assert_eq!(batch.events().len(), 1, "the last one");
    batch.mark_published().await.expect("mark");
    assert_eq!(
        source.backlog().await.expect("backlog"),
        idem_core::OutboxBacklog::default(),
        "nothing pending once everything is published"
    );
}
