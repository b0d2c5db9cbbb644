//! The relay keeps going on real Postgres: an event the broker refuses for good is moved
//! aside (listed, counted, requeueable) while the events behind it flow, and one
//! subject's events are published in commit order even when two transactions commit out
//! of id order.

use crate::common;

use std::time::Duration;

use async_trait::async_trait;
use idem_engine::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent, OutboxSource,
    OutboxWriter, PublishError, Publisher, Relay, RelayOptions,
};
use idem_store_postgres::{PgOutboxSource, PgStore};
use idem_testkit::SimBroker;

fn event(n: usize, subject: &str) -> OutboxEvent {
    let key = IdempotencyKey::derive(subject, &n.to_string(), b"{}").expect("key");
    OutboxEvent::new(key, "effect.recorded", subject, format!("{{\"n\":{n}}}"))
}

async fn commit(store: &PgStore, ev: &OutboxEvent) {
    let mut tx = store.begin().await.expect("begin");
    let meta = ClaimMeta::new(ev.subject.clone());
    assert_eq!(
        tx.claim(&ev.idempotency_key, &meta).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.enqueue(ev).await.expect("enqueue");
    tx.commit().await.expect("commit");
}

/// The simulated broker, refusing for good every event of subject `poison`.
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

fn options() -> RelayOptions {
    idem_runtime::relay_options()
        .batch_size(50)
        .max_publish_attempts(3)
        .exit_when_idle(Some(Duration::from_millis(300)))
}

#[tokio::test]
async fn a_refused_event_is_moved_aside_and_the_rest_is_published() {
    let store = common::fresh_pg().await;
    let events = [
        event(1, "poison"),
        event(2, "a"),
        event(3, "poison-free"),
        event(4, "a"),
    ];
    for ev in &events {
        commit(&store, ev).await;
    }
    let broker = SimBroker::new(1);
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    let relay = Relay::with_options(source, Refusing(broker.clone()), options());
    let stats = relay.run(std::future::pending()).await.expect("run");
    assert_eq!(stats.published, 3);
    assert_eq!(stats.moved_aside, 1);
    let sent: Vec<_> = broker
        .published_events()
        .iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(
        sent,
        [events[1].event_id, events[2].event_id, events[3].event_id]
    );

    // Visible to an operator: listed with its last error, counted, not in the backlog.
    let aside = store.outbox_moved_aside().await.expect("list");
    assert_eq!(aside.len(), 1);
    assert_eq!(aside[0].event_id, events[0].event_id.to_string());
    assert_eq!(aside[0].attempts, 3);
    assert!(aside[0].last_error.contains("too large"), "{aside:?}");
    assert_eq!(relay.source().moved_aside().await.expect("count"), 1);
    assert_eq!(store.outbox_backlog().await.expect("backlog").pending, 0);

    // Requeued once the cause is fixed: the next relay publishes it.
    assert!(store
        .outbox_requeue(&events[0].event_id)
        .await
        .expect("requeue"));
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    let relay = Relay::with_options(source, broker.clone(), options());
    assert_eq!(
        relay
            .run(std::future::pending())
            .await
            .expect("run")
            .published,
        1
    );
    assert!(store.outbox_moved_aside().await.expect("list").is_empty());
}

/// A row that is not a valid event — written by another program into idem's columns,
/// or edited by hand — is moved aside with its reason, not published, and does not stop
/// the relay: every event behind it, of its subject too, is published.
#[tokio::test]
async fn a_row_that_is_not_a_valid_event_is_moved_aside_and_the_rest_is_published() {
    // Batches of one: a lease of nothing but an invalid row looks again at once.
    for batch_size in [50, 1] {
        invalid_rows_are_moved_aside(batch_size).await;
    }
}

async fn invalid_rows_are_moved_aside(batch_size: usize) {
    let store = common::fresh_pg().await;
    let ob = store.table("outbox");
    let good = [event(1, "a"), event(3, "b"), event(5, "c")];
    commit(&store, &good[0]).await;
    let bad_row = |event_id: &str, key: &str| {
        format!(
            "INSERT INTO {ob} (event_id, event_type, subject, idempotency_key, payload) \
             VALUES ('{event_id}', 'effect.recorded', 'b', '{key}', '{{}}')"
        )
    };
    let key = good[0].idempotency_key.to_hex();
    for sql in [
        bad_row("not-an-event-id", &key),
        bad_row(&"e".repeat(64), "not-a-key"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .expect("a row written by another program");
    }
    commit(&store, &good[1]).await;
    commit(&store, &good[2]).await;

    let broker = SimBroker::new(1);
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    let relay = Relay::with_options(source, broker.clone(), options().batch_size(batch_size));
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
    let aside = store.outbox_moved_aside().await.expect("list");
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
    assert_eq!(store.outbox_backlog().await.expect("backlog").pending, 0);
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_subjects_events_are_published_in_commit_order() {
    let store = common::fresh_pg().await;
    let (first, second) = (event(1, "S"), event(2, "S"));
    // T1 writes the subject's first event and stays open.
    let mut t1 = store.begin().await.expect("begin");
    t1.claim(&first.idempotency_key, &ClaimMeta::new("S"))
        .await
        .expect("claim");
    t1.enqueue(&first).await.expect("enqueue");
    // T2 writes the second event of the subject and commits — it must wait for T1.
    let t2 = {
        let (store, second) = (store.clone(), second.clone());
        tokio::spawn(async move { commit(&store, &second).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A relay now: without the subject lock T2 has committed and its event (a later
    // id) would be published first.
    let broker = SimBroker::new(1);
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    let relay = Relay::new(source, broker.clone(), 10);
    assert_eq!(
        relay.run_once().await.expect("relay"),
        0,
        "T2 must wait for T1"
    );
    t1.commit().await.expect("commit T1");
    t2.await.expect("T2");
    assert_eq!(relay.run_once().await.expect("relay"), 2);
    let sent: Vec<_> = broker
        .published_events()
        .iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(sent, [first.event_id, second.event_id]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_in_flight_publish_everything_once_in_subject_order() {
    let store = common::fresh_pg().await;
    let subjects = ["A", "B", "C"];
    let events: Vec<_> = (0..120).map(|n| event(n, subjects[n % 3])).collect();
    for ev in &events {
        commit(&store, ev).await;
    }
    let broker = SimBroker::new(1);
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    let relay = Relay::with_options(source, broker.clone(), options().batch_size(7).in_flight(3));
    let stats = relay.run(std::future::pending()).await.expect("run");
    assert_eq!(stats.published, 120);
    let sent = broker.published_events();
    assert_eq!(sent.len(), 120, "each event once");
    for s in subjects {
        let got: Vec<_> = sent
            .iter()
            .filter(|e| e.subject == s)
            .map(|e| e.event_id)
            .collect();
        let want: Vec<_> = events
            .iter()
            .filter(|e| e.subject == s)
            .map(|e| e.event_id)
            .collect();
        assert_eq!(got, want, "subject {s} in order");
    }
}
