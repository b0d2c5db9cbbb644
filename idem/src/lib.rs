//! # idem
//!
//! Exactly-once *effect* for consumers of at-least-once brokers, in one crate to depend
//! on. A broker that never saw the ack must redeliver; idem makes the redelivery
//! harmless: a deterministic [`IdempotencyKey`], an atomic claim of it, the claim + your
//! business write + an [`OutboxEvent`] in one transaction, the ack only after the commit,
//! and a [`Relay`] that publishes the outbox at least once with deterministic event ids.
//!
//! Everything of `idem-core` (the contract: keys, the store and acker traits, errors) and
//! of `idem-engine` (the [`Gate`], the [`Handler`] you write, [`consumer::run`], the
//! [`Relay`]) is here at the root; each store, the brokers, the
//! runtime and the grant pipeline are a module behind a cargo feature:
//!
//! | feature | module | brings |
//! |---|---|---|
//! | `runtime` (default) | [`runtime`] | the supervised consumer, the relay's tokio timer, the reconnecting publisher, retry, the handler deadline, the outcome tally (`idem-runtime`) |
//! | `metrics` | `runtime::metrics` | Prometheus collectors and `/metrics`, `/healthz`, `/readyz` (implies `runtime`) |
//! | `sqlite` | [`sqlite`] | the embedded store: no server (`idem-store-sqlite`; compiles SQLite's C source) |
//! | `postgres` | [`postgres`] | the Postgres store, its layouts, the outbox relay source (`idem-store-postgres`) |
//! | `redis` | [`redis`] | the Redis lease store and the front filter (`idem-store-redis`, on redis-rs) |
//! | `rabbitmq`, `nats`, `redis-streams`, `sqs`, `kafka` | [`broker`] | that broker's consumer and publisher, and its URLs in [`broker::any`] (`idem-broker`; `sqs` and `kafka` compile C sources) |
//! | `tls` | — | TLS for whichever of Postgres, Redis, RabbitMQ and Redis Streams is on, through rustls |
//! | `grant` | [`grant`] | the grant-disbursement pipeline on whichever of `sqlite` and `postgres` is on (`idem-grant`) |
//!
//! The default is small, as tokio's and sqlx's are: `runtime` only — tokio pieces that
//! any long-running consumer uses — and no database driver, broker client or C source
//! until a feature names it, so a team on Postgres never compiles SQLite and a team on
//! RabbitMQ never compiles librdkafka:
//!
//! ```sh
//! cargo add idem --features postgres,rabbitmq
//! ```
//!
//! The crates underneath (`idem-core`, `idem-engine`, `idem-store-sqlite`, `idem-store-postgres`,
//! `idem-store-redis`, `idem-broker`, `idem-runtime`, `idem-grant`) stay usable alone;
//! this crate only re-exports them, so `idem::postgres::PgStore` *is*
//! `idem_store_postgres::PgStore`. The test kit (`idem-testkit`: the in-memory store, the
//! simulated broker, the crash-at-every-step suite for your handler) is a
//! dev-dependency of your own, never part of this crate.
//!
//! ## A consumer
//!
//! Your business write goes in a [`Handler`]: `identify` turns the delivered bytes into
//! a key (or a [`RejectReason`]: dead-lettered), and `handle` writes through the store's
//! transaction — here [`PgTx::conn`](postgres::PgTx::conn) and the outbox — and never
//! sees the acker. The gate claims, calls it, commits, and only then acks. This is a
//! consumer from RabbitMQ into Postgres with its relay, all of it from
//! `cargo add idem --features postgres,rabbitmq`
//! (the whole program, with tests that prove it exactly-once, is `examples/orders` in the
//! repository; a step-by-step guide is `docs/own-handler.md`):
//!
//! ```no_run
//! # #[cfg(all(feature = "postgres", feature = "rabbitmq", feature = "runtime"))]
//! # mod consumer_example {
//! use std::time::Duration;
//!
//! use idem::broker::any::{AnyConsumer, AnyPublisher, BrokerUrl};
//! use idem::postgres::{PgConfig, PgOutboxSource, PgStore, PgTx};
//! use idem::{
//!     consumer, ConsumerConfig, Gate, Handler, HandlerError, Headers, IdempotencyKey,
//!     OutboxEvent, OutboxWriter, RejectReason, Relay, Submission,
//! };
//!
//! /// Your handler: a body `ORDER-ID|CREATED-AT|…` is one order.
//! struct Orders;
//!
//! #[idem::async_trait]
//! impl Handler<PgTx> for Orders {
//!     type Input = ();
//!
//!     fn identify(&self, body: &[u8], _: &Headers) -> Result<Submission<()>, RejectReason> {
//!         let text = std::str::from_utf8(body)
//!             .map_err(|_| RejectReason::new("not_utf8", "the body is not UTF-8"))?;
//!         let mut parts = text.split('|');
//!         let (Some(id), Some(at)) = (parts.next(), parts.next()) else {
//!             return Err(RejectReason::new("malformed", "expected ORDER-ID|CREATED-AT|…"));
//!         };
//!         let key = IdempotencyKey::derive(id, at, body)?;
//!         Ok(Submission { key, subject: id.to_owned(), input: () })
//!     }
//!
//!     async fn handle(&self, tx: &mut PgTx, sub: &Submission<()>) -> Result<(), HandlerError> {
//!         // The business row goes through `tx.conn()`, in the claim's transaction.
//!         let event = OutboxEvent::new(sub.key, "order.recorded", sub.subject.clone(), "{}");
//!         tx.enqueue(&event).await?;
//!         Ok(())
//!     }
//! }
//!
//! async fn run() -> Result<(), Box<dyn std::error::Error>> {
//!     let store = PgStore::connect("postgres://app@127.0.0.1/app", PgConfig::new("public")?).await?;
//!     store.migrate().await?; // processed_messages, outbox
//!     let broker = BrokerUrl::parse("amqp://guest:guest@127.0.0.1:5672/%2f")?;
//!
//!     // claim → your handler → commit → ack, four batches of up to 100 at a time
//!     let gate = Gate::new(store.clone(), Orders);
//!     let deliveries = AnyConsumer::connect(&broker, "orders", 800).await?;
//!     let shutdown = async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     };
//!     let consuming = consumer::run(&gate, deliveries, ConsumerConfig::new(4, 100), shutdown, |_| {});
//!
//!     // the committed outbox to the `orders.recorded` queue, at least once
//!     let source = PgOutboxSource::new(store, Duration::from_millis(200));
//!     let publisher = AnyPublisher::connect(&broker, "orders.recorded").await?;
//!     let relay = Relay::with_options(source, publisher, idem::runtime::relay_options());
//!     let relaying = relay.run(async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     });
//!
//!     let (consumed, relayed) = tokio::join!(consuming, relaying);
//!     println!("processed {}, relayed {}", consumed?.processed, relayed?.published);
//!     Ok(())
//! }
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc(inline)]
pub use idem_engine::*;

