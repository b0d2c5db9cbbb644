//! The SQLite relay: it publishes outside the write lock (a consumer commits while a
//! batch is out at the broker), two relays never hold one row, a dead relay's lease
//! expires, and an event the broker refuses for good is moved aside while the rest flows.

use crate::common;

use std::time::Duration;

use async_trait::async_trait;
use idem_engine::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxBatch, OutboxEvent,
    OutboxSource, OutboxWriter, PublishError, Publisher, Relay,
};
use idem_store_sqlite::{SqliteConfig, SqliteOutboxSource, SqliteStore};
use idem_testkit::SimBroker;

fn event(n: usize, subject: &str) -> OutboxEvent {
    let key = IdempotencyKey::derive(subject, &n.to_string(), b"{}").expect("key");
    OutboxEvent::new(key, "effect.recorded", subject, format!("{{\"n\":{n}}}"))
}

async fn commit(store: &SqliteStore, ev: &OutboxEvent) {
    let mut tx = store.begin().await.expect("begin");
    let meta = ClaimMeta::new(ev.subject.clone());
    assert_eq!(
        tx.claim(&ev.idempotency_key, &meta).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.enqueue(ev).await.expect("enqueue");
    tx.commit().await.expect("commit");
}

fn source(store: &SqliteStore) -> SqliteOutboxSource {
    SqliteOutboxSource::new(store.clone(), Duration::from_millis(10))
}

#[tokio::test]
async fn a_consumer_commits_while_a_leased_batch_is_out_at_the_broker() {
    let t = common::fresh().await;
    commit(&t.store, &event(1, "a")).await;
    let batch = source(&t.store).lease(10).await.expect("lease");
    assert_eq!(batch.events().len(), 1);
    // The batch is held (as while a publish waits for confirms). A second connection
    // with a short busy timeout still commits: the relay holds no write lock.
    let path = t.store.pool().connect_options().get_filename().to_owned();
    let mut config = SqliteConfig::default();
    config.busy_timeout = Duration::from_millis(50);
    let other = SqliteStore::connect(path.to_str().expect("path"), config)
        .await
        .expect("open");
    commit(&other, &event(2, "b")).await;
    batch.mark_published().await.expect("mark");
    assert_eq!(t.store.outbox_backlog().await.expect("backlog").pending, 1);
}

#[tokio::test]
async fn two_relays_never_hold_one_row_and_a_dead_relays_lease_expires() {
    let t = common::fresh().await;
    for n in 0..4 {
        commit(&t.store, &event(n, &format!("s{n}"))).await;
    }
    let one = source(&t.store).with_lease_duration(Duration::from_millis(300));
    let held = one.lease(2).await.expect("lease");
    assert_eq!(held.events().len(), 2);
    let two = source(&t.store);
    let other = two.lease(10).await.expect("lease");
    assert_eq!(
        other.events().len(),
        2,
        "only the rows the first relay does not hold"
    );
    assert!(held
        .events()
        .iter()
        .all(|e| other.events().iter().all(|o| o.event_id != e.event_id)));
    other.mark_published().await.expect("mark");
    // The first relay dies holding its lease (forgotten, not released).
    std::mem::forget(held);
    assert_eq!(two.lease(10).await.expect("lease").events().len(), 0);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let taken_over = two.lease(10).await.expect("lease");
    assert_eq!(taken_over.events().len(), 2, "the expired lease moves on");
    taken_over.mark_published().await.expect("mark");
    assert_eq!(t.store.outbox_backlog().await.expect("backlog").pending, 0);
}

#[tokio::test]
async fn a_subject_waits_while_another_relay_holds_its_earlier_event() {
    let t = common::fresh().await;
    commit(&t.store, &event(1, "S")).await;
    commit(&t.store, &event(2, "T")).await;
    commit(&t.store, &event(3, "S")).await;
    let one = source(&t.store).lease(1).await.expect("lease");
    assert_eq!(one.events()[0].subject, "S");
    let two = source(&t.store).lease(10).await.expect("lease");
    let subjects: Vec<_> = two.events().iter().map(|e| e.subject.as_str()).collect();
    assert_eq!(subjects, ["T"], "S's second event waits for its first");
    one.mark_published().await.expect("mark");
    two.mark_published().await.expect("mark");
    let three = source(&t.store).lease(10).await.expect("lease");
    assert_eq!(three.events()[0].event_id, event(3, "S").event_id);
}

struct Refusing(SimBroker);

#[async_trait]
impl Publisher for Refusing {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        if events.iter().any(|e| e.subject == "poison") {
            return Err(PublishError::new("message refused: too large", false, None));
        }
        Publisher::publish(&self.0, events).await
    }
}

