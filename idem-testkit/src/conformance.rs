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

use idem_core::{
    ClaimMeta, ClaimOutcome, ClaimTx, ConflictPolicy, Delivery, Gate, GateConfig, IdempotencyKey,
    Outcome, OutcomeKind, RunNote,
};

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

const CONFLICT_TS: &str = "2026-07-01T09:00:00Z";

/// Two payloads of one identity (`subject`, [`CONFLICT_TS`]): two different keys.
fn conflicting_keys(subject: &str) -> (IdempotencyKey, IdempotencyKey) {
    let a = IdempotencyKey::derive(subject, CONFLICT_TS, b"{\"amount_cents\":100}");
    let b = IdempotencyKey::derive(subject, CONFLICT_TS, b"{\"amount_cents\": 999}");
    (a.expect("valid identity"), b.expect("valid identity"))
}

/// A new key whose identity (subject + submission timestamp) is already claimed under
/// another key is a `Conflict` naming that key, and claims nothing; a key already claimed
/// stays a `Duplicate`; the same key claimed without its identity is `Claimed` (the
/// `process` policy). A store that does not detect conflicts claims it (and says so in
/// its capabilities).
pub async fn conflicting_payload_is_a_conflict<S: TestStore>(store: S) {
    let (first, second) = conflicting_keys("conflict-one");
    let m = meta("conflict-one");
    let detects = store.capabilities().detects_conflicts;
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&first, &m).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");

    let mut tx = store.begin().await.expect("begin");
    let out = tx
        .claim(&second, &m)
        .await
        .expect("a conflict must not error");
    if !detects {
        assert_eq!(
            out,
            ClaimOutcome::Claimed,
            "a store that does not detect conflicts claims a new key"
        );
        let _ = tx.rollback().await;
        return;
    }
    assert_eq!(
        out,
        ClaimOutcome::Conflict { existing: first },
        "a second payload of a claimed identity must be a Conflict naming the first key"
    );
    // The transaction stays usable after a conflict: the first key is still a duplicate.
    assert_eq!(
        tx.claim(&first, &m).await.expect("claim"),
        ClaimOutcome::Duplicate
    );
    tx.commit().await.expect("commit after a conflict");
    assert_eq!(
        store.claim_count(&second).await.expect("count"),
        0,
        "a conflict claimed its key"
    );

    // The `process` policy: the same key without its identity is claimed, once.
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&second, &m.clone().without_identity())
            .await
            .expect("claim"),
        ClaimOutcome::Claimed,
        "a claim without identity is never in conflict"
    );
    tx.commit().await.expect("commit");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&second, &m).await.expect("claim"),
        ClaimOutcome::Duplicate,
        "a claimed key is a Duplicate whatever its identity"
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(store.claim_count(&second).await.expect("count"), 1);
}

