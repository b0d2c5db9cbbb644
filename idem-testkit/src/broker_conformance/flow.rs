//! Scenarios of flow: deferrals, slow handlers, a full prefetch, refusals, killers in one
//! window.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::Stream;
use futures::StreamExt;
use idem_engine::{
    consumer, Acker, ConsumerConfig, Delivery, Gate, GateConfig, Handler, HandlerError, Headers,
    IdempotencyKey, OutboxEvent, OutcomeKind, Publisher, RejectReason, Submission,
};

use super::helpers::{bodies_of, drain, fresh_name, plain_bodies, take, wait_pending, Plain};
use super::BrokerUnderTest;
use crate::memory::{MemoryStore, MemoryTx};

/// A deferral ([`Acker::defer`]: a key held by another transaction, a store outage) is
/// not a delivery: deferred 25 times — past the delivery limits brokers apply by default
/// (NATS `max_deliver`, a RabbitMQ quorum queue's 20) — the message comes back through
/// the consumer each time with the same attempt; a nack after that is an attempt (2);
/// then it is processed once and nothing is left to settle.
pub async fn a_deferral_is_not_a_delivery<B: BrokerUnderTest>(broker: &B) {
    let name = fresh_name("defer");
    let body = plain_bodies(&name, 1).remove(0);
    broker
        .publish_raw(&name, std::slice::from_ref(&body), &[])
        .await
        .expect("publish");
    let mut stream = broker.consume(&name, 4).await.expect("connect");
    let mut d = take(&mut stream, 1).await.remove(0);
    assert_eq!(d.attempt, Some(1));
    for i in 1..=25 {
        d.acker
            .defer(Duration::from_millis(10))
            .await
            .unwrap_or_else(|e| panic!("deferral {i}: {e}"));
        d = take(&mut stream, 1).await.remove(0);
        assert_eq!(d.payload, body, "deferral {i}");
        assert_eq!(
            d.attempt,
            Some(1),
            "deferral {i}: a deferral is not an attempt"
        );
    }
    d.acker
        .nack(Some(Duration::from_millis(100)))
        .await
        .expect("nack");
    let d = take(&mut stream, 1).await.remove(0);
    assert_eq!(d.payload, body);
    assert_eq!(d.attempt, Some(2), "a nack is an attempt");
    let store = MemoryStore::new();
    let o = Gate::new(store.clone(), Plain::default()).process(d).await;
    assert_eq!(o.kind(), OutcomeKind::Processed, "{o:?}");
    assert!(o.settle_error().is_none(), "{o:?}");
    assert_eq!(store.rows("done").len(), 1);
    assert!(
        drain(&mut stream, broker.idle()).await.is_empty(),
        "settled: not delivered again"
    );
    assert_eq!(wait_pending(broker, &name, 0).await, 0, "nothing left");
}

/// A handler slower than the broker's lease (`lease`: NATS `ack_wait`, Redis Streams
/// `min_idle`, SQS's visibility timeout, as the broker under test is configured): four
/// deliveries taken, the first in work for 3.5 leases while three wait in the consumer's
/// hands, and a second consumer of the same source polls all along: nothing is
/// redelivered to either, and each is processed once.
pub async fn a_slow_handler_causes_no_redelivery<B: BrokerUnderTest>(broker: &B, lease: Duration) {
    let name = fresh_name("slow");
    broker
        .publish_raw(&name, &plain_bodies(&name, 4), &[])
        .await
        .expect("publish");
    let mut owner = broker.consume(&name, 8).await.expect("owner");
    let taken = take(&mut owner, 4).await;
    let hold = lease.mul_f64(3.5);
    let mut other = broker.consume(&name, 8).await.expect("other");
    let watch = hold + Duration::from_secs(2);
    let watcher = tokio::spawn(async move {
        let seen = drain(&mut other, watch).await;
        bodies_of(&seen)
    });
    slow_handler_causes_no_redelivery(owner, taken, hold).await;
    assert_eq!(
        watcher.await.expect("watcher"),
        Vec::<String>::new(),
        "delivered to the other consumer while held"
    );
    assert_eq!(wait_pending(broker, &name, 0).await, 0, "nothing left");
}

