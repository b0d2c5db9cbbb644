//! The broker conformance suite: the scenarios every adapter runs, on the real broker
//! and the real Postgres store — a crash after the commit and before the ack, a poison
//! message, a reason on several lines, a relay run, a traceparent both ways, a deferral
//! that costs no delivery, a message that kills its consumer, and (where the broker
//! leases deliveries) a handler slower than the lease. Each broker's test file runs them
//! all with one line, [`conformance!`], so a new adapter gets the same proof by adding
//! that line; what is particular to one broker stays in its own file.
//!
//! Addresses come from `IDEM_TEST_*` variables with the local defaults; a missing broker
//! or database fails the test. Each test uses its own random queue/stream name and its
//! own Postgres schema.

#![allow(dead_code, unreachable_pub, unused_macros, unused_imports)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use idem_broker::any::{
    pending_count, publish_raw, AnyAcker, AnyConsumer, AnyPublisher, BrokerUrl,
};
use idem_broker::{dead_letter_name, until_idle, DEAD_LETTER_REASON_HEADER};
use idem_core::outbox::EVENT_ID_HEADER;
use idem_core::{
    consumer, AckError, AckProof, Acker, ConsumerConfig, ConsumerStats, Delivery, Gate, Handler,
    HandlerError, Headers, IdempotencyKey, OutboxEvent, PublishError, Publisher, RejectReason,
    Relay, Submission,
};
use idem_grant::GrantDb;
use idem_store_postgres::{PgConfig, PgOutboxSource, PgStore};
use idem_testkit::{Effect, Ledger, MemoryStore, MemoryTx};

/// Per-broker facts the scenarios need.
#[derive(Debug, Clone)]
pub struct Broker {
    /// The broker URL (with test settings such as a short ack wait).
    pub url: BrokerUrl,
    /// How long a consumer waits for more before it is done: longer than the broker's
    /// redelivery delay of an unacked delivery.
    pub idle: Duration,
    /// Whether the broker itself drops a republished event id (JetStream `Nats-Msg-Id`).
    pub dedups_event_ids: bool,
}

impl Broker {
    /// `var` or `default`, with `settings` appended to the query.
    pub fn from_env(
        var: &str,
        default: &str,
        settings: &str,
        idle: Duration,
        dedups: bool,
    ) -> Self {
        let base = std::env::var(var).unwrap_or_else(|_| default.to_owned());
        let url = if settings.is_empty() {
            base
        } else if base.contains('?') {
            format!("{base}&{settings}")
        } else {
            format!("{base}?{settings}")
        };
        Self {
            url: BrokerUrl::parse(&url).unwrap_or_else(|e| panic!("{var}: {e}")),
            idle,
            dedups_event_ids: dedups,
        }
    }
}

/// Runs a scenario, failing it (rather than hanging) after two minutes.
pub async fn within<F: std::future::Future>(scenario: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(120), scenario)
        .await
        .expect("the scenario did not finish within 2 minutes")
}

/// A fresh queue/stream name.
pub fn fresh_name(prefix: &str) -> String {
    format!("idem-test-{prefix}-{:08x}", rand::random::<u32>())
}

/// The Postgres server under test.
pub fn pg_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A migrated grant store on a new schema.
pub async fn fresh_pg() -> PgStore {
    fresh_pg_with(|c| c).await
}

/// A migrated grant store on a new schema, its configuration adjusted by `configure`.
pub async fn fresh_pg_with(configure: impl FnOnce(PgConfig) -> PgConfig) -> PgStore {
    let schema = format!(
        "idem_t_{}_{:08x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
        rand::random::<u32>()
    );
    let store = PgStore::connect(
        &pg_url(),
        configure(
            PgConfig::new(schema)
                .expect("schema name")
                .with_max_connections(6),
        ),
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "cannot reach Postgres at {} (IDEM_TEST_POSTGRES_URL): {e}",
            pg_url()
        )
    });
    store.migrate_grants().await.expect("migrate");
    store
}

/// `n` distinct grant submissions; returns the bodies and the exactly-once ledger.
pub fn submissions(tag: &str, n: usize) -> (Vec<Vec<u8>>, Ledger) {
    let mut ledger = Ledger::new();
    let mut bodies = Vec::with_capacity(n);
    for i in 0..n {
        let award = format!("T-{tag}-{i:05}");
        let ts = "2026-07-01T09:00:00Z";
        let amount = 1_000 + i as i64;
        let body = format!(
            r#"{{"award_id": "{award}", "submission_timestamp": "{ts}", "amount_cents": {amount}}}"#
        )
        .into_bytes();
        let key = IdempotencyKey::derive(&award, ts, &body).expect("key");
        ledger.expect(key, award, amount);
        bodies.push(body);
    }
    (bodies, ledger)
}