/// Two transactions claiming one identity under two keys at once: the second waits for
/// the first, and is a `Conflict` when it commits (never two claims of one identity).
pub async fn concurrent_conflicting_claims_serialize<S: TestStore>(store: S) {
    if !store.capabilities().detects_conflicts {
        eprintln!("skipped: the store does not detect conflicts");
        return;
    }
    let (first, second) = conflicting_keys("conflict-race");
    let m = meta("conflict-race");
    let mut t1 = store.begin().await.expect("begin");
    assert_eq!(
        t1.claim(&first, &m).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    let s2 = store.clone();
    let m2 = m.clone();
    let waiter = tokio::spawn(async move {
        let mut t2 = s2.begin().await.expect("begin");
        let out = t2.claim(&second, &m2).await.expect("claim");
        (out, t2)
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    t1.commit().await.expect("commit");
    let (out, t2) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the second claim must finish once the first commits")
        .expect("task");
    match out {
        ClaimOutcome::Conflict { existing } => assert_eq!(existing, first),
        // A store with a lock timeout may give up waiting; it must not claim.
        ClaimOutcome::InProgress => {}
        other => panic!("two concurrent claims of one identity gave {other:?}"),
    }
    let _ = t2.rollback().await;
    assert_eq!(store.claim_count(&second).await.expect("count"), 0);
}

/// A batch detects conflicts with committed claims and between two of its own items.
pub async fn batch_claim_detects_conflicts<S: TestStore>(store: S) {
    let (old, old_again) = conflicting_keys("conflict-batch-old");
    let (x, y) = conflicting_keys("conflict-batch-new");
    let fresh = key("conflict-batch-fresh");
    let m_old = meta("conflict-batch-old");
    let m_new = meta("conflict-batch-new");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&old, &m_old).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");

    let mut tx = store.begin().await.expect("begin");
    let out = tx
        .claim_batch(&[
            (x, m_new.clone()),
            (old_again, m_old.clone()),
            (fresh, meta("conflict-batch-fresh")),
            (y, m_new.clone()),
        ])
        .await
        .expect("claim_batch");
    tx.commit().await.expect("commit");
    if !store.capabilities().detects_conflicts {
        assert!(out.iter().all(|o| *o == ClaimOutcome::Claimed), "{out:?}");
        return;
    }
    assert_eq!(out[1], ClaimOutcome::Conflict { existing: old }, "{out:?}");
    assert_eq!(out[2], ClaimOutcome::Claimed, "{out:?}");
    // Of the two payloads of one identity in the batch, one is claimed and the other
    // conflicts with it.
    match (out[0], out[3]) {
        (ClaimOutcome::Claimed, ClaimOutcome::Conflict { existing }) => assert_eq!(existing, x),
        (ClaimOutcome::Conflict { existing }, ClaimOutcome::Claimed) => assert_eq!(existing, y),
        other => panic!("two payloads of one identity in one batch gave {other:?}"),
    }
    let claimed =
        store.claim_count(&x).await.expect("count") + store.claim_count(&y).await.expect("count");
    assert_eq!(claimed, 1, "one identity, one claim");
    assert_eq!(store.claim_count(&old_again).await.expect("count"), 0);
}

/// Through the gate: the same submission with another amount is dead-lettered with a
/// reason naming both keys under the default policy (one effect), and processed under
/// [`ConflictPolicy::Process`] (two effects, the reference behaviour).
pub async fn gate_conflict_policies<S: TestStore>(store: S) {
    let detects = store.capabilities().detects_conflicts;
    for (policy, subject) in [
        (ConflictPolicy::DeadLetter, "conflict-gate-dl"),
        (ConflictPolicy::Process, "conflict-gate-process"),
    ] {
        let broker = SimBroker::new(5);
        broker.publish(encode_submission(subject, CONFLICT_TS, 100));
        broker.publish(encode_submission(subject, CONFLICT_TS, 250));
        // A redelivery of the second: a duplicate under `process`, a conflict again
        // under `dead-letter`.
        broker.publish(encode_submission(subject, CONFLICT_TS, 250));
        let gate = Gate::with_config(
            store.clone(),
            EffectHandlerFor::<S>::new(),
            GateConfig::default().with_on_conflict(policy),
        );
        let mut outcomes = Vec::new();
        while let Some(d) = broker.receive() {
            outcomes.push(gate.process(d).await);
        }
        let kinds: Vec<OutcomeKind> = outcomes.iter().map(Outcome::kind).collect();
        let effects = if store.capabilities().transactional_writes {
            Some(
                store
                    .effects()
                    .await
                    .expect("effects")
                    .into_iter()
                    .filter(|e| e.subject == subject)
                    .count(),
            )
        } else {
            None
        };
        assert!(broker.is_settled());
        if policy == ConflictPolicy::Process || !detects {
            assert_eq!(
                kinds,
                [
                    OutcomeKind::Processed,
                    OutcomeKind::Processed,
                    OutcomeKind::Duplicate
                ],
                "{policy}"
            );
            assert!(effects.is_none_or(|n| n == 2), "{policy}: {effects:?}");
            assert!(broker.dead_letters().is_empty());
            continue;
        }
        assert_eq!(
            kinds,
            [
                OutcomeKind::Processed,
                OutcomeKind::Conflict,
                OutcomeKind::Conflict
            ]
        );
        assert!(effects.is_none_or(|n| n == 1), "{effects:?}");
        let (Some(first), Some(second)) = (outcomes[0].key(), outcomes[1].key()) else {
            panic!("keys")
        };
        let letters = broker.dead_letters();
        assert_eq!(
            letters.len(),
            2,
            "both conflicting deliveries dead-lettered"
        );
        for (_, reason) in &letters {
            assert_eq!(reason.code, idem_core::gate::CONFLICT);
            assert!(
                reason.detail.contains(&first.to_hex()) && reason.detail.contains(&second.to_hex()),
                "the reason names both keys: {reason}"
            );
        }
    }
}

/// The first delivered wins, within a batch and across the batches a consumer has in
/// flight: of two payloads of one submission, the one delivered first takes effect and
/// the later one is dead-lettered as the conflict — even when the first one's batch is
/// slower (here it also holds a key that another transaction keeps locked for a while,
/// so on a store whose claims wait on locks the later batch would otherwise claim first).
pub async fn first_delivered_wins_across_batches<S: TestStore>(store: S) {
    if !store.capabilities().detects_conflicts || !store.capabilities().transactional_writes {
        return;
    }
    const TS: &str = "2026-07-01T09:00:00Z";
    let held = encode_submission("A-held", TS, 5);
    let held_key = crate::harness::EffectHandler::parse(&held)
        .expect("valid")
        .key;
    // Another transaction holds the first batch's other key for a while.
    let mut holder = store.begin().await.expect("begin");
    assert_eq!(
        holder
            .claim(
                &held_key,
                &ClaimMeta::new("A-held").with_submission_timestamp(TS)
            )
            .await
            .expect("claim"),
        ClaimOutcome::Claimed
    );
    let broker = SimBroker::new(11);
    // Arrival order: batch one [A-held, Z-first=1], batch two [Z-first=2, B-other].
    broker.publish(held);
    broker.publish(encode_submission("Z-first", TS, 1));
    broker.publish(encode_submission("Z-first", TS, 2));
    broker.publish(encode_submission("B-other", TS, 3));
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let _ = holder.rollback().await;
    });
    let gate = Gate::with_config(
        store.clone(),
        EffectHandlerFor::<S>::new(),
        GateConfig::default().with_defer_delay(Duration::from_millis(10)),
    );
    let source = broker.clone();
    let deliveries = futures::stream::unfold((), move |()| {
        let source = source.clone();
        async move {
            loop {
                if let Some(d) = source.receive() {
                    return Some((Ok::<_, std::convert::Infallible>(d), ()));
                }
                if source.is_settled() {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    let run = idem_core::consumer::run(
        &gate,
        deliveries,
        idem_core::ConsumerConfig::new(2, 2),
        tokio::time::sleep(Duration::from_secs(30)),
        |_| {},
    );
    run.await.expect("the consumer runs");
    release.await.expect("the holder ends");
    assert!(broker.is_settled(), "every delivery is settled");
    let effects = store.effects().await.expect("effects");
    let z: Vec<i64> = effects
        .iter()
        .filter(|e| e.subject == "Z-first")
        .map(|e| e.amount)
        .collect();
    assert_eq!(
        z,
        vec![1],
        "the payload delivered first must take effect, once (the later batch claimed first)"
    );
    let dead: Vec<(Vec<u8>, &str)> = broker
        .dead_letters()
        .into_iter()
        .map(|(m, r)| (m.payload, r.code))
        .collect();
    assert_eq!(
        dead,
        vec![(
            encode_submission("Z-first", TS, 2),
            idem_core::gate::CONFLICT
        )],
        "only the later payload is dead-lettered, as the conflict"
    );
    assert_eq!(effects.len(), 3, "A-held, Z-first and B-other each once");
}

/// The record of reruns ([`ClaimStore::note_run`](idem_core::ClaimStore::note_run)):
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
    assert_eq!(dead[0].1.code, idem_core::gate::ATTEMPTS_EXHAUSTED);
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
    conflicting_payload_is_a_conflict(make().await).await;
    concurrent_conflicting_claims_serialize(make().await).await;
    batch_claim_detects_conflicts(make().await).await;
    gate_conflict_policies(make().await).await;
    first_delivered_wins_across_batches(make().await).await;
    reruns_are_recorded(make().await).await;
    a_rerun_of_a_committed_message_is_a_duplicate_at_once(make().await).await;
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
            gate_batch_is_exactly_once,
            conflicting_payload_is_a_conflict,
            concurrent_conflicting_claims_serialize,
            batch_claim_detects_conflicts,
            gate_conflict_policies,
            first_delivered_wins_across_batches,
            reruns_are_recorded,
            a_rerun_of_a_committed_message_is_a_duplicate_at_once
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

/// The handler of [`outbox_carries_the_traceparent`]: the body is the subject, and each
/// submission writes one event made with [`OutboxEvent::new`](idem_core::OutboxEvent::new)
/// (nothing about tracing: the gate supplies it).
struct OneEventEach;

#[async_trait::async_trait]
impl<Tx> idem_core::Handler<Tx> for OneEventEach
where
    Tx: idem_core::ClaimTx + idem_core::OutboxWriter + Send,
{
    type Input = ();

    fn identify(
        &self,
        payload: &[u8],
        _headers: &idem_core::Headers,
    ) -> Result<idem_core::Submission<()>, idem_core::RejectReason> {
        let subject = String::from_utf8_lossy(payload).into_owned();
        Ok(idem_core::Submission {
            key: IdempotencyKey::derive(&subject, "2026-07-01T09:00:00Z", payload)?,
            subject,
            input: (),
        })
    }

    async fn handle(
        &self,
        tx: &mut Tx,
        sub: &idem_core::Submission<()>,
    ) -> Result<(), idem_core::HandlerError> {
        let body = serde_json::json!({ "subject": sub.subject }).to_string();
        tx.enqueue(&idem_core::OutboxEvent::new(
            sub.key,
            "trace.test",
            sub.subject.clone(),
            body,
        ))
        .await?;
        Ok(())
    }
}

/// A delivery's W3C `traceparent` reaches its outbox event and the relay's message: the
/// gate processes traced, untraced and malformed-traced deliveries one at a time and in a
/// batch (where each event must get its own delivery's trace); the source must give each
/// event back with the delivery's trace id and a new parent id (the delivery's span),
/// none for the others; the relay must publish it as the `traceparent` header, unchanged.
/// `store` and `source` must share one fresh outbox.
pub async fn outbox_carries_the_traceparent<S, O>(store: S, source: O)
where
    S: idem_core::ClaimStore,
    S::Tx: idem_core::OutboxWriter,
    O: idem_core::OutboxSource,
{
    use std::collections::BTreeMap;

    use idem_core::{OutboxBatch as _, Relay, TraceParent};

    const T1: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const T2: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    const T3: &str = "00-11111111111111111111111111111111-2222222222222222-01";
    // Upper-case hex: not a valid traceparent, so ignored (processed untraced).
    const BAD: &str = "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01";
    let tp = |v: &str| vec![("traceparent".to_owned(), v.to_owned())];
    let upstream = SimBroker::new(7);
    let gate = Gate::new(store, OneEventEach);

    // (subject, the incoming traceparent if valid)
    let single = [
        ("trace-single", Some(T1)),
        ("trace-untraced", None),
        ("trace-malformed", None),
    ];
    upstream.publish_with_headers("trace-single", tp(T1));
    upstream.publish_with_headers("trace-untraced", Vec::new());
    upstream.publish_with_headers("trace-malformed", tp(BAD));
    for (subject, _) in &single {
        let d = upstream.receive().expect("a delivery");
        let outcome = gate.process(d).await;
        assert_eq!(
            outcome.kind(),
            OutcomeKind::Processed,
            "{subject}: {outcome:?}"
        );
    }
    let batched = [
        ("trace-batch-1", Some(T2)),
        ("trace-batch-2", Some(T3)),
        ("trace-batch-3", None),
    ];
    upstream.publish_with_headers("trace-batch-1", tp(T2));
    upstream.publish_with_headers("trace-batch-2", tp(T3));
    upstream.publish_with_headers("trace-batch-3", Vec::new());
    let batch: Vec<_> = (0..3)
        .map(|_| upstream.receive().expect("a delivery"))
        .collect();
    for o in gate.process_batch(batch).await {
        assert_eq!(o.kind(), OutcomeKind::Processed, "{o:?}");
    }
    let expected: BTreeMap<&str, Option<TraceParent>> = single
        .iter()
        .chain(&batched)
        .map(|(s, t)| (*s, t.map(|t| t.parse().expect("a valid traceparent"))))
        .collect();

    // The outbox gives each event back with its delivery's trace.
    let leased = source.lease(100).await.expect("lease");
    let stored: BTreeMap<String, Option<TraceParent>> = leased
        .events()
        .iter()
        .map(|e| (e.subject.clone(), e.traceparent))
        .collect();
    assert_eq!(
        stored.len(),
        expected.len(),
        "one event per delivery: {stored:?}"
    );
    for (subject, want) in &expected {
        let got = stored
            .get(*subject)
            .unwrap_or_else(|| panic!("no outbox event for {subject}"));
        match (want, got) {
            (None, None) => {}
            (Some(w), Some(g)) => {
                assert_eq!(
                    g.trace_id(),
                    w.trace_id(),
                    "{subject}: the trace id is kept"
                );
                assert_eq!(g.flags(), w.flags(), "{subject}: the flags are kept");
                assert_ne!(
                    g.parent_id(),
                    w.parent_id(),
                    "{subject}: the event's parent is the delivery's own span, not the sender's"
                );
            }
            _ => panic!("{subject}: expected trace {want:?}, the outbox holds {got:?}"),
        }
    }
    leased.release().await.expect("release");

    // The relay publishes what the outbox holds, as the `traceparent` header.
    let downstream = SimBroker::new(8);
    let relay = Relay::new(source, downstream.clone(), 100);
    assert_eq!(relay.run_once().await.expect("relay"), expected.len());
    let mut seen = 0;
    // Held until the end: a delivery dropped unsettled goes back to the queue.
    let mut held = Vec::new();
    while let Some(d) = downstream.receive() {
        let body = String::from_utf8_lossy(&d.payload).into_owned();
        let (subject, want) = stored
            .iter()
            .find(|(s, _)| body.contains(&format!("\"{s}\"")))
            .unwrap_or_else(|| panic!("an unknown message {body}"));
        assert_eq!(
            d.header("traceparent"),
            want.map(|t| t.to_string()).as_deref(),
            "{subject}: the published traceparent is the stored one"
        );
        seen += 1;
        held.push(d);
    }
    assert_eq!(seen, expected.len(), "every event published once");
}
