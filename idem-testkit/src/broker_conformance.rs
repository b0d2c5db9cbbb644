//! The conformance suite every broker adapter runs: plain async functions over a
//! [`BrokerUnderTest`] (your adapter on its real server) and a [`TestStore`] (the
//! in-memory store, or your own).
//!
//! Each scenario takes a broker under test and, where it needs one, a fresh store:
//!
//! - [`crash_after_commit_before_ack`]: 200 submissions and 50 duplicates; 60 committed
//!   with every ack lost and the consumer dropped; the broker redelivers, a new consumer
//!   skips the committed ones: exactly one effect each, nothing left to settle;
//! - [`poison_is_dead_lettered`]: a body the handler rejects is dead-lettered byte for
//!   byte with its reason; its neighbours are processed;
//! - [`a_reason_on_several_lines_is_dead_lettered`]: a multi-line reason forges no header;
//! - [`relay_delivers_each_event_once`]: consume → outbox → relay (with a republish) → a
//!   downstream consumer that dedups by event id: one effect per event;
//! - [`traceparent_crosses_the_broker`]: a W3C `traceparent` goes through the broker, the
//!   outbox and the relay, both ways;
//! - [`a_deferral_is_not_a_delivery`]: 25 deferrals cost no attempt; a nack costs one;
//! - [`a_killer_is_dead_lettered_unrun`]: a message that kills its consumer on every run
//!   is dead-lettered unrun once its runs reach `max_attempts`;
//! - [`a_slow_handler_causes_no_redelivery`], for a broker that leases its deliveries: a
//!   handler 3.5 leases long while a second consumer polls the same source: nothing is
//!   redelivered;
//! - [`killers_in_one_window_strand_no_neighbour`], for a broker configured with a
//!   delivery limit of 6: three killers among ten messages strand no neighbour.
//!
//! [`broker_conformance_tests!`](crate::broker_conformance_tests) makes one
//! `#[tokio::test]` of each of the first eight. Each scenario panics with a message
//! naming the broken rule, and uses its own random queue or stream names
//! ([`fresh_name`]), so the tests run in parallel on one server.
//!
//! # Proving an adapter
//!
//! Implement [`BrokerUnderTest`] for your adapter, then, in its `tests/conformance.rs`:
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use idem_testkit::broker_conformance::BrokerUnderTest;
//! use idem_testkit::{MemoryOutbox, MemoryStore};
//! # #[derive(Debug)]
//! # struct MyBroker;
//! # impl MyBroker { fn new(_url: &str) -> Self { MyBroker } }
//! # #[async_trait::async_trait]
//! # impl BrokerUnderTest for MyBroker {
//! #     type Acker = idem_testkit::SimAcker;
//! #     type Error = std::io::Error;
//! #     type Deliveries = futures::stream::Empty<Result<idem_core::Delivery<Self::Acker>, Self::Error>>;
//! #     type Publisher = idem_testkit::SimBroker;
//! #     async fn consume(&self, _: &str, _: usize) -> Result<Self::Deliveries, Self::Error> { unimplemented!() }
//! #     async fn publish_raw(&self, _: &str, _: &[Vec<u8>], _: &[(String, String)]) -> Result<(), Self::Error> { unimplemented!() }
//! #     async fn publisher(&self, _: &str) -> Result<Self::Publisher, Self::Error> { unimplemented!() }
//! #     async fn pending(&self, _: &str) -> Result<u64, Self::Error> { unimplemented!() }
//! #     fn idle(&self) -> Duration { Duration::from_secs(3) }
//! # }
//!
//! idem_testkit::broker_conformance_tests! {
//!     // A fresh broker under test for each test (evaluated once per test).
//!     broker: MyBroker::new("my://127.0.0.1:7000?ack_wait=1s"),
//!     // A fresh store for each test (it may `.await`).
//!     store: MemoryStore::new(),
//!     // The relay source over that store's outbox.
//!     outbox: |store: &MemoryStore| MemoryOutbox::new(store.clone(), Duration::from_millis(100)),
//!     // Only for a broker that leases its deliveries: the lease the broker under test
//!     // is configured with (adds the slow-handler scenario).
//!     lease: Duration::from_secs(1),
//! }
//! # fn main() {}
//! ```
//!
//! A scenario can also be called on its own, from a test of your own:
//!
//! ```no_run
//! # use idem_testkit::broker_conformance::BrokerUnderTest;
//! # async fn demo(my_broker: impl BrokerUnderTest) {
//! use idem_testkit::broker_conformance::{poison_is_dead_lettered, within};
//! within(poison_is_dead_lettered(&my_broker, idem_testkit::MemoryStore::new())).await;
//! # }
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use idem_core::outbox::EVENT_ID_HEADER;
use idem_core::{
    consumer, AckError, AckProof, Acker, ConsumerConfig, ConsumerStats, Delivery, Gate, GateConfig,
    Handler, HandlerError, Headers, IdempotencyKey, OutboxEvent, OutboxSource, OutcomeKind,
    PublishError, Publisher, RejectReason, Relay, Submission,
};

