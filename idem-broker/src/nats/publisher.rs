//! Publishing to a JetStream stream: [`NatsPublisher`] for the relay, [`publish_raw`] for
//! bodies as they are, and [`pending_count`].

use async_nats::jetstream::{self, context::PublishAckFuture};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use async_trait::async_trait;
use idem_core::{OutboxEvent, PublishError, Publisher};

use super::{check_name, connect_client, open_stream, NatsConfig, BROKER};
use crate::BrokerError;

/// How many publishes are in flight before waiting for their acks.
const ACK_WINDOW: usize = 1_000;

/// One message to publish: the payload, its headers, and its `Nats-Msg-Id` if any.
pub(super) type OutMessage = (Vec<u8>, Vec<(String, String)>, Option<String>);

/// Publishes `(payload, headers, msg_id)` in order to `subject` and waits for every
/// JetStream publish ack.
pub(super) async fn publish_confirmed(
    js: &jetstream::Context,
    subject: &str,
    msgs: Vec<OutMessage>,
) -> Result<(), BrokerError> {
    let mut pending: Vec<PublishAckFuture> = Vec::new();
    for (payload, headers, msg_id) in msgs {
        let mut h = HeaderMap::new();
        for (k, v) in &headers {
            h.insert(header_name(k)?, header_value(k, v)?);
        }
        if let Some(id) = msg_id {
            h.insert("Nats-Msg-Id", header_value("Nats-Msg-Id", &id)?);
        }
        let ack = js
            .publish_with_headers(subject.to_owned(), h, payload.into())
            .await
            .map_err(|e| BrokerError::Operation {
                broker: BROKER,
                action: "publish",
                // Over the server's max_payload: no retry helps (the relay moves the
                // event aside rather than retrying its batch forever).
                retryable: e.kind() != jetstream::context::PublishErrorKind::MaxPayloadExceeded,
                source: Box::new(e),
            })?;
        pending.push(ack);
        if pending.len() >= ACK_WINDOW {
            wait_all(std::mem::take(&mut pending)).await?;
        }
    }
    wait_all(pending).await
}

/// A header's name, refused (not retryable) where async-nats would panic: a control
/// character, a non-ASCII one or `:`.
fn header_name(name: &str) -> Result<HeaderName, BrokerError> {
    name.parse().map_err(|_| BrokerError::Operation {
        broker: BROKER,
        action: "publish",
        retryable: false,
        source: format!(
            "header name {name:?}: NATS header names take printable ASCII other than ':'"
        )
        .into(),
    })
}

/// A header's value, refused (not retryable) where async-nats would panic: a value with a
/// CR or LF, which would also end the header line and could forge another header (a
/// `Nats-Msg-Id` the server dedups by). The value itself is not repeated in the error.
fn header_value(name: &str, value: &str) -> Result<HeaderValue, BrokerError> {
    value.parse().map_err(|_| BrokerError::Operation {
        broker: BROKER,
        action: "publish",
        retryable: false,
        source: format!("header {name:?}: a NATS header value cannot contain CR or LF").into(),
    })
}

async fn wait_all(pending: Vec<PublishAckFuture>) -> Result<(), BrokerError> {
    for ack in pending {
        ack.await.map_err(|e| {
            if refused_for_good(&e) {
                // Over the stream's `max_msg_size` (payload, or headers): no retry helps.
                BrokerError::Operation {
                    broker: BROKER,
                    action: "publish",
                    retryable: false,
                    source: Box::new(e),
                }
            } else {
                BrokerError::NotConfirmed {
                    broker: BROKER,
                    detail: e.to_string(),
                }
            }
        })?;
    }
    Ok(())
}

/// Whether the stream refused the message itself, so that no retry can help: JetStream's
/// "message size exceeds maximum allowed" (10054) or "header size exceeds maximum
/// allowed" (10097), a stream's `max_msg_size` below the message.
fn refused_for_good(e: &jetstream::context::PublishError) -> bool {
    use async_nats::jetstream::ErrorCode;
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .is_some_and(|j| {
            matches!(
                j.error_code(),
                ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
                    | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM
            )
        })
}

/// Publishes outbox events to a JetStream stream.
///
/// Each event carries its id as `Nats-Msg-Id` (a republish within the stream's duplicate
/// window is dropped by the server) and in the
/// [`EVENT_ID_HEADER`](idem_core::outbox::EVENT_ID_HEADER) header, and its type in
/// [`EVENT_TYPE_HEADER`](idem_core::outbox::EVENT_TYPE_HEADER).
#[derive(Debug)]
pub struct NatsPublisher {
    js: jetstream::Context,
    subject: String,
}

