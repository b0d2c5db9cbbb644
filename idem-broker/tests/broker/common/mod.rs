//! idem's adapters under the test kit's broker conformance suite
//! ([`idem_testkit::broker_conformance`]): [`Broker`] is the [`BrokerUnderTest`] of any
//! compiled-in broker (through `idem_broker::any`), [`PgGrants`] the Postgres store the
//! scenarios run on, and [`conformance!`] adds the suite's tests to a broker's test file
//! with one line. What is particular to one broker stays in its own file; the helpers
//! here serve those tests too.
//!
//! Addresses come from `IDEM_TEST_*` variables with the local defaults; a missing broker
//! or database fails the test. Each test uses its own random queue/stream name and its
//! own Postgres schema.

#![allow(dead_code, unreachable_pub, unused_macros, unused_imports)]

use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_broker::any::{pending_count, AnyAcker, AnyConsumer, AnyPublisher, BrokerUrl};
use idem_broker::{until_idle, BrokerError};
use idem_engine::ident::Ident;
use idem_engine::{
    consumer, Capabilities, ClaimStore, ConsumerConfig, ConsumerStats, Delivery, Gate,
    IdempotencyKey, OutboxEvent, OutboxWriter, StoreError,
};
use idem_grant::{Grant, GrantBook, GrantDb, GRANT_TABLE};
use idem_store_postgres::{PgConfig, PgOutboxSource, PgStore, PgTx};
use idem_testkit::broker_conformance::BrokerUnderTest;
pub use idem_testkit::broker_conformance::{
    an_oversized_event_is_refused_for_good, bodies_of,
    deferrals_that_fill_the_prefetch_stop_taking, drain, fresh_name, plain_bodies, take, within,
    Plain,
};
use idem_testkit::{Effect, Ledger, TestStore};

/// One of idem's brokers as the suite drives it: its URL (through `idem_broker::any`)
/// and the facts the scenarios need.
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

/// Two deliveries lost with their process come due while the next process is already
/// receiving after a first delivery, on the broker of `url` (whose redelivery delay, an
/// ack wait or a visibility timeout, must be 1 to 2 s, and whose long poll, where it has
/// one, longer): they still come one at a time, so the run of the first that kills this
/// process too costs the other no delivery. A receive opened by the first delivery that
/// stayed open took both as they came due, and the other was charged a delivery it never
/// ran for: the over-count that took a killer to the broker's limit (NATS `max_deliver`,
/// SQS `maxReceiveCount`) before the gate could dead-letter it.
pub async fn reruns_that_come_due_behind_a_first_delivery_come_one_at_a_time(url: &BrokerUrl) {
    let name = fresh_name("rerun-due");
    let lost_bodies = plain_bodies(&name, 2);
    idem_broker::any::publish_raw(url, &name, &lost_bodies)
        .await
        .expect("publish");
    let connect = || AnyConsumer::connect(url, &name, 8);
    // The first process receives both and dies with them unsettled: the process first,
    // then what it held, so nothing is received in between.
    let mut first = connect().await.expect("connect");
    let lost = take(&mut first, 2).await;
    assert!(
        lost.iter().all(|d| d.attempt == Some(1)),
        "first deliveries"
    );
    drop(first);
    drop(lost);
    // A new message, there before the two come due.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let fresh = format!("{name}-fresh").into_bytes();
    idem_broker::any::publish_raw(url, &name, std::slice::from_ref(&fresh))
        .await
        .expect("publish");
    let gate = Gate::new(idem_testkit::MemoryStore::new(), Plain::default());
    let processed = idem_engine::OutcomeKind::Processed;
    let mut second = connect().await.expect("connect");
    let d = take(&mut second, 1).await.remove(0);
    assert_eq!((d.payload.as_slice(), d.attempt), (&fresh[..], Some(1)));
    assert_eq!(gate.process(d).await.kind(), processed);
    // The next is one of the two, a rerun; its run kills this process too.
    let killer = take(&mut second, 1).await.remove(0);
    assert_eq!(killer.attempt, Some(2), "a rerun");
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(second);
    drop(killer);
    // The third process: the other one was delivered no more often than the first death
    // made it.
    let mut third = connect().await.expect("connect");
    let mut attempts = std::collections::BTreeMap::new();
    for _ in 0..2 {
        let d = take(&mut third, 1).await.remove(0);
        attempts.insert(d.payload.clone(), d.attempt);
        assert_eq!(gate.process(d).await.kind(), processed);
    }
    let mut counts: Vec<_> = lost_bodies.iter().map(|b| attempts[b]).collect();
    counts.sort_unstable();
    assert_eq!(
        counts,
        [Some(2), Some(3)],
        "the killer's third delivery, and the other's second: only the first death charged it"
    );
}