use crate::harness::{encode_submission, Effect, EffectHandlerFor, TestStore};
use crate::ledger::Ledger;
use crate::memory::{MemoryStore, MemoryTx};

/// The header idem's adapters put a dead letter's reason in (`code: detail`), and the
/// default of [`BrokerUnderTest::reason_header`].
pub const DEAD_LETTER_REASON_HEADER: &str = "idem-dead-letter-reason";

/// A broker adapter on its real server, as the suite drives it.
///
/// # Contract
/// - Names are the suite's own ([`fresh_name`]): [`consume`](Self::consume),
///   [`publish_raw`](Self::publish_raw) and [`publisher`](Self::publisher) create the
///   queue, stream or topic when it is missing, with the same settings every time, so a
///   publisher and a consumer that start in either order meet.
/// - The deliveries are the adapter's own (its [`Acker`] keeps the [`Acker`] contract):
///   an unsettled delivery comes back after the broker's redelivery delay, shorter than
///   [`idle`](Self::idle); [`Delivery::attempt`] is the broker's count of the message's
///   deliveries, from 1, and a deferral ([`Acker::defer`]) does not raise it.
/// - A rejected delivery goes to [`dead_letter_name`](Self::dead_letter_name) of its
///   source, byte for byte, with the reason in the header
///   [`reason_header`](Self::reason_header) (`code: detail`, on one line or several), and
///   only there: a reason never adds or replaces another header.
#[async_trait]
pub trait BrokerUnderTest: Send + Sync {
    /// The adapter's acker.
    type Acker: Acker;
    /// The adapter's error.
    type Error: std::error::Error + Send + Sync + 'static;
    /// A consumer's deliveries.
    type Deliveries: Stream<Item = Result<Delivery<Self::Acker>, Self::Error>>
        + Send
        + Unpin
        + 'static;
    /// The relay's publisher.
    type Publisher: Publisher + 'static;

    /// Connects a consumer of `name` with up to `prefetch` unsettled deliveries on hand.
    /// The stream does not end while the connection lives; dropping it closes the
    /// connection (see [`die`](Self::die)). Consumers of one name share its messages
    /// (a competing consumer, one consumer group).
    async fn consume(&self, name: &str, prefetch: usize) -> Result<Self::Deliveries, Self::Error>;

    /// Publishes each body to `name` as one message, in order, each with `headers`, and
    /// returns once the broker has them durably.
    async fn publish_raw(
        &self,
        name: &str,
        bodies: &[Vec<u8>],
        headers: &[(String, String)],
    ) -> Result<(), Self::Error>;

    /// A publisher of outbox events to `name`, as the relay uses it: each event's id in
    /// the [`EVENT_ID_HEADER`] header and its `traceparent`, when it has one, in the
    /// `traceparent` header.
    async fn publisher(&self, name: &str) -> Result<Self::Publisher, Self::Error>;

    /// How many messages of `name` are left to settle: ready ones and delivered ones
    /// not yet acked (a broker that counts them late is waited for up to 10 s).
    async fn pending(&self, name: &str) -> Result<u64, Self::Error>;

    /// How long a consumer with nothing to do waits before it is done: longer than the
    /// broker's redelivery delay of an unacked delivery (so a test that waits this long
    /// and sees nothing knows nothing is coming).
    fn idle(&self) -> Duration;

    /// Whether the broker itself drops a republished event id (JetStream's
    /// `Nats-Msg-Id` duplicate window): then the relay's republish reaches no consumer.
    /// The default is `false`.
    fn dedups_event_ids(&self) -> bool {
        false
    }

    /// Where the dead letters of `name` go, consumed with [`consume`](Self::consume).
    /// The default is idem's `NAME.dead-letter`.
    fn dead_letter_name(&self, name: &str) -> String {
        format!("{name}.dead-letter")
    }

    /// The header of a dead letter that holds its reason. The default is
    /// [`DEAD_LETTER_REASON_HEADER`].
    fn reason_header(&self) -> &str {
        DEAD_LETTER_REASON_HEADER
    }