/// The store's disbursements as effects for the ledger.
pub async fn effects(store: &PgStore) -> Vec<Effect> {
    store
        .ledger()
        .await
        .expect("read disbursements")
        .into_iter()
        .map(|r| Effect {
            key: r.key,
            subject: r.award_id,
            amount: r.amount_cents,
        })
        .collect()
}

/// Waits (up to 10 s) until `name` has `want` left to settle; returns the last count.
pub async fn wait_pending(url: &BrokerUrl, name: &str, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = pending_count(url, name).await.expect("pending count");
        if n == want || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An acker whose ack "leaves" and never arrives: the process died after the commit
/// and before the ack.
#[derive(Debug)]
pub struct LostAck(AnyAcker);

#[async_trait]
impl Acker for LostAck {
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        drop(self.0);
        Ok(())
    }

    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.0.nack(delay).await
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        self.0.dead_letter(payload, headers, reason).await
    }
}

/// Consumes `name` into `store` until the broker is quiet for `broker.idle`.
pub async fn consume_all(
    broker: &Broker,
    name: &str,
    store: &PgStore,
    concurrency: usize,
    batch: usize,
) -> ConsumerStats {
    let deliveries = AnyConsumer::connect(&broker.url, name, 2 * concurrency * batch)
        .await
        .expect("connect consumer");
    let gate = Gate::new(store.clone(), store.grant_handler());
    consumer::run(
        &gate,
        until_idle(deliveries, broker.idle),
        ConsumerConfig::new(concurrency, batch),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("consumer run")
}

/// Publish N submissions and D exact duplicates; consume part of them with every ack lost
/// and drop the consumer (a crash after the commit, before the ack); the broker
/// redelivers; a new consumer skips the committed ones as duplicates. End: exactly N
/// disbursements, nothing left to settle.
pub async fn crash_after_commit_before_ack(broker: Broker) {
    const N: usize = 200;
    const D: usize = 50;
    const CRASH_AFTER: usize = 60;
    let name = fresh_name("crash");
    let store = fresh_pg().await;
    let (distinct, ledger) = submissions(&name, N);
    let mut bodies = distinct.clone();
    bodies.extend_from_slice(&distinct[..D]);
    let total = bodies.len() as u64;
    publish_raw(&broker.url, &name, &bodies)
        .await
        .expect("publish");
    assert_eq!(
        wait_pending(&broker.url, &name, total).await,
        total,
        "all published"
    );

    // Phase 1: the first CRASH_AFTER deliveries commit, and every ack is lost. (The
    // prefetch must hold them all: unacked deliveries use up RabbitMQ's prefetch.)
    let first = AnyConsumer::connect(&broker.url, &name, 2 * CRASH_AFTER)
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
    let gate = Gate::new(store.clone(), store.grant_handler());
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
        wait_pending(&broker.url, &name, total).await,
        total,
        "no ack reached the broker"
    );

    // Phase 2: a new consumer, in batches: the broker redelivers the committed ones.
    let stats = consume_all(&broker, &name, &store, 2, 10).await;
    assert_eq!(stats.processed, N as u64 - crashed.processed, "{stats:?}");
    assert!(
        stats.duplicates >= total - stats.processed,
        "every redelivery of a committed submission is a duplicate: {stats:?}"
    );
    assert_eq!((stats.rejected, stats.failed), (0, 0), "{stats:?}");
    ledger.assert_exactly_once(&effects(&store).await);
    assert_eq!(
        wait_pending(&broker.url, &name, 0).await,
        0,
        "nothing left to settle"
    );
}

