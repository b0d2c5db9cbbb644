//! Scenarios of one delivery's fate: lost acks, poison, killers, multi-line reasons.

use std::time::Duration;

use futures::StreamExt;
use idem_engine::Acker;
use idem_engine::{
    consumer, ConsumerConfig, Delivery, Gate, GateConfig, OutcomeKind, RejectReason,
};

use super::helpers::{
    consume_all, drain, effects, fresh_name, plain_bodies, submissions, take, wait_pending,
    LostAck, Plain,
};
use super::BrokerUnderTest;
use crate::harness::{EffectHandlerFor, TestStore};
use crate::memory::MemoryStore;

/// Publish N submissions and D exact duplicates; consume part of them with every ack lost
/// and drop the consumer (a crash after the commit, before the ack); the broker
/// redelivers; a new consumer skips the committed ones as duplicates. End: exactly N
/// effects, nothing left to settle.
pub async fn crash_after_commit_before_ack<B: BrokerUnderTest, S: TestStore>(broker: &B, store: S) {
    const N: usize = 200;
    const D: usize = 50;
    const CRASH_AFTER: usize = 60;
    let name = fresh_name("crash");
    let (distinct, ledger) = submissions(&name, N);
    let mut bodies = distinct.clone();
    bodies.extend_from_slice(&distinct[..D]);
    let total = bodies.len() as u64;
    broker
        .publish_raw(&name, &bodies, &[])
        .await
        .expect("publish");
    assert_eq!(
        wait_pending(broker, &name, total).await,
        total,
        "all published"
    );

    // Phase 1: the first CRASH_AFTER deliveries commit, and every ack is lost. (The
    // prefetch must hold them all: unacked deliveries use up RabbitMQ's prefetch.)
    let first = broker
        .consume(&name, 2 * CRASH_AFTER)
        .await
        .expect("connect consumer")
        .map(|r| {
            r.map(|d| Delivery {
                payload: d.payload,
                headers: d.headers,
                attempt: d.attempt,
                acker: LostAck(d.acker),
            })
        })
        .take(CRASH_AFTER);
    let gate = Gate::new(store.clone(), EffectHandlerFor::<S>::new());
    let crashed = consumer::run(
        &gate,
        first,
        ConsumerConfig::new(1, 1),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("phase 1");
    // The consumer, its connection and every acker are gone now: the crash. A broker
    // without an order (SQS) may hand out a duplicate among the first CRASH_AFTER.
    assert_eq!(
        crashed.processed + crashed.duplicates,
        CRASH_AFTER as u64,
        "{crashed:?}"
    );
    assert_eq!(effects(&store).await.len() as u64, crashed.processed);
    // Nothing was acked: everything is still the broker's to deliver.
    assert_eq!(
        wait_pending(broker, &name, total).await,
        total,
        "no ack reached the broker"
    );

    // Phase 2: a new consumer, in batches: the broker redelivers the committed ones.
    let stats = consume_all(broker, &name, &store, 2, 10).await;
    assert_eq!(stats.processed, N as u64 - crashed.processed, "{stats:?}");
    assert!(
        stats.duplicates >= total - stats.processed,
        "every redelivery of a committed submission is a duplicate: {stats:?}"
    );
    assert_eq!((stats.rejected, stats.failed), (0, 0), "{stats:?}");
    ledger.assert_exactly_once(&effects(&store).await);
    assert_eq!(
        wait_pending(broker, &name, 0).await,
        0,
        "nothing left to settle"
    );
}

/// A poison message is dead-lettered byte for byte with its reason (`malformed: …`, from
/// [`EffectHandlerFor`]); its neighbours are processed, and nothing is left to settle.
pub async fn poison_is_dead_lettered<B: BrokerUnderTest, S: TestStore>(broker: &B, store: S) {
    let name = fresh_name("poison");
    let (mut bodies, ledger) = submissions(&name, 2);
    let poison = b"{not a submission".to_vec();
    bodies.insert(1, poison.clone());
    broker
        .publish_raw(&name, &bodies, &[])
        .await
        .expect("publish");

    let stats = consume_all(broker, &name, &store, 1, 1).await;
    assert_eq!((stats.processed, stats.rejected), (2, 1), "{stats:?}");
    ledger.assert_exactly_once(&effects(&store).await);
    assert_eq!(
        wait_pending(broker, &name, 0).await,
        0,
        "poison not left behind"
    );

    // The dead-letter place holds the poison, byte for byte, with its reason.
    let dead = broker.dead_letter_name(&name);
    assert_eq!(wait_pending(broker, &dead, 1).await, 1, "one dead letter");
    let mut letters = broker.until_idle(
        broker
            .consume(&dead, 4)
            .await
            .expect("dead-letter consumer"),
        Duration::from_secs(5),
    );
    let letter = letters
        .next()
        .await
        .expect("a dead letter arrives")
        .expect("dead letter delivery");
    assert_eq!(letter.payload, poison);
    let reason = letter
        .header(broker.reason_header())
        .unwrap_or_else(|| panic!("reason header in {:?}", letter.headers));
    assert!(reason.starts_with("malformed: "), "{reason}");
}

/// A message that kills its consumer on every run (the gate's future is dropped with its
/// delivery while the handler runs, and the consumer with it, as the process's death
/// would: [`BrokerUnderTest::die`]) is redelivered with its attempt counted by the broker,
/// and dead-lettered by the gate, unrun, once its recorded runs reach `max_attempts` —
/// instead of being run for ever. The adapter's attempt must count runs
/// ([`Acker::attempt_counts_runs`]): the gate's defaults record each rerun in the store
/// before it runs.
pub async fn a_killer_is_dead_lettered_unrun<B: BrokerUnderTest>(broker: &B) {
    let name = fresh_name("killer");
    let body = plain_bodies(&name, 1).remove(0);
    broker
        .publish_raw(&name, std::slice::from_ref(&body), &[])
        .await
        .expect("publish");
    let store = MemoryStore::new();
    let max_attempts = 2;
    let limits = GateConfig::default().with_max_attempts(max_attempts);
    let killer = Plain {
        slow: Duration::from_secs(3600),
        ..Plain::default()
    };
    for run in 1..=max_attempts {
        // A process of its own, which dies while the handler runs.
        let gate = Gate::with_config(store.clone(), killer, limits.clone());
        let mut stream = broker.consume(&name, 4).await.expect("connect");
        let d = take(&mut stream, 1).await.remove(0);
        assert_eq!(d.attempt, Some(run), "the broker counts each death");
        assert!(d.acker.attempt_counts_runs());
        let mut running = Box::pin(gate.process(d));
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut running)
                .await
                .is_err(),
            "the handler runs until the process dies"
        );
        // The process dies: its connection first, then what it held, unsettled (an
        // acker dropped in a live process hands its delivery back, which RabbitMQ
        // counts as a delivery of its own; a dead process sends nothing).
        broker.die(stream).await;
        drop(running);
    }
    let gate = Gate::with_config(store.clone(), Plain::default(), limits);
    let mut stream = broker.consume(&name, 4).await.expect("connect");
    let d = take(&mut stream, 1).await.remove(0);
    assert_eq!(d.attempt, Some(max_attempts + 1));
    let o = gate.process(d).await;
    assert_eq!(o.kind(), OutcomeKind::Rejected, "{o:?}");
    assert!(o.settle_error().is_none(), "{o:?}");
    assert!(store.rows("done").is_empty(), "the handler did not run");
    let mut letters = broker
        .consume(&broker.dead_letter_name(&name), 4)
        .await
        .expect("dead-letter consumer");
    let letter = take(&mut letters, 1).await.remove(0);
    assert_eq!(letter.payload, body);
    let reason = letter
        .header(broker.reason_header())
        .unwrap_or_default()
        .to_owned();
    assert!(reason.contains("not run again"), "{reason}");
    assert!(
        drain(&mut stream, broker.idle()).await.is_empty(),
        "settled: not delivered again"
    );
}

