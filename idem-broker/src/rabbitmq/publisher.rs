//! Publishing to a queue with publisher confirms: [`RabbitPublisher`] for the relay,
//! [`publish_raw`] for bodies as they are, and [`pending_count`].

use std::time::Duration;

use async_trait::async_trait;
use idem_core::{OutboxEvent, PublishError, Publisher};
use lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use super::{
    check_name, confirm_channel, connect, declare, open, watch_blocking, RabbitConfig, BROKER,
};
use crate::BrokerError;

/// How many publishes are in flight before waiting for their confirms.
const CONFIRM_WINDOW: usize = 1_000;

/// Persistent (survives a broker restart).
const PERSISTENT: u8 = 2;

pub(super) struct OutMessage<'a> {
    pub(super) payload: &'a [u8],
    pub(super) headers: &'a [(String, String)],
    pub(super) message_id: Option<String>,
}

/// Publishes `msgs` in order through the default exchange to `queue` (persistent,
/// mandatory) and waits until the broker confirmed every one, each window of publishes
/// within `confirm_timeout`: a connection the broker blocks (a resource alarm) would
/// otherwise hold the caller for as long as the alarm lasts.
pub(super) async fn confirmed_publish(
    channel: &Channel,
    queue: &str,
    msgs: &[OutMessage<'_>],
    confirm_timeout: Duration,
) -> Result<(), BrokerError> {
    for chunk in msgs.chunks(CONFIRM_WINDOW) {
        within_confirm_timeout(confirm_timeout, publish_window(channel, queue, chunk)).await?;
    }
    Ok(())
}

/// `publish`, or [`BrokerError::NotConfirmed`] (retryable) when it takes longer than
/// `confirm_timeout`. A publish given up on may still reach the queue later (the frames
/// are sent when the connection is unblocked), so the caller treats it as "maybe
/// published": it retries, and never takes it for a refusal.
async fn within_confirm_timeout<T>(
    confirm_timeout: Duration,
    publish: impl std::future::Future<Output = Result<T, BrokerError>>,
) -> Result<T, BrokerError> {
    match tokio::time::timeout(confirm_timeout, publish).await {
        Ok(r) => r,
        Err(_) => Err(BrokerError::NotConfirmed {
            broker: BROKER,
            detail: format!(
                "no publisher confirm within {} (confirm_timeout); the broker may be \
                 blocking the connection (a memory or disk alarm)",
                crate::show_duration(confirm_timeout)
            ),
        }),
    }
}

/// One window of [`confirmed_publish`]: every publish sent, then every confirm awaited.
async fn publish_window(
    channel: &Channel,
    queue: &str,
    chunk: &[OutMessage<'_>],
) -> Result<(), BrokerError> {
    let mut confirms = Vec::with_capacity(chunk.len());
    for m in chunk {
        let mut props = BasicProperties::default().with_delivery_mode(PERSISTENT);
        if !m.headers.is_empty() {
            let mut table = FieldTable::default();
            for (k, v) in m.headers {
                table.insert(
                    ShortString::from(k.as_str()),
                    AMQPValue::LongString(v.as_str().into()),
                );
            }
            props = props.with_headers(table);
        }
        if let Some(id) = &m.message_id {
            props = props.with_message_id(id.as_str().into());
        }
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                m.payload,
                props,
            )
            .await
            .map_err(|e| publish_error("basic.publish", e))?;
        confirms.push(confirm);
    }
    for confirm in confirms {
        let c = confirm
            .await
            .map_err(|e| publish_error("publisher confirm", e))?;
        if c.is_nack() {
            return Err(BrokerError::NotConfirmed {
                broker: BROKER,
                detail: "the broker nacked a publish".into(),
            });
        }
        if let Some(returned) = c.take_message() {
            return Err(BrokerError::NotConfirmed {
                broker: BROKER,
                detail: format!(
                    "message returned unroutable: {} {}",
                    returned.reply_code, returned.reply_text
                ),
            });
        }
    }
    Ok(())
}

/// Publishes outbox events to a durable queue, with publisher confirms.
///
/// Each event is persistent, carries its id in the
/// [`EVENT_ID_HEADER`](idem_core::outbox::EVENT_ID_HEADER) header and as the AMQP
/// `message_id`, and its type in
/// [`EVENT_TYPE_HEADER`](idem_core::outbox::EVENT_TYPE_HEADER).
/// [`publish`](Publisher::publish) returns once the broker confirmed every event, or
/// fails with a retryable [`BrokerError::NotConfirmed`] when the confirms take longer than
/// [`RabbitConfig::confirm_timeout`].
pub struct RabbitPublisher {
    _connection: Connection,
    channel: Channel,
    queue: String,
    confirm_timeout: Duration,
}

impl std::fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitPublisher")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl RabbitPublisher {
    /// Connects and declares the durable queue `name` with the default settings (a
    /// quorum queue, see [`RabbitConfig`]).
    ///
    /// # Errors
    /// The broker cannot be reached, or the name is refused.
    pub async fn connect(url: &str, name: &str) -> Result<Self, BrokerError> {
        Self::connect_with(&RabbitConfig::new(url, name)).await
    }

    /// Connects and declares the durable queue `config.name` as `config` says (the same
    /// arguments a consumer of it declares).
    ///
    /// # Errors
    /// The broker cannot be reached, the name is refused, a quorum `delivery_limit` of 0
    /// ([`BrokerError::InvalidParam`]), or the queue exists with other arguments
    /// ([`BrokerError::Config`]).
    pub async fn connect_with(config: &RabbitConfig) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        config.check()?;
        super::within_connection_timeout(&config.url, async |opening| {
            let connection = open(&config.url, opening).await?;
            Self::from_connection(connection, config).await
        })
        .await
    }

    /// As [`connect_with`](Self::connect_with), on a connection the application opened
    /// itself (its TLS settings, credentials, connection properties), which is the
    /// publisher's from now on (a channel of its own, in confirm mode). `config.url` is
    /// not used; everything else in `config` is.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_broker::rabbitmq::{RabbitConfig, RabbitPublisher};
    /// use lapin::{Connection, ConnectionProperties};
    ///
    /// let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
    /// let connection = Connection::connect(url, ConnectionProperties::default()).await?;
    /// let publisher =
    ///     RabbitPublisher::from_connection(connection, &RabbitConfig::new(url, "grants")).await?;
    /// publisher.publish_raw(&[b"{}".to_vec()]).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The name is refused, a quorum `delivery_limit` of 0
    /// ([`BrokerError::InvalidParam`]), the queue exists with other arguments
    /// ([`BrokerError::Config`]), or the connection is closed.
    pub async fn from_connection(
        connection: Connection,
        config: &RabbitConfig,
    ) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        config.check()?;
        watch_blocking(&connection);
        let channel = confirm_channel(&connection).await?;
        declare(&channel, &config.name, config).await?;
        Ok(Self {
            _connection: connection,
            channel,
            queue: config.name.clone(),
            confirm_timeout: config.confirm_timeout,
        })
    }

    /// As [`publish_raw`](Self::publish_raw), each message with `headers` (AMQP long
    /// strings).
    ///
    /// # Errors
    /// As [`publish_raw`](Self::publish_raw).
    pub async fn publish_raw_with_headers(
        &self,
        bodies: &[Vec<u8>],
        headers: &[(String, String)],
    ) -> Result<(), BrokerError> {
        let msgs: Vec<OutMessage<'_>> = bodies
            .iter()
            .map(|b| OutMessage {
                payload: b,
                headers,
                message_id: None,
            })
            .collect();
        confirmed_publish(&self.channel, &self.queue, &msgs, self.confirm_timeout).await
    }
}

