//! SQLite specifics: the relay source, inspection, identifiers.

use crate::common;

use std::time::Duration;

use idem_engine::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent, OutboxWriter, Relay,
};
use idem_store_sqlite::SqliteOutboxSource;
use idem_testkit::SimBroker;

#[tokio::test]
async fn relay_publishes_committed_events_once_and_marks_them() {
    let t = common::fresh().await;
    let mut keys = Vec::new();
    for i in 0..5 {
        let key = IdempotencyKey::derive(&format!("A-{i}"), "2026-07-01T09:00:00Z", b"{}").unwrap();
        let mut tx = t.store.begin().await.unwrap();
        assert_eq!(
            tx.claim(&key, &ClaimMeta::new(format!("A-{i}")))
                .await
                .unwrap(),
            ClaimOutcome::Claimed
        );
        tx.enqueue(&OutboxEvent::new(
            key,
            "disbursement.recorded",
            format!("A-{i}"),
            format!("{{\"award_id\":\"A-{i}\"}}"),
        ))
        .await
        .unwrap();
        if i == 4 {
            tx.rollback().await.unwrap(); // never committed: never published
        } else {
            tx.commit().await.unwrap();
            keys.push(key);
        }
    }
    let broker = SimBroker::new(1);
    let relay = Relay::new(
        SqliteOutboxSource::new(t.store.clone(), Duration::from_millis(10)),
        broker.clone(),
        2,
    );
    assert_eq!(relay.run_once().await.unwrap(), 2);
    assert_eq!(relay.run_once().await.unwrap(), 2);
    assert_eq!(relay.run_once().await.unwrap(), 0);
    let published = broker.published_events();
    assert_eq!(published.len(), 4);
    let want: Vec<_> = keys
        .iter()
        .map(|k| idem_engine::EventId::derive(k, "disbursement.recorded"))
        .collect();
    assert_eq!(
        published.iter().map(|e| e.event_id).collect::<Vec<_>>(),
        want,
        "in commit order, with derived ids"
    );
    for k in &keys {
        let record = t.store.inspect_key(k).await.unwrap().expect("claimed");
        assert_eq!(record.events.len(), 1);
        assert!(record.events[0].published_at.is_some());
    }
}

#[tokio::test]
async fn a_released_batch_is_published_again_with_the_same_ids() {
    let t = common::fresh().await;
    let key = IdempotencyKey::derive("A-9", "2026-07-01T09:00:00Z", b"{}").unwrap();
    let mut tx = t.store.begin().await.unwrap();
    tx.claim(&key, &ClaimMeta::new("A-9")).await.unwrap();
    tx.enqueue(&OutboxEvent::new(key, "disbursement.recorded", "A-9", "{}"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let source = SqliteOutboxSource::new(t.store.clone(), Duration::from_millis(10));
    use idem_engine::{OutboxBatch, OutboxSource};
    // "Publish", then crash before marking: the batch is dropped unmarked.
    let first = source.lease(10).await.unwrap();
    let first_ids: Vec<_> = first.events().iter().map(|e| e.event_id).collect();
    drop(first);
    let second = source.lease(10).await.unwrap();
    let second_ids: Vec<_> = second.events().iter().map(|e| e.event_id).collect();
    assert_eq!(first_ids, second_ids);
    second.mark_published().await.unwrap();
    assert!(source.lease(10).await.unwrap().events().is_empty());
}

#[tokio::test]
async fn inspect_finds_claims_by_key_and_award() {
    let t = common::fresh().await;
    let key = IdempotencyKey::derive("A-7", "2026-07-01T09:00:00Z", b"{}").unwrap();
    assert!(t.store.inspect_key(&key).await.unwrap().is_none());
    let mut tx = t.store.begin().await.unwrap();
    tx.claim(&key, &ClaimMeta::new("A-7")).await.unwrap();
    tx.commit().await.unwrap();
    let record = t.store.inspect_key(&key).await.unwrap().expect("claimed");
    assert_eq!(record.award_id.as_deref(), Some("A-7"));
    assert_eq!(record.key, key.to_hex());
    assert!(record.claimed_at.is_some());
    assert_eq!(t.store.inspect_subject("A-7").await.unwrap().len(), 1);
    assert!(t.store.inspect_subject("A-8").await.unwrap().is_empty());
    assert!(
        t.store.count("no such table; DROP TABLE x").await.is_err(),
        "identifiers are validated"
    );
}

#[tokio::test]
async fn outbox_backlog_tracks_the_relay() {
    let t = common::fresh().await;
    let source = SqliteOutboxSource::new(t.store.clone(), Duration::from_millis(50));
    idem_testkit::conformance::outbox_backlog_tracks_the_relay(t.store.clone(), source).await;
}

#[tokio::test]
async fn outbox_carries_the_traceparent() {
    let t = common::fresh().await;
    let source = SqliteOutboxSource::new(t.store.clone(), Duration::from_millis(50));
    idem_testkit::conformance::outbox_carries_the_traceparent(t.store.clone(), source).await;
}