/// Runs the in-memory gate of `Plain` over `deliveries`, one at a time, until the run
/// stops on a dead letter its broker refuses for good (within `limit`): the error, after
/// checking it is an [`idem_engine::AckError::config`], which stops a consumer.
pub async fn stopped_by_a_refused_dead_letter<A, St>(
    deliveries: St,
    limit: Duration,
) -> idem_engine::Error
where
    A: idem_engine::Acker,
    St: futures::Stream<Item = Result<Delivery<A>, BrokerError>>,
{
    let gate = Gate::new(idem_testkit::MemoryStore::new(), Plain::default());
    let stopped = tokio::time::timeout(
        limit,
        consumer::run(
            &gate,
            deliveries,
            ConsumerConfig::new(1, 1),
            std::future::pending::<()>(),
            |_| {},
        ),
    )
    .await
    .expect("the consumer stops")
    .expect_err("a configuration error");
    assert_eq!(
        stopped.class(),
        idem_engine::ErrorClass::Config,
        "{stopped}"
    );
    assert!(matches!(stopped, idem_engine::Error::Ack(_)), "{stopped:?}");
    stopped
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

/// The broker of `url` as a [`BrokerUnderTest`]: its consumers, publishers and pending
/// counts through `idem_broker::any`, idle after `broker.idle`, dead letters in
/// `NAME.dead-letter` with the reason in `idem-dead-letter-reason`.
#[async_trait]
impl BrokerUnderTest for Broker {
    type Acker = AnyAcker;
    type Error = BrokerError;
    type Deliveries = AnyConsumer;
    type Publisher = AnyPublisher;

    async fn consume(&self, name: &str, prefetch: usize) -> Result<AnyConsumer, BrokerError> {
        AnyConsumer::connect(&self.url, name, prefetch).await
    }

    async fn publish_raw(
        &self,
        name: &str,
        bodies: &[Vec<u8>],
        headers: &[(String, String)],
    ) -> Result<(), BrokerError> {
        AnyPublisher::connect(&self.url, name)
            .await?
            .publish_raw_with_headers(bodies, headers)
            .await
    }

    async fn publisher(&self, name: &str) -> Result<AnyPublisher, BrokerError> {
        AnyPublisher::connect(&self.url, name).await
    }

    async fn pending(&self, name: &str) -> Result<u64, BrokerError> {
        pending_count(&self.url, name).await
    }

    fn idle(&self) -> Duration {
        self.idle
    }

    fn dedups_event_ids(&self) -> bool {
        self.dedups_event_ids
    }

    fn dead_letter_name(&self, name: &str) -> String {
        idem_broker::dead_letter_name(name)
    }

    fn reason_header(&self) -> &str {
        idem_broker::DEAD_LETTER_REASON_HEADER
    }

    /// idem's own idle wrapper, which the SQS adapter takes over (it never ends a stream
    /// while a receive is outstanding).
    fn until_idle(
        &self,
        deliveries: AnyConsumer,
        idle: Duration,
    ) -> futures::stream::BoxStream<'static, Result<Delivery<AnyAcker>, BrokerError>> {
        use futures::StreamExt as _;
        until_idle(deliveries, idle).boxed()
    }
}