/// The embedded SQLite store ([`idem_store_sqlite`]).
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
#[doc(inline)]
pub use idem_store_sqlite as sqlite;

/// The Postgres store, its layouts and its outbox relay source ([`idem_store_postgres`]).
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
#[doc(inline)]
pub use idem_store_postgres as postgres;

/// The Redis lease store and front filter ([`idem_store_redis`]).
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[doc(inline)]
pub use idem_store_redis as redis;

/// The broker adapters and the URL grammar ([`idem_broker`]): one module per broker
/// feature that is on.
#[cfg(any(
    feature = "rabbitmq",
    feature = "nats",
    feature = "redis-streams",
    feature = "sqs",
    feature = "kafka"
))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(
        feature = "rabbitmq",
        feature = "nats",
        feature = "redis-streams",
        feature = "sqs",
        feature = "kafka"
    )))
)]
#[doc(inline)]
pub use idem_broker as broker;

/// What needs a runtime: the supervised consumer, the relay's timer, the reconnecting
/// publisher, retry, the handler deadline, the outcome tally, and with `metrics` the
/// Prometheus endpoint ([`idem_runtime`]).
#[cfg(feature = "runtime")]
#[cfg_attr(docsrs, doc(cfg(feature = "runtime")))]
#[doc(inline)]
pub use idem_runtime as runtime;

/// The grant-disbursement pipeline ([`idem_grant`]).
#[cfg(feature = "grant")]
#[cfg_attr(docsrs, doc(cfg(feature = "grant")))]
#[doc(inline)]
pub use idem_grant as grant;

// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
