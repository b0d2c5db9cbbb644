//! # idem-broker
//!
//! Broker adapters for idem: each turns its broker's deliveries into
//! [`idem_core::Delivery`]s whose [`idem_core::Acker`] speaks the broker's own settlement
//! (ack, nack with a delay, dead-letter with a reason), and implements
//! [`idem_core::Publisher`] for the outbox relay. A broker is named by a URL whose scheme
//! picks the adapter and whose query carries idem's settings, checked when it is parsed:
//!
//! ```
//! # #[cfg(feature = "redis-streams")]
//! # fn main() -> Result<(), idem_broker::BrokerError> {
//! use std::time::Duration;
//! use idem_broker::any::{BrokerKind, BrokerUrl};
//! use idem_broker::redis_streams::RedisStreamsConfig;
//! use idem_broker::BrokerError;
//!
//! let url = BrokerUrl::parse("redis://127.0.0.1:6379/0?group=billing&min_idle=10s")?;
//! assert_eq!(url.kind(), BrokerKind::RedisStreams);
//! // idem's settings leave the URL the client is given
//! assert_eq!(url.client_url(), "redis://127.0.0.1:6379/0");
//! let config = RedisStreamsConfig::from_url(&url, "submissions")?;
//! assert_eq!(config.group, "billing");
//! assert_eq!(config.min_idle, Duration::from_secs(10));
//! assert_eq!(config.block, Duration::from_secs(1)); // the default
//!
//! // A bad or misspelt setting is an error naming it, never a silent default.
//! for bad in ["redis://127.0.0.1?min_idle=soon", "redis://127.0.0.1?min_idel=10s"] {
//!     let err = BrokerUrl::parse(bad).unwrap_err();
//!     assert!(matches!(err, BrokerError::InvalidParam { .. }), "{err}");
//! }
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "redis-streams"))]
//! # fn main() {}
//! ```
//!
//! One cargo feature per broker, each module alike in shape (`config`, `consumer`,
//! `publisher`; the `config` type's docs list its URL parameters in a table):
//!
//! | broker (module, client) | scheme | feature | ack | nack (with a delay) | dead-letter | attempt from |
//! |---|---|---|---|---|---|---|
//! | RabbitMQ ([`rabbitmq`], lapin) | `amqp://`, `amqps://` | `rabbitmq` | `basic.ack` (a batch: one multiple-ack up to where every delivery is in it) | `basic.nack` with requeue (a delay: held unacked, then requeued) | confirmed publish to queue `NAME.dead-letter`, then `basic.ack` | a quorum queue's `x-delivery-count` + 1 (a classic queue has none) |
//! | NATS JetStream ([`nats`], async-nats) | `nats://`, `tls://` | `nats` | double ack (the server's reply awaited) | `-NAK` with the delay | confirmed publish to subject `NAME.dead-letter`, then `+TERM` | the server's delivery count |
//! | Redis Streams ([`redis_streams`], fred) | `redis://`, `rediss://` | `redis-streams` | `XACK` (one per batch) | the entry stays pending, idle-timed to be reclaimed after the delay | `XADD NAME.dead-letter`, then `XACK` | the pending entry's delivery count |
//! | Amazon SQS ([`sqs`], aws-sdk-sqs) | `sqs://` | `sqs` | `DeleteMessageBatch` | `ChangeMessageVisibility` to the delay (0: at once) | `SendMessage` to queue `NAME-dead-letter`, then `DeleteMessage` | `ApproximateReceiveCount` |
//! | Kafka ([`kafka`], rdkafka) | `kafka://` | `kafka` | commit of the partition's contiguous low-water mark | back into this consumer's stream after the delay, offset uncommitted | produce to topic `NAME.dead-letter`, then settled | the deliveries of the offset by this member (a restarted member counts from 1) |
//!
//! A `NAME` means the same thing on both sides and is created if missing: a durable
//! RabbitMQ queue (published through the default exchange), a JetStream stream on subject
//! `NAME` (file storage) with a durable consumer, a Redis stream key with a consumer group,
//! an SQS queue, a Kafka topic.
//! Rejected input goes to `NAME.dead-letter` of the same kind, with its reason in the
//! [`DEAD_LETTER_REASON_HEADER`] header (or stream field, or message attribute).
//! Every duration, in a URL or an `idem` flag, is read by [`parse_duration`].
//!
//! The [`any`] module is always compiled: [`any::BrokerUrl::parse`] picks the adapter
//! from the URL scheme, so a command dispatches once.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_broker::BrokerError> {
//! use futures::StreamExt;
//! use idem_broker::any::{AnyConsumer, BrokerUrl};
//!
//! let url = BrokerUrl::parse("amqp://guest:guest@127.0.0.1:5672/%2f")?;
//! let mut deliveries = AnyConsumer::connect(&url, "submissions", 32).await?;
//! while let Some(delivery) = deliveries.next().await {
//!     let delivery = delivery?;
//!     println!("{} bytes", delivery.payload.len());
//!     // hand it to an `idem_engine::Gate`, which acks only after the commit
//! }
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod any;
#[cfg(any(feature = "rabbitmq", feature = "redis-streams", feature = "sqs"))]
mod batch;
mod error;
#[cfg(any(feature = "nats", feature = "sqs", feature = "redis-streams"))]
mod hold;
pub mod horizon;
#[cfg(feature = "_tokio")]
mod idle;
mod names;
#[cfg(any(feature = "redis-streams", feature = "sqs", feature = "kafka"))]
mod pull;
mod raw;
mod setting;
mod tls;

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-streams")))]
pub mod redis_streams;
#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
pub mod sqs;

pub use error::BrokerError;
pub use idem_core::duration::{parse_duration, show as show_duration, DurationError};
#[cfg(feature = "_tokio")]
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
pub use idle::{until_idle, UntilIdle};
pub use names::{dead_letter_name, DEAD_LETTER_REASON_HEADER};

// The README's example, run as a doctest (it needs the `redis-streams` adapter).
#[cfg(all(doctest, feature = "redis-streams"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
