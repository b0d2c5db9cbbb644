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
//! #     type Deliveries = futures::stream::Empty<Result<idem_engine::Delivery<Self::Acker>, Self::Error>>;
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

use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::Stream;
use idem_engine::{Acker, Delivery, Publisher};

mod delivery;
mod flow;
mod helpers;
mod relay;

pub use delivery::{
    a_killer_is_dead_lettered_unrun, a_reason_on_several_lines_is_dead_lettered,
    crash_after_commit_before_ack, poison_is_dead_lettered,
};
pub use flow::{
    a_deferral_is_not_a_delivery, a_slow_handler_causes_no_redelivery,
    an_oversized_event_is_refused_for_good, deferrals_that_fill_the_prefetch_stop_taking,
    killers_in_one_window_strand_no_neighbour, slow_handler_causes_no_redelivery,
};
use helpers::quiet_for;
pub use helpers::{
    bodies_of, consume_all, drain, fresh_name, outbox_of, plain_bodies, submissions, take,
    wait_pending, within, Plain,
};
pub use relay::{relay_delivers_each_event_once, traceparent_crosses_the_broker};

#[cfg(doc)]
use crate::harness::TestStore;
#[cfg(doc)]
use idem_engine::outbox::EVENT_ID_HEADER;

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

/// The broker conformance suite as tests: one `#[tokio::test]` per scenario of
/// [`broker_conformance`](crate::broker_conformance), each within two minutes.
///
/// - `broker:` an expression giving a fresh
///   [`BrokerUnderTest`](crate::broker_conformance::BrokerUnderTest), evaluated once per
///   test;
/// - `store:` an expression giving a fresh, isolated [`TestStore`](crate::TestStore) (it
///   may `.await`);
/// - `outbox:` a function or closure from `&store` to the
///   [`OutboxSource`](idem_engine::OutboxSource) over its outbox;
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
