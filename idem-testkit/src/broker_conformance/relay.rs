//! Scenarios through the outbox and the relay.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use async_trait::async_trait;
use idem_engine::outbox::EVENT_ID_HEADER;
use idem_engine::{
    consumer, ConsumerConfig, Gate, Handler, HandlerError, Headers, IdempotencyKey, OutboxEvent,
    OutboxSource, PublishError, Publisher, RejectReason, Relay, Submission,
};

use super::helpers::{consume_all, fresh_name, submissions, take, wait_pending};
use super::BrokerUnderTest;
use crate::harness::TestStore;
use crate::memory::{MemoryStore, MemoryTx};

#[cfg(doc)]
use idem_engine::Delivery;

/// Downstream: dedups outbox events by their event id header.
#[derive(Debug, Clone, Copy)]
struct EventHandler;

#[async_trait]
impl Handler<MemoryTx> for EventHandler {
    type Input = ();

    fn identify(&self, _payload: &[u8], headers: &Headers) -> Result<Submission<()>, RejectReason> {
        let id = headers
            .iter()
            .find(|(k, _)| k == EVENT_ID_HEADER)
            .map(|(_, v)| v.as_str())
            .ok_or_else(|| RejectReason::new("missing_event_id", "no event id header"))?;
        let key: IdempotencyKey = id.parse().map_err(RejectReason::from)?;
        Ok(Submission {
            key,
            subject: "event".into(),
            input: (),
        })
    }

    async fn handle(&self, tx: &mut MemoryTx, sub: &Submission<()>) -> Result<(), HandlerError> {
        let mut row = BTreeMap::new();
        row.insert("event_id".to_owned(), sub.key.to_hex());
        tx.insert("events", row);
        Ok(())
    }
}

/// Remembers what it published, to republish it as a crashed relay would.
struct Recording<P> {
    inner: P,
    seen: Mutex<Vec<OutboxEvent>>,
}

#[async_trait]
impl<P: Publisher> Publisher for Recording<P> {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        self.inner.publish(events).await?;
        self.seen
            .lock()
            .expect("lock")
            .extend(events.iter().cloned());
        Ok(())
    }
}

/// Upstream consume (into `store`, whose outbox `source` relays) → outbox → relay (with a
/// republish, as after a relay crash between publishing and marking) → a downstream
/// consumer that dedups by event id: each event has exactly one downstream effect, and
/// the republished ones are duplicates (or never delivered, where the broker dedups event
/// ids: [`BrokerUnderTest::dedups_event_ids`]).
pub async fn relay_delivers_each_event_once<B, S, O>(broker: &B, store: S, source: O)
where
    B: BrokerUnderTest,
    S: TestStore,
    O: OutboxSource,
{
    const N: usize = 20;
    const REPUBLISHED: usize = 5;
    let up = fresh_name("relay-up");
    let down = fresh_name("relay-down");
    let (bodies, _ledger) = submissions(&up, N);
    broker
        .publish_raw(&up, &bodies, &[])
        .await
        .expect("publish");
    let stats = consume_all(broker, &up, &store, 1, 5).await;
    assert_eq!(stats.processed, N as u64, "{stats:?}");

    let publisher = Recording {
        inner: broker.publisher(&down).await.expect("publisher"),
        seen: Mutex::new(Vec::new()),
    };
    let relay = Relay::new(source, publisher, 7);
    let mut published = 0;
    loop {
        let n = relay.run_once().await.expect("relay");
        if n == 0 {
            break;
        }
        published += n;
    }
    assert_eq!(published, N, "one event per submission");
    let seen = relay.publisher().seen.lock().expect("lock").clone();
    let ids: BTreeSet<String> = seen.iter().map(|e| e.event_id.to_string()).collect();
    assert_eq!(ids.len(), N);
    // A relay that crashed before marking publishes the same events again.
    relay
        .publisher()
        .inner
        .publish(&seen[..REPUBLISHED])
        .await
        .expect("republish");

    let downstream = MemoryStore::new();
    let gate = Gate::new(downstream.clone(), EventHandler);
    let deliveries = broker.consume(&down, 8).await.expect("downstream");
    let dstats = consumer::run(
        &gate,
        broker.until_idle(deliveries, broker.idle()),
        ConsumerConfig::new(1, 4),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("downstream run");
    assert_eq!(dstats.processed, N as u64, "{dstats:?}");
    let expected_dups = if broker.dedups_event_ids() {
        0
    } else {
        REPUBLISHED as u64
    };
    assert_eq!(dstats.duplicates, expected_dups, "{dstats:?}");
    let got: BTreeSet<String> = downstream
        .rows("events")
        .into_iter()
        .filter_map(|r| r.get("event_id").cloned())
        .collect();
    assert_eq!(got, ids, "each event exactly once downstream");
    assert_eq!(downstream.rows("events").len(), N);
    assert_eq!(wait_pending(broker, &down, 0).await, 0);
}

/// A W3C `traceparent` crosses the broker both ways: published as a header, it reaches
/// the consumer's [`Delivery::headers`]; the gate stores it (the same trace id, a new
/// parent id) on the outbox event of `store`; the relay (over `source`, that store's
/// outbox) sends it as the `traceparent` header, which the downstream consumer reads
/// back. An untraced submission stays untraced.
pub async fn traceparent_crosses_the_broker<B, S, O>(broker: &B, store: S, source: O)
where
    B: BrokerUnderTest,
    S: TestStore,
    O: OutboxSource,
{
    use idem_engine::{OutboxBatch as _, TraceParent};

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let sent: TraceParent = TP.parse().expect("valid");
    let up = fresh_name("trace-up");
    let down = fresh_name("trace-down");
    let (bodies, _ledger) = submissions(&up, 2);
    broker
        .publish_raw(
            &up,
            &bodies[..1],
            &[("traceparent".to_owned(), TP.to_owned())],
        )
        .await
        .expect("publish the traced submission");
    broker
        .publish_raw(&up, &bodies[1..], &[])
        .await
        .expect("publish the untraced one");
    let stats = consume_all(broker, &up, &store, 1, 5).await;
    assert_eq!(stats.processed, 2, "{stats:?}");

    let batch = source.lease(10).await.expect("lease");
    let stored: Vec<Option<TraceParent>> = batch.events().iter().map(|e| e.traceparent).collect();
    batch.release().await.expect("release");
    assert_eq!(stored.len(), 2);
    let traced: Vec<TraceParent> = stored.iter().flatten().copied().collect();
    assert_eq!(traced.len(), 1, "one event traced: {stored:?}");
    let stored = traced[0];
    assert_eq!(stored.trace_id(), sent.trace_id(), "the delivery's trace");
    assert_ne!(
        stored.parent_id(),
        sent.parent_id(),
        "the consumer's span as parent"
    );

    let relay = Relay::new(
        source,
        broker.publisher(&down).await.expect("publisher"),
        10,
    );
    assert_eq!(relay.run_once().await.expect("relay"), 2);
    let mut downstream = broker.consume(&down, 8).await.expect("downstream");
    let got = take(&mut downstream, 2).await;
    let headers: Vec<Option<String>> = got
        .iter()
        .map(|d| d.header("traceparent").map(str::to_owned))
        .collect();
    assert_eq!(
        headers.iter().flatten().collect::<Vec<_>>(),
        vec![&stored.to_string()],
        "the relay's message carries the stored traceparent: {headers:?}"
    );
    // Left unsettled: the downstream queue is this test's own.
    drop(got);
}