/// Three killers in one window of ten on the broker of `url`, which must be configured
/// with a delivery limit of 6
/// ([`idem_testkit::broker_conformance::killers_in_one_window_strand_no_neighbour`]).
pub async fn killers_in_one_window_strand_no_neighbour(url: &BrokerUrl) {
    let broker = Broker {
        url: url.clone(),
        // Not used by the scenario, which waits its own times.
        idle: Duration::from_secs(3),
        dedups_event_ids: false,
    };
    idem_testkit::broker_conformance::killers_in_one_window_strand_no_neighbour(&broker).await;
}

/// The Postgres grant store as the suite's [`TestStore`] (a newtype: the trait and
/// [`PgStore`] are both foreign here): each effect is a `disbursements` row (the subject
/// as its award id), written in the claim's transaction.
#[derive(Debug, Clone)]
pub struct PgGrants(pub PgStore);

/// A fresh [`PgGrants`] on a schema of its own.
pub async fn fresh_store() -> PgGrants {
    PgGrants(fresh_pg().await)
}

/// The relay source over `store`'s outbox.
pub fn pg_outbox(store: &PgGrants) -> PgOutboxSource {
    PgOutboxSource::new(store.0.clone(), Duration::from_millis(100))
}

#[async_trait]
impl ClaimStore for PgGrants {
    type Tx = PgTx;

    async fn begin(&self) -> Result<PgTx, StoreError> {
        self.0.begin().await
    }

    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }

    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: idem_engine::RunNote,
    ) -> Result<Option<u32>, StoreError> {
        self.0.note_run(key, note).await
    }

    async fn probe(&self) -> Result<(), StoreError> {
        self.0.probe().await
    }
}

#[async_trait]
impl TestStore for PgGrants {
    async fn write_effect(
        tx: &mut PgTx,
        key: &IdempotencyKey,
        subject: &str,
        amount: i64,
    ) -> Result<(), StoreError> {
        let table = idem_engine::sql!(
            "{schema}.{name}",
            schema = tx.schema_ident(),
            name = Ident::from_static(GRANT_TABLE)
        );
        let grant = Grant {
            award_id: subject.to_owned(),
            submission_timestamp: "2026-07-01T09:00:00Z".to_owned(),
            amount_cents: amount,
        };
        tx.record_disbursement(&table, &grant, key).await
    }

    async fn enqueue(tx: &mut PgTx, event: &OutboxEvent) -> Result<(), StoreError> {
        OutboxWriter::enqueue(tx, event).await
    }

    /// Postgres itself refuses the row: the payload is not JSON, the column is jsonb.
    async fn enqueue_refused(tx: &mut PgTx, key: &IdempotencyKey) -> Result<(), StoreError> {
        let ev = OutboxEvent::new(*key, "effect.recorded", "refused", "this is not json {");
        let res = OutboxWriter::enqueue(tx, &ev).await;
        assert!(res.is_err(), "Postgres accepted an invalid jsonb payload");
        res
    }

    async fn effects(&self) -> Result<Vec<Effect>, StoreError> {
        Ok(effects(&self.0).await)
    }

    async fn claim_count(&self, key: &IdempotencyKey) -> Result<u64, StoreError> {
        let record = self
            .0
            .inspect_key(key)
            .await
            .map_err(|e| StoreError::other(e.to_string(), false))?;
        Ok(u64::from(record.is_some()))
    }
}

/// The conformance suite as tests: `conformance!(broker)` in a broker's test file, where
/// `broker()` gives its [`Broker`], adds a module `conformance` with one test per
/// scenario of [`idem_testkit::broker_conformance_tests!`], each on a fresh Postgres
/// schema. `lease = D` adds the slow-handler scenario for a broker that leases its
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

        /// The broker conformance suite of the test kit
        /// (`idem_testkit::broker_conformance`): the scenarios every adapter passes.
        mod conformance {
            use super::common;

            idem_testkit::broker_conformance_tests! {
                broker: super::$broker(),
                store: common::fresh_store().await,
                outbox: common::pg_outbox,
                $(lease: {
                    let _ = stringify!($lease);
                    super::conformance_lease()
                },)?
            }
        }
    };
}
pub(crate) use conformance;