/// A poison message is dead-lettered with its reason; its neighbours are processed.
pub async fn poison_is_dead_lettered(broker: Broker) {
    let name = fresh_name("poison");
    let store = fresh_pg().await;
    let (mut bodies, ledger) = submissions(&name, 2);
    let poison = b"{not json".to_vec();
    bodies.insert(1, poison.clone());
    publish_raw(&broker.url, &name, &bodies)
        .await
        .expect("publish");

    let stats = consume_all(&broker, &name, &store, 1, 1).await;
    assert_eq!((stats.processed, stats.rejected), (2, 1), "{stats:?}");
    ledger.assert_exactly_once(&effects(&store).await);
    assert_eq!(
        wait_pending(&broker.url, &name, 0).await,
        0,
        "poison not left behind"
    );

    // The dead-letter place holds the poison, byte for byte, with its reason.
    let dead = dead_letter_name(&name);
    assert_eq!(
        wait_pending(&broker.url, &dead, 1).await,
        1,
        "one dead letter"
    );
    let mut letters = until_idle(
        AnyConsumer::connect(&broker.url, &dead, 4)
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
        .header(DEAD_LETTER_REASON_HEADER)
        .unwrap_or_else(|| panic!("reason header in {:?}", letter.headers));
    assert!(reason.starts_with("not_json: "), "{reason}");
}

/// A message that kills its consumer on every run (the gate's future is dropped with its
/// delivery while the handler runs, and the consumer with it, as the process's death
/// would) is redelivered with its attempt counted by the broker, and dead-lettered by the
/// gate, unrun, once its recorded runs reach `max_attempts` — instead of being run for
/// ever. For a broker whose attempt counts runs (`Acker::attempt_counts_runs`): the gate's
/// defaults record each rerun in the store before it runs.
pub async fn a_killer_is_dead_lettered_unrun(broker: Broker) {
    use idem_core::{GateConfig, OutcomeKind};
    let name = fresh_name("killer");
    let body = plain_bodies(&name, 1).remove(0);
    publish_raw(&broker.url, &name, std::slice::from_ref(&body))
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
        let mut stream = AnyConsumer::connect(&broker.url, &name, 4)
            .await
            .expect("connect");
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
        drop(stream);
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(running);
    }
    let gate = Gate::with_config(store.clone(), Plain::default(), limits);
    let mut stream = AnyConsumer::connect(&broker.url, &name, 4)
        .await
        .expect("connect");
    let d = take(&mut stream, 1).await.remove(0);
    assert_eq!(d.attempt, Some(max_attempts + 1));
    let o = gate.process(d).await;
    assert_eq!(o.kind(), OutcomeKind::Rejected, "{o:?}");
    assert!(o.settle_error().is_none(), "{o:?}");
    assert!(store.rows("done").is_empty(), "the handler did not run");
    let mut letters = AnyConsumer::connect(&broker.url, &dead_letter_name(&name), 4)
        .await
        .expect("dead-letter consumer");
    let letter = take(&mut letters, 1).await.remove(0);
    assert_eq!(letter.payload, body);
    let reason = letter
        .header(DEAD_LETTER_REASON_HEADER)
        .unwrap_or_default()
        .to_owned();
    assert!(reason.contains("not run again"), "{reason}");
    assert!(
        drain(&mut stream, broker.idle).await.is_empty(),
        "settled: not delivered again"
    );
}

/// A reason on several lines — a handler's multi-line error, after its attempts — is
/// dead-lettered like any other (on NATS on one line: a header line ends at CR or LF, and
/// async-nats panicked on either, so the delivery looped through a crashing consumer).
pub async fn a_reason_on_several_lines_is_dead_lettered(broker: Broker) {
    let name = fresh_name("lines");
    let body = b"{\"award_id\":\"A-1\"}".to_vec();
    publish_raw(&broker.url, &name, std::slice::from_ref(&body))
        .await
        .expect("publish");
    let mut deliveries = AnyConsumer::connect(&broker.url, &name, 4)
        .await
        .expect("connect consumer");
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
    assert_eq!(wait_pending(&broker.url, &name, 0).await, 0, "settled");

    let dead = dead_letter_name(&name);
    let mut letters = until_idle(
        AnyConsumer::connect(&broker.url, &dead, 4)
            .await
            .expect("dead-letter consumer"),
        Duration::from_secs(5),
    );
    let letter = take(&mut letters, 1).await.remove(0);
    assert_eq!(letter.payload, body);
    let got = letter
        .header(DEAD_LETTER_REASON_HEADER)
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
        tx.insert("events", row.into_iter().collect());
        Ok(())
    }
}

/// Remembers what it published, to republish it as a crashed relay would.
struct Recording {
    inner: AnyPublisher,
    seen: Mutex<Vec<OutboxEvent>>,
}

#[async_trait]
impl Publisher for Recording {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        self.inner.publish(events).await?;
        self.seen
            .lock()
            .expect("lock")
            .extend(events.iter().cloned());
        Ok(())
    }
}

