//! RabbitMQ through lapin (feature `rabbitmq`).
//!
//! - **Names**: a `NAME` is a durable classic queue, declared if missing; messages are
//!   published through the default exchange with routing key `NAME`, persistent
//!   (`delivery_mode = 2`), with publisher confirms.
//! - **Consuming** ([`RabbitConsumer`]): manual acks on one channel whose prefetch
//!   (`basic.qos`) is set from the consumer's concurrency × batch size
//!   ([`RabbitConfig::prefetch_for`]). [`RabbitAcker`] settles a delivery:
//!   `ack` → `basic.ack`; a batch's [`ack_all`](idem_core::Acker::ack_all) → one
//!   `basic.ack` with `multiple = true` when the batch is exactly the channel's oldest
//!   outstanding deliveries (otherwise one ack each, never acking a neighbour's
//!   uncommitted delivery); `nack` → `basic.nack` with requeue (after the delay, holding
//!   the delivery meanwhile, since RabbitMQ has no delayed requeue); `dead_letter` →
//!   a confirmed, persistent publish to the durable queue `NAME.dead-letter` with the
//!   reason in the [`DEAD_LETTER_REASON_HEADER`](crate::DEAD_LETTER_REASON_HEADER)
//!   header, then `basic.ack`.
//! - A delivery whose channel closes unacked (a crash, a dropped consumer) goes back to
//!   the queue and is redelivered.
//! - **Publishing** ([`RabbitPublisher`]): each outbox event with its id in the
//!   [`EVENT_ID_HEADER`](idem_core::outbox::EVENT_ID_HEADER) header and as the AMQP
//!   `message_id`, `mandatory`, confirmed.
//! - **Counting** ([`pending_count`]): the queue's ready messages (a passive declare).
//!   AMQP does not report unacked ones; they count again once their channel closes.

mod config;
mod consumer;
mod publisher;

pub use config::RabbitConfig;
pub use consumer::{RabbitAcker, RabbitConsumer};
pub use publisher::{pending_count, publish_raw, RabbitPublisher};

use lapin::options::{ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};

use crate::BrokerError;

pub(crate) const BROKER: &str = "rabbitmq";

pub(crate) async fn connect(url: &str) -> Result<Connection, BrokerError> {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| BrokerError::connect(BROKER, e))
}

/// Declares the durable queue `name` (idempotent).
pub(crate) async fn declare(channel: &Channel, name: &str) -> Result<u32, BrokerError> {
    let q = channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| BrokerError::op(BROKER, "queue.declare", e))?;
    Ok(q.message_count())
}

/// A channel in confirm mode.
pub(crate) async fn confirm_channel(connection: &Connection) -> Result<Channel, BrokerError> {
    let ch = connection
        .create_channel()
        .await
        .map_err(|e| BrokerError::op(BROKER, "channel.open", e))?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| BrokerError::op(BROKER, "confirm.select", e))?;
    Ok(ch)
}

pub(crate) fn check_name(name: &str) -> Result<(), BrokerError> {
    if name.is_empty() || name.len() > 200 {
        return Err(BrokerError::InvalidName {
            name: name.to_owned(),
            reason: "a RabbitMQ queue name is 1 to 200 bytes (room for .dead-letter)".into(),
        });
    }
    if name.starts_with("amq.") {
        return Err(BrokerError::InvalidName {
            name: name.to_owned(),
            reason: "names starting with amq. are reserved by RabbitMQ".into(),
        });
    }
    Ok(())
}