impl NatsPublisher {
    /// Connects and creates the stream for subject `name` if missing.
    ///
    /// # Errors
    /// The server cannot be reached, or the name is refused.
    pub async fn connect(url: &str, name: &str) -> Result<Self, BrokerError> {
        check_name(name)?;
        let client = connect_client(url).await?;
        Self::from_client(client, &NatsConfig::new(url, name)).await
    }

    /// As [`connect`](Self::connect), through `client`: a client the application
    /// connected itself (credentials, TLS, name, callbacks), shared with its other uses.
    /// Publishes go to subject `config.name`, whose stream is created if missing with
    /// `config.duplicate_window`; `config.url` is not used.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_broker::nats::{NatsConfig, NatsPublisher};
    ///
    /// let client = async_nats::connect("nats://127.0.0.1:4222").await?;
    /// let publisher =
    ///     NatsPublisher::from_client(client, &NatsConfig::new("nats://127.0.0.1:4222", "grants"))
    ///         .await?;
    /// publisher.publish_raw(&[b"{}".to_vec()]).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The name is refused, or the stream cannot be created.
    pub async fn from_client(
        client: async_nats::Client,
        config: &NatsConfig,
    ) -> Result<Self, BrokerError> {
        let (js, _) = open_stream(client, config).await?;
        Ok(Self {
            js,
            subject: config.name.clone(),
        })
    }

    /// The largest message, payload and headers, the server takes (its `max_payload`):
    /// a larger event is refused for good (see [`Publisher::publish`]).
    pub fn max_payload(&self) -> usize {
        self.js.client().max_payload()
    }

    /// As [`publish_raw`](Self::publish_raw), each message with `headers` (NATS
    /// headers).
    ///
    /// # Errors
    /// As [`publish_raw`](Self::publish_raw).
    pub async fn publish_raw_with_headers(
        &self,
        bodies: &[Vec<u8>],
        headers: &[(String, String)],
    ) -> Result<(), BrokerError> {
        publish_confirmed(
            &self.js,
            &self.subject,
            bodies
                .iter()
                .map(|b| (b.clone(), headers.to_vec(), None))
                .collect(),
        )
        .await
    }
}

#[async_trait]
impl Publisher for NatsPublisher {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        let msgs = events
            .iter()
            .map(|e| (e.payload.clone(), e.headers(), Some(e.event_id.to_string())))
            .collect();
        publish_confirmed(&self.js, &self.subject, msgs)
            .await
            .map_err(Into::into)
    }
}

crate::raw::raw_publishing! {
    /// Publishes each body as it is (no `Nats-Msg-Id`, so equal bodies stay two
    /// messages), in order, waiting for every ack.
    ///
    /// # Errors
    /// A failed or unacknowledged publish; bodies before it may have been published.
    method of NatsPublisher;
    /// Publishes each body to subject `name` as it is (see [`NatsPublisher::publish_raw`]).
    ///
    /// # Errors
    /// As [`NatsPublisher::connect`] and [`NatsPublisher::publish_raw`].
    fn publish_raw(url: &str, name: &str);
}

/// What the durable consumer `durable` of `name` has not settled: messages not yet
/// delivered plus messages delivered and not acked. The stream is created if missing; a
/// missing durable is not created (a consumer creates it with its own settings): every
/// message in the stream is then still to be delivered.
///
/// # Errors
/// The server cannot be reached.
pub async fn pending_count(url: &str, name: &str, durable: &str) -> Result<u64, BrokerError> {
    use async_nats::jetstream::context::ConsumerInfoErrorKind;
    check_name(name)?;
    let config = NatsConfig::new(url, name).with_durable(durable);
    let (_, mut stream) = open_stream(connect_client(url).await?, &config).await?;
    match stream.consumer_info(durable).await {
        Ok(info) => Ok(info.num_pending + info.num_ack_pending as u64),
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => {
            let info = stream
                .info()
                .await
                .map_err(|e| BrokerError::op(BROKER, "stream info", e))?;
            Ok(info.state.messages)
        }
        Err(e) => Err(BrokerError::op(BROKER, "consumer info", e)),
    }
}
