//! NATS JetStream through async-nats (feature `nats`).
//!
//! - **Names**: a `NAME` is a JetStream stream on subject `NAME`, file storage, created if
//!   missing. JetStream stream names cannot contain `.`, so the stream is named after the
//!   subject with `.` replaced by `_` ([`stream_name`]): the dead letters of `grants` are
//!   on subject `grants.dead-letter`, in the stream `grants_dead-letter`.
//! - **Consuming** ([`NatsConsumer`]): a durable pull consumer (default name `idem`,
//!   explicit acks, [`NatsConfig::ack_wait`] and [`NatsConfig::max_deliver`], default 20,
//!   above the core's `max_attempts`). An existing durable is read, never rewritten: a
//!   different ack policy, ack wait or `max_deliver` is a [`BrokerError::Config`]. A
//!   delivery's attempt is the server's delivery count. While a delivery is taken and not
//!   settled, `+WPI` (progress) is sent for it every third of the ack wait, so a slow
//!   handler is not redelivered mid-work. [`NatsAcker`] confirms every settlement (the
//!   ack is a request; the server's reply is awaited): `ack` → a double ack;
//!   `nack(delay)` → `-NAK` with the delay; `dead_letter` → a confirmed publish to
//!   `NAME.dead-letter` with the reason in the
//!   [`DEAD_LETTER_REASON_HEADER`](crate::DEAD_LETTER_REASON_HEADER) header, then `+TERM`
//!   (no more redeliveries; a failed publish naks with a 5 s delay). A delivery not acked
//!   within `ack_wait` of its last progress (a crash, a dropped acker) is redelivered.
//!   Missed heartbeats (a server that stays down) end the stream with an error, so a
//!   supervisor reconnects and its timeout applies.
//! - **Publishing** ([`NatsPublisher`]): each outbox event with its id both as
//!   `Nats-Msg-Id` (the stream's duplicate window drops a republish) and in the
//!   [`EVENT_ID_HEADER`](idem_core::outbox::EVENT_ID_HEADER) header; `publish` waits for
//!   every JetStream publish ack.
//! - **Counting** ([`pending_count`]): the durable consumer's pending (not yet delivered)
//!   plus ack-pending (delivered, not acked) messages; the stream's messages when the
//!   durable does not exist yet (it is not created here).
//! - **URL parameters** (`nats://127.0.0.1:4222?ack_wait=5s`, read by
//!   [`NatsConfig::from_url`], whose table gives their defaults and values): `ack_wait`
//!   (default `30s`), `durable` (default `idem`) and `max_deliver` (default 20, `-1` for
//!   none). async-nats reads no query parameters: any other is an error.

mod config;
mod consumer;
mod publisher;

pub use config::{NatsConfig, DEFAULT_MAX_DELIVER};
pub use consumer::{NatsAcker, NatsConsumer};
pub use publisher::{pending_count, publish_raw, NatsPublisher};

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::BrokerError;

pub(crate) const BROKER: &str = "nats";

/// The JetStream stream that holds subject `name`: `name` with `.` replaced by `_`.
///
/// ```
/// assert_eq!(idem_broker::nats::stream_name("grants.dead-letter"), "grants_dead-letter");
/// ```
pub fn stream_name(name: &str) -> String {
    name.replace('.', "_")
}

pub(crate) fn check_name(name: &str) -> Result<(), BrokerError> {
    let bad = |reason: &str| BrokerError::InvalidName {
        name: name.to_owned(),
        reason: reason.to_owned(),
    };
    if name.is_empty() {
        return Err(bad("empty"));
    }
    if name
        .chars()
        .any(|c| c.is_whitespace() || matches!(c, '*' | '>' | '/' | '\\'))
    {
        return Err(bad(
            "a JetStream subject and stream name cannot contain whitespace, '*', '>', '/' or '\\'",
        ));
    }
    if name.starts_with('.') || name.ends_with('.') || name.contains("..") {
        return Err(bad("empty subject token"));
    }
    Ok(())
}

pub(crate) async fn connect(url: &str) -> Result<jetstream::Context, BrokerError> {
    let client = async_nats::connect(url)
        .await
        .map_err(|e| BrokerError::connect(BROKER, e))?;
    Ok(jetstream::new(client))
}

/// Gets or creates the file-backed stream for subject `name`.
pub(crate) async fn ensure_stream(
    js: &jetstream::Context,
    name: &str,
    duplicate_window: Duration,
) -> Result<stream::Stream, BrokerError> {
    js.get_or_create_stream(stream::Config {
        name: stream_name(name),
        subjects: vec![name.to_owned()],
        storage: stream::StorageType::File,
        duplicate_window,
        ..Default::default()
    })
    .await
    .map_err(|e| BrokerError::op(BROKER, "stream create", e))
}
