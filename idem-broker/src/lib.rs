//! # idem-broker
//!
//! Broker adapters for idem: each turns its broker's deliveries into
//! [`idem_core::Delivery`]s whose [`idem_core::Acker`] speaks the broker's own settlement
//! (ack, nack with a delay, dead-letter with a reason), and implements
//! [`idem_core::Publisher`] for the outbox relay.
//!
//! One cargo feature per broker, each module alike in shape (`config`, `consumer`,
//! `publisher`):
//!
//! | feature | module | client |
//! |---|---|---|
//! | `rabbitmq` | [`rabbitmq`] | lapin: manual acks, prefetch, multiple-ack, publisher confirms |
//! | `nats` | [`nats`] | async-nats: JetStream durable pull consumer, `nak` with delay, `Nats-Msg-Id` |
//! | `redis-streams` | [`redis_streams`] | fred: consumer groups, `XAUTOCLAIM` |
//! | `sqs` | [`sqs`] | aws-sdk-sqs: long polls, `DeleteMessage` / visibility timeout, batch deletes |
//! | `kafka` | [`kafka`] | rdkafka (librdkafka built from source, no cmake): consumer groups, low-water-mark offset commits, idempotent producer |
//!
//! A `NAME` means the same thing on both sides and is created if missing: a durable
//! RabbitMQ queue (published through the default exchange), a JetStream stream on subject
//! `NAME` (file storage) with a durable consumer, a Redis stream key with a consumer group,
//! an SQS queue, a Kafka topic.
//! Rejected input goes to `NAME.dead-letter` of the same kind, with its reason in the
//! [`DEAD_LETTER_REASON_HEADER`] header (or stream field).
//!
//! The [`any`] module is always compiled: [`any::BrokerUrl::parse`] picks the adapter
//! from the URL scheme (`amqp://`, `nats://`, `redis://`, `sqs://`, `kafka://`), so a
//! command dispatches once.
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
//!     // hand it to an `idem_core::Gate`, which acks only after the commit
//! }
//! # Ok(()) }
//! ```

pub mod any;
mod error;
pub mod horizon;
#[cfg(feature = "_tokio")]
mod idle;
mod names;
#[cfg(any(feature = "redis-streams", feature = "sqs", feature = "kafka"))]
mod pull;

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
pub mod redis_streams;
#[cfg(feature = "sqs")]
pub mod sqs;

pub use error::BrokerError;
#[cfg(feature = "_tokio")]
pub use idle::{until_idle, UntilIdle};
pub use names::{dead_letter_name, parse_duration, DEAD_LETTER_REASON_HEADER};