/// A handler slower than the broker's lease, on one consumer: deliveries taken (some in
/// work, the rest waiting in the consumer's hands) for `hold` — several lease periods —
/// are not redelivered meanwhile, and all settle once. `taken` are the first deliveries
/// of `stream`, a fresh consumer of a source that holds exactly those.
pub async fn slow_handler_causes_no_redelivery<S, A, E>(
    mut stream: S,
    taken: Vec<Delivery<A>>,
    hold: Duration,
) where
    S: Stream<Item = Result<Delivery<A>, E>> + Unpin,
    A: Acker,
    E: std::fmt::Debug,
{
    let n = taken.len();
    assert!(
        taken.iter().all(|d| d.attempt == Some(1)),
        "first deliveries: {:?}",
        taken.iter().map(|d| d.attempt).collect::<Vec<_>>()
    );
    let store = MemoryStore::new();
    let gate = Gate::new(
        store.clone(),
        Plain {
            fail: false,
            slow: hold,
        },
    );
    // The handler runs on the first delivery while the rest wait, and the stream is
    // polled all along: a redelivery would show up here.
    let mut it = taken.into_iter();
    let first = it.next().expect("one delivery");
    let (outcome, during) = tokio::join!(gate.process(first), drain(&mut stream, hold));
    assert!(outcome.settle_error().is_none(), "{outcome:?}");
    assert!(
        during.is_empty(),
        "redelivered while the handler worked: {:?}",
        bodies_of(&during)
    );
    let rest: Vec<Delivery<A>> = it.collect();
    let gate = Gate::new(store.clone(), Plain::default());
    for o in gate.process_batch(rest).await {
        assert!(o.settle_error().is_none(), "{o:?}");
    }
    let after = drain(&mut stream, Duration::from_secs(3)).await;
    assert!(after.is_empty(), "redelivered: {:?}", bodies_of(&after));
    assert_eq!(store.rows("done").len(), n, "each processed once");
}

/// Deferrals that fill the prefetch stop the stream from taking new deliveries until
/// they come back: `stream` is a fresh consumer with a prefetch of 8 of a source that
/// holds 20 published messages. Its first 8 are deferred for 3 s; until they come back at
/// most the 8 of the prefetch (fetched ahead already, where the adapter prefetches in the
/// background) may come, not the other 12; then the 8 come back, each with the attempt
/// it had (a deferral is no delivery), and the rest follow. Each settles through a gate.
pub async fn deferrals_that_fill_the_prefetch_stop_taking<S, A, E>(stream: &mut S)
where
    S: Stream<Item = Result<Delivery<A>, E>> + Unpin,
    A: Acker,
    E: std::fmt::Debug,
{
    let first = take(stream, 8).await;
    let mut deferred: Vec<(Vec<u8>, Option<u32>)> = first
        .iter()
        .map(|d| (d.payload.clone(), d.attempt))
        .collect();
    let back_at = Instant::now() + Duration::from_secs(3);
    for d in first {
        d.acker.defer(Duration::from_secs(3)).await.expect("defer");
    }
    let mut early = Vec::new();
    let before = back_at - Duration::from_millis(500);
    while let Ok(Some(d)) = tokio::time::timeout_at(before.into(), stream.next()).await {
        early.push(d.expect("delivery"));
    }
    assert!(
        early.len() <= 8,
        "{} new deliveries while the deferrals filled the prefetch of 8",
        early.len()
    );
    assert!(
        early
            .iter()
            .all(|d| !deferred.iter().any(|(p, _)| *p == d.payload)),
        "a deferral came back before its delay"
    );
    let rest = take(stream, 20 - early.len()).await;
    let mut back: Vec<(Vec<u8>, Option<u32>)> = rest
        .iter()
        .filter(|d| deferred.iter().any(|(p, _)| *p == d.payload))
        .map(|d| (d.payload.clone(), d.attempt))
        .collect();
    back.sort();
    deferred.sort();
    assert_eq!(back, deferred, "each deferral back once, with its attempt");
    let gate = Gate::new(MemoryStore::new(), Plain::default());
    for o in gate
        .process_batch(early.into_iter().chain(rest).collect())
        .await
    {
        assert!(o.settle_error().is_none(), "{o:?}");
    }
}