/// Upstream consume → outbox → relay (with a republish, as after a relay crash between
/// publishing and marking) → a downstream consumer that dedups by event id: each event
/// has exactly one downstream effect.
pub async fn relay_delivers_each_event_once(broker: Broker) {
    const N: usize = 20;
    const REPUBLISHED: usize = 5;
    let up = fresh_name("relay-up");
    let down = fresh_name("relay-down");
    let store = fresh_pg().await;
    let (bodies, _ledger) = submissions(&up, N);
    publish_raw(&broker.url, &up, &bodies)
        .await
        .expect("publish");
    let stats = consume_all(&broker, &up, &store, 1, 5).await;
    assert_eq!(stats.processed, N as u64, "{stats:?}");

    let publisher = Recording {
        inner: AnyPublisher::connect(&broker.url, &down)
            .await
            .expect("publisher"),
        seen: Mutex::new(Vec::new()),
    };
    let relay = Relay::new(
        PgOutboxSource::new(store.clone(), Duration::from_millis(100)),
        publisher,
        7,
    );
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
    let deliveries = AnyConsumer::connect(&broker.url, &down, 8)
        .await
        .expect("downstream");
    let dstats = consumer::run(
        &gate,
        until_idle(deliveries, broker.idle),
        ConsumerConfig::new(1, 4),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("downstream run");
    assert_eq!(dstats.processed, N as u64, "{dstats:?}");
    let expected_dups = if broker.dedups_event_ids {
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
    assert_eq!(wait_pending(&broker.url, &down, 0).await, 0);
}

/// A W3C `traceparent` crosses this broker both ways: published with
/// `publish_raw_with_headers`, it reaches the consumer's `Delivery::headers`; the gate
/// stores it (the same trace id, a new parent id) on the outbox event in Postgres; the
/// relay's publisher sends it as the `traceparent` header, which the downstream consumer
/// reads back. An untraced submission stays untraced.
pub async fn traceparent_crosses_the_broker(broker: Broker) {
    use idem_core::{OutboxBatch as _, OutboxSource as _, TraceParent};

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let sent: TraceParent = TP.parse().expect("valid");
    let up = fresh_name("trace-up");
    let down = fresh_name("trace-down");
    let store = fresh_pg().await;
    let (bodies, _ledger) = submissions(&up, 2);
    let publisher = AnyPublisher::connect(&broker.url, &up)
        .await
        .expect("publisher");
    publisher
        .publish_raw_with_headers(&bodies[..1], &[("traceparent".to_owned(), TP.to_owned())])
        .await
        .expect("publish the traced submission");
    publisher
        .publish_raw(&bodies[1..])
        .await
        .expect("publish the untraced one");
    let stats = consume_all(&broker, &up, &store, 1, 5).await;
    assert_eq!(stats.processed, 2, "{stats:?}");

    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(100));
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
        AnyPublisher::connect(&broker.url, &down)
            .await
            .expect("publisher"),
        10,
    );
    assert_eq!(relay.run_once().await.expect("relay"), 2);
    let mut downstream = Box::pin(
        AnyConsumer::connect(&broker.url, &down, 8)
            .await
            .expect("downstream"),
    );
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

/// A deferral (`Acker::defer`: a key held by another transaction, a store outage) is
/// not a delivery: deferred 25 times — past the delivery limits brokers apply by default
/// (NATS `max_deliver`, a RabbitMQ quorum queue's 20) — the message comes back through
/// the consumer each time with the same attempt; a nack after that is an attempt (2);
/// then it is processed once and nothing is left to settle.
pub async fn a_deferral_is_not_a_delivery(broker: Broker) {
    use idem_core::OutcomeKind;
    let name = fresh_name("defer");
    let body = plain_bodies(&name, 1).remove(0);
    publish_raw(&broker.url, &name, std::slice::from_ref(&body))
        .await
        .expect("publish");
    let mut stream = AnyConsumer::connect(&broker.url, &name, 4)
        .await
        .expect("connect");
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
        drain(&mut stream, broker.idle).await.is_empty(),
        "settled: not delivered again"
    );
    assert_eq!(wait_pending(&broker.url, &name, 0).await, 0, "nothing left");
}