    /// `deliveries`, ending once nothing came for `idle` while the stream was polled.
    /// The default is that clock; an adapter that knows better when its broker is quiet
    /// (a receive still outstanding) overrides it.
    fn until_idle(
        &self,
        deliveries: Self::Deliveries,
        idle: Duration,
    ) -> BoxStream<'static, Result<Delivery<Self::Acker>, Self::Error>> {
        quiet_for(deliveries, idle)
    }

    /// Ends a consumer as its process's death would: its connection closes, and the
    /// deliveries it handed out and nobody settled are the broker's to hand out again,
    /// each counted as a delivery. Their ackers, dropped after this returns, must send
    /// nothing (a dead process sends nothing). The default drops the stream and waits
    /// 200 ms for the connection to close.
    async fn die(&self, deliveries: Self::Deliveries) {
        drop(deliveries);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `stream`, ending once nothing came for `idle` while it was polled (time between polls
/// does not count).
fn quiet_for<S, T>(stream: S, idle: Duration) -> BoxStream<'static, T>
where
    S: Stream<Item = T> + Send + Unpin + 'static,
    T: Send + 'static,
{
    futures::stream::unfold(stream, move |mut stream| async move {
        match tokio::time::timeout(idle, stream.next()).await {
            Ok(Some(item)) => Some((item, stream)),
            Ok(None) | Err(_) => None,
        }
    })
    .boxed()
}

// ---- Helpers ----

/// Runs a scenario, failing it (rather than hanging) after two minutes.
pub async fn within<F: std::future::Future>(scenario: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(120), scenario)
        .await
        .expect("the scenario did not finish within 2 minutes")
}

/// A fresh queue or stream name: `idem-test-PREFIX-` and eight random hex digits.
pub fn fresh_name(prefix: &str) -> String {
    format!("idem-test-{prefix}-{:08x}", rand::random::<u32>())
}

/// The relay source of `store`: `outbox(store)`. (A helper for
/// [`broker_conformance_tests!`](crate::broker_conformance_tests), so its `outbox`
/// closure needs no type annotation.)
pub fn outbox_of<S, O>(store: &S, outbox: impl FnOnce(&S) -> O) -> O {
    outbox(store)
}

/// `n` distinct submissions for [`EffectHandlerFor`] (`T-TAG-00000|…|amount`, see
/// [`encode_submission`]), and the ledger that expects one effect of each.
pub fn submissions(tag: &str, n: usize) -> (Vec<Vec<u8>>, Ledger) {
    let mut ledger = Ledger::new();
    let mut bodies = Vec::with_capacity(n);
    let ts = "2026-07-01T09:00:00Z";
    for i in 0..n {
        let subject = format!("T-{tag}-{i:05}");
        let amount = 1_000 + i as i64;
        let body = encode_submission(&subject, ts, amount);
        let key = IdempotencyKey::derive(&subject, ts, &body).expect("key");
        ledger.expect(key, subject, amount);
        bodies.push(body);
    }
    (bodies, ledger)
}

/// `n` distinct plain bodies `PREFIX-00000`, … (for [`Plain`]).
pub fn plain_bodies(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{prefix}-{i:05}").into_bytes())
        .collect()
}

/// Waits (up to 10 s) until `name` has `want` left to settle; returns the last count.
pub async fn wait_pending<B: BrokerUnderTest>(broker: &B, name: &str, want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = broker.pending(name).await.expect("pending count");
        if n == want || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The next `n` deliveries of `stream`, failing the test if they do not come in 20 s.
pub async fn take<S, A, E>(stream: &mut S, n: usize) -> Vec<Delivery<A>>
where
    S: Stream<Item = Result<Delivery<A>, E>> + Unpin,
    E: std::fmt::Debug,
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
pub async fn drain<S, A, E>(stream: &mut S, idle: Duration) -> Vec<Delivery<A>>
where
    S: Stream<Item = Result<Delivery<A>, E>> + Unpin,
    E: std::fmt::Debug,
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

/// A handler over the in-memory store for plain bodies: each body is its own identity
/// (the subject is the body); `fail` makes every attempt a transient failure (the gate
/// nacks), `slow` makes each one take that long. Each run that succeeds adds a row
/// `{"body": …}` to the table `done`.
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
        tx.insert("done", row);
        Ok(())
    }
}

/// An acker whose ack "leaves" and never arrives: the process died after the commit
/// and before the ack.
#[derive(Debug)]
struct LostAck<A>(A);