/// A reason on several lines — a handler's multi-line error, after its attempts — is
/// dead-lettered like any other, and forges no header (on NATS on one line: a header line
/// ends at CR or LF, and async-nats panicked on either, so the delivery looped through a
/// crashing consumer).
pub async fn a_reason_on_several_lines_is_dead_lettered<B: BrokerUnderTest>(broker: &B) {
    let name = fresh_name("lines");
    let body = b"{\"award_id\":\"A-1\"}".to_vec();
    broker
        .publish_raw(&name, std::slice::from_ref(&body), &[])
        .await
        .expect("publish");
    let mut deliveries = broker.consume(&name, 4).await.expect("connect consumer");
    let d = take(&mut deliveries, 1).await.remove(0);
    let reason = RejectReason::new(
        "attempts_exhausted",
        "5 attempts; the last failed with: upstream said\r\n  line two\nNats-Msg-Id: forged",
    );
    d.acker
        .dead_letter(&d.payload, &d.headers, &reason)
        .await
        .expect("dead-lettered");
    drop(deliveries);
    assert_eq!(wait_pending(broker, &name, 0).await, 0, "settled");

    let dead = broker.dead_letter_name(&name);
    let mut letters = broker.until_idle(
        broker
            .consume(&dead, 4)
            .await
            .expect("dead-letter consumer"),
        Duration::from_secs(5),
    );
    let letter = take(&mut letters, 1).await.remove(0);
    assert_eq!(letter.payload, body);
    let got = letter
        .header(broker.reason_header())
        .unwrap_or_else(|| panic!("reason header in {:?}", letter.headers));
    assert!(
        got.starts_with("attempts_exhausted: 5 attempts; the last failed with: upstream said"),
        "{got:?}"
    );
    assert!(
        got.contains("line two") && got.contains("forged"),
        "{got:?}"
    );
    assert!(
        !letter
            .headers
            .iter()
            .any(|(k, v)| k.eq_ignore_ascii_case("Nats-Msg-Id") && v == "forged"),
        "a reason forged a header: {:?}",
        letter.headers
    );
}