/// An event larger than the broker takes (`over` bytes of padding) is refused for good —
/// not retryable, so the relay moves it aside rather than retrying its batch forever —
/// and the publisher goes on with the next event.
pub async fn an_oversized_event_is_refused_for_good(publisher: &impl Publisher, over: usize) {
    let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").expect("key");
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(over));
    let err = publisher
        .publish(&[OutboxEvent::new(key, "recorded", "A-1", big)])
        .await
        .expect_err("refused");
    assert!(!err.is_retryable(), "{err}");
    publisher
        .publish(&[OutboxEvent::new(key, "recorded", "A-1", "{}")])
        .await
        .expect("the next event goes");
}

/// A handler that kills its process on the bodies it is given (it signals `started` and
/// runs until the process dies) and records every other body in `done`.
#[derive(Debug, Clone)]
struct Killers {
    bodies: BTreeSet<String>,
    started: Arc<tokio::sync::Notify>,
}

#[async_trait]
impl Handler<MemoryTx> for Killers {
    type Input = ();

    fn identify(&self, payload: &[u8], headers: &Headers) -> Result<Submission<()>, RejectReason> {
        Plain::default().identify(payload, headers)
    }

    async fn handle(&self, tx: &mut MemoryTx, sub: &Submission<()>) -> Result<(), HandlerError> {
        if self.bodies.contains(&sub.subject) {
            self.started.notify_one();
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        Plain::default().handle(tx, sub).await
    }
}

/// Three messages that kill their consumer, first in a window of ten (`broker` must be
/// configured with a limit on deliveries of 6, twice the gate's `max_attempts` of 3: NATS
/// `max_deliver`, a quorum queue's `delivery_limit`, SQS's `maxReceiveCount`): process
/// after process dies running one of them (its connection first, then what it held,
/// unsettled), until the gate dead-letters each, unrun, after its three runs. The seven
/// neighbours are each processed exactly once — none reaches the broker's limit
/// (stranded or dead-lettered by the broker without a reason) — and the killers are
/// dead-lettered with the gate's reason.
pub async fn killers_in_one_window_strand_no_neighbour<B: BrokerUnderTest>(broker: &B) {
    let name = fresh_name("killers");
    let bodies = plain_bodies(&name, 10);
    broker
        .publish_raw(&name, &bodies, &[])
        .await
        .expect("publish");
    let killers: BTreeSet<String> = bodies[..3]
        .iter()
        .map(|b| String::from_utf8(b.clone()).expect("utf-8"))
        .collect();
    let store = MemoryStore::new();
    let limits = GateConfig::default().with_max_attempts(3);
    let mut deaths = 0;
    loop {
        assert!(
            deaths <= 12,
            "more deaths than three killers of three runs each"
        );
        // A process of its own.
        let started = Arc::new(tokio::sync::Notify::new());
        let handler = Killers {
            bodies: killers.clone(),
            started: Arc::clone(&started),
        };
        let gate = Gate::with_config(store.clone(), handler, limits.clone());
        let stream = broker.consume(&name, 10).await.expect("connect");
        let run = consumer::run(
            &gate,
            broker.until_idle(stream, Duration::from_secs(6)),
            ConsumerConfig::new(4, 1),
            std::future::pending::<()>(),
            |_| {},
        );
        tokio::select! {
            stats = run => {
                stats.expect("run");
                break;
            }
            () = started.notified() => {
                // The process dies while the killer runs.
                deaths += 1;
            }
        }
    }
    let done: BTreeSet<String> = store
        .rows("done")
        .iter()
        .map(|r| r.get("body").cloned().unwrap_or_default())
        .collect();
    let neighbours: BTreeSet<String> = bodies[3..]
        .iter()
        .map(|b| String::from_utf8(b.clone()).expect("utf-8"))
        .collect();
    assert_eq!(
        done, neighbours,
        "every neighbour processed ({deaths} deaths)"
    );
    let mut letters = broker
        .consume(&broker.dead_letter_name(&name), 10)
        .await
        .expect("dead-letter consumer");
    let letters = drain(&mut letters, Duration::from_secs(3)).await;
    let lettered: BTreeSet<String> = letters
        .iter()
        .map(|l| String::from_utf8(l.payload.clone()).expect("utf-8"))
        .collect();
    assert_eq!(
        lettered, killers,
        "the killers, and only they, dead-lettered"
    );
    for l in &letters {
        let reason = l.header(broker.reason_header()).unwrap_or_default();
        assert!(reason.contains("not run again"), "{reason}");
    }
    assert_eq!(wait_pending(broker, &name, 0).await, 0, "nothing left");
}
