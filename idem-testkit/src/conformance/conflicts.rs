//! Conflicts: two payloads of one identity.

use std::time::Duration;

use idem_engine::ClaimTx;
use idem_engine::{
    ClaimMeta, ClaimOutcome, ConflictPolicy, Gate, GateConfig, IdempotencyKey, Outcome, OutcomeKind,
};

use super::{key, meta};
use crate::broker::SimBroker;
use crate::harness::{encode_submission, EffectHandlerFor, TestStore};

pub(super) const CONFLICT_TS: &str = "2026-07-01T09:00:00Z";

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
            assert_eq!(reason.code, idem_engine::gate::CONFLICT);
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
    let run = idem_engine::consumer::run(
        &gate,
        deliveries,
        idem_engine::ConsumerConfig::new(2, 2),
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
            idem_engine::gate::CONFLICT
        )],
        "only the later payload is dead-lettered, as the conflict"
    );
    assert_eq!(effects.len(), 3, "A-held, Z-first and B-other each once");
}