/// A handler slower than the broker's lease (`lease`: NATS `ack_wait`, Redis Streams
/// `min_idle`, SQS's visibility timeout): four deliveries taken, the first in work for
/// 3.5 leases while three wait in the consumer's hands, and a second consumer of the
/// same source polls all along: nothing is redelivered to either, and each is processed
/// once.
pub async fn a_slow_handler_causes_no_redelivery(broker: Broker, lease: Duration) {
    let name = fresh_name("slow");
    publish_raw(&broker.url, &name, &plain_bodies(&name, 4))
        .await
        .expect("publish");
    let mut owner = AnyConsumer::connect(&broker.url, &name, 8)
        .await
        .expect("owner");
    let taken = take(&mut owner, 4).await;
    let hold = lease.mul_f64(3.5);
    let mut other = AnyConsumer::connect(&broker.url, &name, 8)
        .await
        .expect("other");
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
    assert_eq!(wait_pending(&broker.url, &name, 0).await, 0, "nothing left");
}

/// The conformance suite as tests: `conformance!(broker)` in a broker's test file, where
/// `broker()` gives its [`Broker`], adds a module `conformance` with one test per
/// scenario. `lease = D` adds the slow-handler scenario for a broker that leases its
/// deliveries for `D`.
macro_rules! conformance {
    ($broker:ident $(, lease = $lease:expr)?) => {
        $(
            /// How long the broker leases a delivery (the conformance suite's slow
            /// handler holds its deliveries 3.5 times that).
            fn conformance_lease() -> std::time::Duration {
                $lease
            }
        )?

        /// The broker conformance suite (`tests/common`): the scenarios every adapter
        /// passes.
        mod conformance {
            use super::common;

            fn broker() -> common::Broker {
                super::$broker()
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn crash_after_commit_before_ack_is_redelivered_and_skipped() {
                common::within(common::crash_after_commit_before_ack(broker())).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn poison_is_dead_lettered_with_its_reason() {
                common::within(common::poison_is_dead_lettered(broker())).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_reason_on_several_lines_is_dead_lettered() {
                common::within(common::a_reason_on_several_lines_is_dead_lettered(broker()))
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn relay_delivers_each_event_once_downstream() {
                common::within(common::relay_delivers_each_event_once(broker())).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_traceparent_crosses_the_broker_both_ways() {
                common::within(common::traceparent_crosses_the_broker(broker())).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_deferral_is_not_a_delivery() {
                common::within(common::a_deferral_is_not_a_delivery(broker())).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_message_that_kills_its_consumer_is_dead_lettered_unrun() {
                common::within(common::a_killer_is_dead_lettered_unrun(broker())).await;
            }

            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn a_handler_slower_than_the_lease_causes_no_redelivery() {
                    let _ = stringify!($lease);
                    common::within(common::a_slow_handler_causes_no_redelivery(
                        broker(),
                        super::conformance_lease(),
                    ))
                    .await;
                }
            )?
        }
    };
}
pub(crate) use conformance;

// ---- Adapter-level scenarios for RabbitMQ, NATS JetStream and Redis Streams ----

/// A handler over the in-memory store for plain bodies: each body is its own identity
/// (award id = the body); `fail` makes every attempt a transient failure (the gate
/// nacks), `slow` makes each one take that long.
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain {
    /// Fail every attempt (transient).
    pub fail: bool,
    /// How long each handler call takes.
    pub slow: Duration,
}

#[async_trait]
impl Handler<MemoryTx> for Plain {
    type Input = ();

    fn identify(&self, payload: &[u8], _headers: &Headers) -> Result<Submission<()>, RejectReason> {
        let body = std::str::from_utf8(payload)
            .map_err(|_| RejectReason::new("not_utf8", "body is not UTF-8"))?;
        let key = IdempotencyKey::derive(body, "2026-07-01T09:00:00Z", payload)?;
        Ok(Submission {
            key,
            subject: body.to_owned(),
            input: (),
        })
    }

    async fn handle(&self, tx: &mut MemoryTx, sub: &Submission<()>) -> Result<(), HandlerError> {
        if !self.slow.is_zero() {
            tokio::time::sleep(self.slow).await;
        }
        if self.fail {
            return Err(HandlerError::Transient("injected failure".into()));
        }
        let mut row = BTreeMap::new();
        row.insert("body".to_owned(), sub.subject.clone());
        tx.insert("done", row.into_iter().collect());
        Ok(())
    }
}

/// `n` distinct plain bodies `PREFIX-00000`, ….
pub fn plain_bodies(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{prefix}-{i:05}").into_bytes())
        .collect()
}

/// Deferrals that fill the prefetch stop the stream from taking new deliveries until
/// they come back: `stream` holds 20 published messages and a prefetch of 8. Its first 8
/// are deferred for 3 s; until they come back at most the 8 of the prefetch (fetched
/// ahead already, where the adapter prefetches in the background) may come, not the
/// other 12; then the 8 come back, each with the attempt it had (a deferral is no
/// delivery), and the rest follow. Each settles through a gate.
pub async fn deferrals_that_fill_the_prefetch_stop_taking<S, A>(stream: &mut S)
where
    S: futures::Stream<Item = Result<Delivery<A>, idem_broker::BrokerError>> + Unpin,
    A: idem_core::Acker,
{
    let first = take(stream, 8).await;
    let mut deferred: Vec<(Vec<u8>, Option<u32>)> = first
        .iter()
        .map(|d| (d.payload.clone(), d.attempt))
        .collect();
    let back_at = std::time::Instant::now() + Duration::from_secs(3);
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
    let gate = idem_core::Gate::new(idem_testkit::MemoryStore::new(), Plain::default());
    for o in gate
        .process_batch(early.into_iter().chain(rest).collect())
        .await
    {
        assert!(o.settle_error().is_none(), "{o:?}");
    }
}

/// The next `n` deliveries of `stream`, failing the test if they do not come in 20 s.
pub async fn take<S, A>(stream: &mut S, n: usize) -> Vec<Delivery<A>>
where
    S: futures::Stream<Item = Result<Delivery<A>, idem_broker::BrokerError>> + Unpin,
{
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(20), stream.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {n} deliveries came", out.len()))
            .expect("the stream ended")
            .expect("delivery");
        out.push(d);
    }
    out
}

/// Every delivery of `stream` until it is quiet for `idle`.
pub async fn drain<S, A>(stream: &mut S, idle: Duration) -> Vec<Delivery<A>>
where
    S: futures::Stream<Item = Result<Delivery<A>, idem_broker::BrokerError>> + Unpin,
{
    let mut out = Vec::new();
    while let Ok(Some(d)) = tokio::time::timeout(idle, stream.next()).await {
        out.push(d.expect("delivery"));
    }
    out
}

/// The bodies of `deliveries`, as text, sorted.
pub fn bodies_of<A>(deliveries: &[Delivery<A>]) -> Vec<String> {
    let mut v: Vec<String> = deliveries
        .iter()
        .map(|d| String::from_utf8_lossy(&d.payload).into_owned())
        .collect();
    v.sort();
    v
}

/// A handler slower than the broker's lease: deliveries taken (some in work, the rest
/// waiting in the consumer's hands) for `hold` — several lease periods — are not
/// redelivered meanwhile, and all settle once. `taken` are the first deliveries of
/// `stream`, a fresh consumer of a source that holds exactly those.
pub async fn slow_handler_causes_no_redelivery<S, A>(
    mut stream: S,
    taken: Vec<Delivery<A>>,
    hold: Duration,
) where
    S: futures::Stream<Item = Result<Delivery<A>, idem_broker::BrokerError>> + Unpin,
    A: Acker,
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
pub struct Killers {
    pub bodies: BTreeSet<String>,
    pub started: std::sync::Arc<tokio::sync::Notify>,
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

/// Three messages that kill their consumer, first in a window of ten (`url`'s broker
/// limit on deliveries is twice the gate's `max_attempts` of 3): process after process
/// dies running one of them (its connection first, then what it held, unsettled), until
/// the gate dead-letters each, unrun, after its three runs. The seven neighbours are each
/// processed exactly once — none reaches the broker's limit (stranded or dead-lettered by
/// the broker without a reason) — and the killers are dead-lettered with the gate's
/// reason.
pub async fn killers_in_one_window_strand_no_neighbour(url: &BrokerUrl) {
    use idem_core::GateConfig;
    let name = fresh_name("killers");
    let bodies = plain_bodies(&name, 10);
    publish_raw(url, &name, &bodies).await.expect("publish");
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
        let started = std::sync::Arc::new(tokio::sync::Notify::new());
        let handler = Killers {
            bodies: killers.clone(),
            started: std::sync::Arc::clone(&started),
        };
        let gate = Gate::with_config(store.clone(), handler, limits.clone());
        let stream = AnyConsumer::connect(url, &name, 10).await.expect("connect");
        let run = consumer::run(
            &gate,
            until_idle(stream, Duration::from_secs(6)),
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
    let mut letters = AnyConsumer::connect(url, &dead_letter_name(&name), 10)
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
        let reason = l.header(DEAD_LETTER_REASON_HEADER).unwrap_or_default();
        assert!(reason.contains("not run again"), "{reason}");
    }
    assert_eq!(wait_pending(url, &name, 0).await, 0, "nothing left");
}