#[async_trait]
impl Publisher for RabbitPublisher {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        let headers: Vec<Vec<(String, String)>> = events.iter().map(OutboxEvent::headers).collect();
        let msgs: Vec<OutMessage<'_>> = events
            .iter()
            .zip(&headers)
            .map(|(e, h)| OutMessage {
                payload: &e.payload,
                headers: h,
                message_id: Some(e.event_id.to_string()),
            })
            .collect();
        confirmed_publish(&self.channel, &self.queue, &msgs, self.confirm_timeout)
            .await
            .map_err(Into::into)
    }
}

crate::raw::raw_publishing! {
    /// Publishes each body as it is (persistent, confirmed), in order.
    ///
    /// # Errors
    /// A failed publish, a refused confirm or none within the confirm timeout; bodies
    /// before it may have been published.
    method of RabbitPublisher;
    /// Publishes each body to the durable queue `name` as it is (see
    /// [`RabbitPublisher::publish_raw`]).
    ///
    /// # Errors
    /// As [`RabbitPublisher::connect`] and [`RabbitPublisher::publish_raw`].
    fn publish_raw(url: &str, name: &str);
}

/// The ready messages of queue `name` (0 when it does not exist). AMQP does not report
/// unacked deliveries; they count again once their consumer's channel closes.
///
/// # Errors
/// The broker cannot be reached.
pub async fn pending_count(url: &str, name: &str) -> Result<u64, BrokerError> {
    check_name(name)?;
    let connection = connect(url).await?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| BrokerError::op(BROKER, "channel.open", e))?;
    let n = match channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
    {
        Ok(q) => u64::from(q.message_count()),
        // A passive declare of a missing queue closes the channel with NOT_FOUND.
        Err(e) if is_not_found(&e) => 0,
        Err(e) => return Err(BrokerError::op(BROKER, "queue.declare (passive)", e)),
    };
    let _ = connection.close(200, "done".into()).await;
    Ok(n)
}

/// A publish error; not retryable when the broker closed the channel with 406
/// `PRECONDITION_FAILED`, which a publish gets for a message over `max_message_size`: no
/// retry helps, and the relay moves the event aside rather than retrying it forever.
fn publish_error(action: &'static str, e: lapin::Error) -> BrokerError {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    let refused = matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(p)
            if *p.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    );
    BrokerError::Operation {
        broker: BROKER,
        action,
        retryable: !refused,
        source: Box::new(e),
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(p) if *p.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A confirm that never comes (a connection blocked by a resource alarm) ends in a
    /// retryable `NotConfirmed` after the confirm timeout, never in an endless wait or a
    /// success.
    #[tokio::test]
    async fn a_confirm_that_never_comes_is_a_retryable_error_after_the_timeout() {
        let started = std::time::Instant::now();
        let err = within_confirm_timeout(
            Duration::from_millis(50),
            std::future::pending::<Result<(), BrokerError>>(),
        )
        .await
        .expect_err("no confirm");
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert!(matches!(err, BrokerError::NotConfirmed { .. }), "{err:?}");
        assert!(err.is_retryable());
        assert!(err.to_string().contains("50ms"), "{err}");
        // A confirm within the timeout is the publish's own result.
        within_confirm_timeout(Duration::from_secs(5), async { Ok(()) })
            .await
            .expect("confirmed");
    }
}