#[tokio::test]
async fn a_refused_event_is_moved_aside_and_the_rest_is_published() {
    let t = common::fresh().await;
    let events = [event(1, "poison"), event(2, "a"), event(3, "b")];
    for ev in &events {
        commit(&t.store, ev).await;
    }
    let broker = SimBroker::new(1);
    let options = idem_runtime::relay_options()
        .max_publish_attempts(2)
        .exit_when_idle(Some(Duration::from_millis(200)));
    let relay = Relay::with_options(source(&t.store), Refusing(broker.clone()), options);
    let stats = relay.run(std::future::pending()).await.expect("run");
    assert_eq!((stats.published, stats.moved_aside), (2, 1));
    let sent: Vec<_> = broker
        .published_events()
        .iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(sent, [events[1].event_id, events[2].event_id]);
    let aside = t.store.outbox_moved_aside().await.expect("list");
    assert_eq!(aside.len(), 1);
    assert_eq!(
        (aside[0].attempts, aside[0].subject.as_str()),
        (2, "poison")
    );
    assert!(aside[0].last_error.contains("too large"));
    assert_eq!(relay.source().moved_aside().await.expect("count"), 1);
    assert!(t
        .store
        .outbox_requeue(&events[0].event_id)
        .await
        .expect("requeue"));
    assert_eq!(t.store.outbox_backlog().await.expect("backlog").pending, 1);
}

/// A row that is not a valid event — written by another program, or edited by hand — is
/// moved aside with its reason, not published, and does not stop the relay: the events
/// behind it, of its subject too, are published.
#[tokio::test]
async fn a_row_that_is_not_a_valid_event_is_moved_aside_and_the_rest_is_published() {
    let t = common::fresh().await;
    let good = [event(1, "a"), event(3, "b"), event(5, "c")];
    commit(&t.store, &good[0]).await;
    let key = good[0].idempotency_key.to_hex();
    for (event_id, key) in [
        ("not-an-event-id".to_owned(), key.as_str()),
        ("e".repeat(64), "not-a-key"),
    ] {
        sqlx::query(
            "INSERT INTO outbox (event_id, event_type, subject, idempotency_key, payload) \
             VALUES (?, 'effect.recorded', 'b', ?, '{}')",
        )
        .bind(event_id)
        .bind(key)
        .execute(t.store.pool())
        .await
        .expect("a row written by another program");
    }
    commit(&t.store, &good[1]).await;
    commit(&t.store, &good[2]).await;

    let broker = SimBroker::new(1);
    let options = idem_runtime::relay_options()
        .batch_size(1)
        .exit_when_idle(Some(Duration::from_millis(200)));
    let relay = Relay::with_options(source(&t.store), broker.clone(), options);
    let stats = tokio::time::timeout(Duration::from_secs(20), relay.run(std::future::pending()))
        .await
        .expect("the relay is not stuck on the rows")
        .expect("run");
    assert_eq!(stats.published, 3);
    let sent: Vec<_> = broker
        .published_events()
        .iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(sent, good.map(|e| e.event_id));
    let aside = t.store.outbox_moved_aside().await.expect("list");
    assert_eq!(
        aside
            .iter()
            .map(|a| a.event_id.as_str())
            .collect::<Vec<_>>(),
        ["not-an-event-id", "e".repeat(64).as_str()]
    );
    assert!(aside[0].last_error.contains("event_id"), "{aside:?}");
    assert!(aside[1].last_error.contains("idempotency_key"), "{aside:?}");
    assert_eq!(relay.source().moved_aside().await.expect("count"), 2);
    assert_eq!(t.store.outbox_backlog().await.expect("backlog").pending, 0);
}