#[async_trait]
impl<A: Acker> Acker for LostAck<A> {
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

/// The committed effects of `store`.
async fn effects<S: TestStore>(store: &S) -> Vec<Effect> {
    store.effects().await.expect("read the effects")
}

/// Consumes `name` into `store` through [`EffectHandlerFor`] until the broker is quiet
/// for [`BrokerUnderTest::idle`].
pub async fn consume_all<B, S>(
    broker: &B,
    name: &str,
    store: &S,
    concurrency: usize,
    batch: usize,
) -> ConsumerStats
where
    B: BrokerUnderTest,
    S: TestStore,
{
    let deliveries = broker
        .consume(name, 2 * concurrency * batch)
        .await
        .expect("connect consumer");
    let gate = Gate::new(store.clone(), EffectHandlerFor::<S>::new());
    consumer::run(
        &gate,
        broker.until_idle(deliveries, broker.idle()),
        ConsumerConfig::new(concurrency, batch),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("consumer run")
}

// ---- The scenarios ----

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
    use idem_core::{OutboxBatch as _, TraceParent};

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

/// The broker conformance suite as tests: one `#[tokio::test]` per scenario of
/// [`broker_conformance`](crate::broker_conformance), each within two minutes.
///
/// - `broker:` an expression giving a fresh
///   [`BrokerUnderTest`](crate::broker_conformance::BrokerUnderTest), evaluated once per
///   test;
/// - `store:` an expression giving a fresh, isolated [`TestStore`](crate::TestStore) (it
///   may `.await`);
/// - `outbox:` a function or closure from `&store` to the
///   [`OutboxSource`](idem_core::OutboxSource) over its outbox;
/// - `lease:` (only for a broker that leases its deliveries) the lease the broker under
///   test is configured with; adds the slow-handler scenario.
///
/// The tests are `crash_after_commit_before_ack_is_redelivered_and_skipped`,
/// `poison_is_dead_lettered_with_its_reason`,
/// `a_reason_on_several_lines_is_dead_lettered`,
/// `relay_delivers_each_event_once_downstream`,
/// `a_traceparent_crosses_the_broker_both_ways`, `a_deferral_is_not_a_delivery`,
/// `a_message_that_kills_its_consumer_is_dead_lettered_unrun` and
/// `a_handler_slower_than_the_lease_causes_no_redelivery`. The calling crate needs
/// `tokio` with the `macros` and `rt-multi-thread` features. See the
/// [module's example](crate::broker_conformance#proving-an-adapter).
#[macro_export]
macro_rules! broker_conformance_tests {
    (
        broker: $broker:expr,
        store: $store:expr,
        outbox: $outbox:expr
        $(, lease: $lease:expr)?
        $(,)?
    ) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn crash_after_commit_before_ack_is_redelivered_and_skipped() {
            $crate::broker_conformance::within(async {
                let broker = $broker;
                let store = $store;
                $crate::broker_conformance::crash_after_commit_before_ack(&broker, store).await;
            })
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn poison_is_dead_lettered_with_its_reason() {
            $crate::broker_conformance::within(async {
                let broker = $broker;
                let store = $store;
                $crate::broker_conformance::poison_is_dead_lettered(&broker, store).await;
            })
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_reason_on_several_lines_is_dead_lettered() {
            $crate::broker_conformance::within(async {
                let broker = $broker;
                $crate::broker_conformance::a_reason_on_several_lines_is_dead_lettered(&broker)
                    .await;
            })
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn relay_delivers_each_event_once_downstream() {
            $crate::broker_conformance::within(async {
                let broker = $broker;
                let store = $store;
                let source = $crate::broker_conformance::outbox_of(&store, $outbox);
                $crate::broker_conformance::relay_delivers_each_event_once(&broker, store, source)
                    .await;
            })
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_traceparent_crosses_the_broker_both_ways() {
            $crate::broker_conformance::within(async {
                let broker = $broker;
                let store = $store;
                let source = $crate::broker_conformance::outbox_of(&store, $outbox);
                $crate::broker_conformance::traceparent_crosses_the_broker(&broker, store, source)
                    .await;
            })
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_deferral_is_not_a_delivery() {
            $crate::broker_conformance::within(async {
                let broker = $broker;
                $crate::broker_conformance::a_deferral_is_not_a_delivery(&broker).await;
            })
            .await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_message_that_kills_its_consumer_is_dead_lettered_unrun() {
            $crate::broker_conformance::within(async {
                let broker = $broker;
                $crate::broker_conformance::a_killer_is_dead_lettered_unrun(&broker).await;
            })
            .await;
        }

        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_handler_slower_than_the_lease_causes_no_redelivery() {
                $crate::broker_conformance::within(async {
                    let broker = $broker;
                    $crate::broker_conformance::a_slow_handler_causes_no_redelivery(
                        &broker,
                        $lease,
                    )
                    .await;
                })
                .await;
            }
        )?
    };
}
