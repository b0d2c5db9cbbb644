//! Consuming a queue: [`RabbitConsumer`] and its [`RabbitAcker`].

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use futures::Stream;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use super::config::RabbitConfig;
use super::publisher::{confirmed_publish, OutMessage};
use super::{check_name, confirm_channel, connect, declare, BROKER};
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

/// What every acker of one consumer shares: the channel, the dead-letter channel, and
/// the delivery tags handed out and not yet settled (for safe multiple-acks).
struct Shared {
    channel: Channel,
    dead_letters: Channel,
    dead_letter_queue: String,
    outstanding: Mutex<BTreeSet<u64>>,
}

impl Shared {
    fn outstanding(&self) -> std::sync::MutexGuard<'_, BTreeSet<u64>> {
        self.outstanding
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn forget(&self, tag: u64) {
        self.outstanding().remove(&tag);
    }

    async fn ack_one(&self, tag: u64) -> Result<(), AckError> {
        self.forget(tag);
        self.channel
            .basic_ack(tag, BasicAckOptions { multiple: false })
            .await
            .map_err(|e| BrokerError::op(BROKER, "basic.ack", e).into())
    }

    async fn requeue(&self, tag: u64) -> Result<(), AckError> {
        self.forget(tag);
        self.channel
            .basic_nack(
                tag,
                BasicNackOptions {
                    multiple: false,
                    requeue: true,
                },
            )
            .await
            .map_err(|e| BrokerError::op(BROKER, "basic.nack", e).into())
    }
}

/// Deliveries from a RabbitMQ queue, as a stream of
/// `Result<Delivery<RabbitAcker>, BrokerError>`.
///
/// The connection closes when the consumer and every acker are dropped; deliveries not
/// acked by then go back to the queue.
pub struct RabbitConsumer {
    // Kept so the connection lives as long as the stream.
    _connection: Connection,
    inner: lapin::Consumer,
    shared: Arc<Shared>,
    queue: String,
}

impl std::fmt::Debug for RabbitConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConsumer")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl RabbitConsumer {
    /// Connects, declares the queue and its dead-letter queue (durable), sets the
    /// prefetch and starts consuming with manual acks.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the broker cannot be reached; an invalid name; a
    /// refused declaration.
    pub async fn connect(config: &RabbitConfig) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        let connection = connect(&config.url).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| BrokerError::op(BROKER, "channel.open", e))?;
        declare(&channel, &config.name).await?;
        let dead_letters = confirm_channel(&connection).await?;
        let dead_letter_queue = dead_letter_name(&config.name);
        declare(&dead_letters, &dead_letter_queue).await?;
        channel
            .basic_qos(config.prefetch.max(1), BasicQosOptions { global: false })
            .await
            .map_err(|e| BrokerError::op(BROKER, "basic.qos", e))?;
        let inner = channel
            .basic_consume(
                config.name.as_str().into(),
                config.consumer_tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| BrokerError::op(BROKER, "basic.consume", e))?;
        Ok(Self {
            _connection: connection,
            inner,
            shared: Arc::new(Shared {
                channel,
                dead_letters,
                dead_letter_queue,
                outstanding: Mutex::new(BTreeSet::new()),
            }),
            queue: config.name.clone(),
        })
    }
}

impl Stream for RabbitConsumer {
    type Item = Result<Delivery<RabbitAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match Pin::new(&mut self.inner).poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(BrokerError::Operation {
                broker: BROKER,
                action: "basic.consume",
                retryable: true,
                source: Box::new(e),
            }))),
            Poll::Ready(Some(Ok(d))) => {
                let tag = d.delivery_tag;
                self.shared.outstanding().insert(tag);
                let headers = headers_of(&d.properties);
                Poll::Ready(Some(Ok(Delivery {
                    payload: d.data,
                    headers,
                    attempt: None,
                    acker: RabbitAcker {
                        tag,
                        shared: Arc::clone(&self.shared),
                    },
                })))
            }
        }
    }
}

/// The AMQP headers (and `message_id`, as `message-id`) as text.
fn headers_of(props: &lapin::BasicProperties) -> Headers {
    let mut out = Headers::new();
    if let Some(id) = props.message_id() {
        out.push(("message-id".to_owned(), id.as_str().to_owned()));
    }
    if let Some(table) = props.headers() {
        for (k, v) in table.inner() {
            out.push((k.as_str().to_owned(), value_text(v)));
        }
    }
    out
}

fn value_text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::ByteArray(b) => String::from_utf8_lossy(b.as_slice()).into_owned(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        AMQPValue::Float(n) => n.to_string(),
        AMQPValue::Double(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

/// Settles one RabbitMQ delivery on the channel it came from.
pub struct RabbitAcker {
    tag: u64,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RabbitAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitAcker")
            .field("delivery_tag", &self.tag)
            .finish_non_exhaustive()
    }
}

impl RabbitAcker {
    /// The delivery tag (per channel).
    pub fn delivery_tag(&self) -> u64 {
        self.tag
    }
}

#[async_trait]
impl Acker for RabbitAcker {
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        self.shared.ack_one(self.tag).await
    }

    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        match delay {
            Some(d) if !d.is_zero() => {
                // RabbitMQ has no delayed requeue: hold the delivery (it stays unacked,
                // so no one else gets it) and requeue it after the delay. If the process
                // dies meanwhile, the channel closes and the broker requeues it anyway.
                let shared = Arc::clone(&self.shared);
                let tag = self.tag;
                tokio::spawn(async move {
                    tokio::time::sleep(d).await;
                    if let Err(e) = shared.requeue(tag).await {
                        tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "delayed requeue failed; the broker requeues on channel close");
                    }
                });
                Ok(())
            }
            _ => self.shared.requeue(self.tag).await,
        }
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let mut out: Vec<(String, String)> = headers
            .iter()
            .filter(|(k, _)| k != "message-id" && k != DEAD_LETTER_REASON_HEADER)
            .cloned()
            .collect();
        out.push((DEAD_LETTER_REASON_HEADER.to_owned(), reason.to_string()));
        let msg = OutMessage {
            payload,
            headers: &out,
            message_id: None,
        };
        let published = confirmed_publish(
            &self.shared.dead_letters,
            &self.shared.dead_letter_queue,
            std::slice::from_ref(&msg),
        )
        .await;
        match published {
            Ok(()) => self.shared.ack_one(self.tag).await,
            Err(e) => {
                // Not dead-lettered: give the delivery back rather than lose it.
                let _ = self.shared.requeue(self.tag).await;
                Err(e.into())
            }
        }
    }

    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        let n = items.len();
        let Some((first, _)) = items.first() else {
            return Vec::new();
        };
        let shared = Arc::clone(&first.shared);
        let same_channel = items.iter().all(|(a, _)| Arc::ptr_eq(&a.shared, &shared));
        let tags: BTreeSet<u64> = items.iter().map(|(a, _)| a.tag).collect();
        let max = tags.last().copied();
        // A multiple-ack acks every outstanding tag up to `max`: only correct when those
        // are exactly this batch (no neighbour's uncommitted delivery below `max`).
        let contiguous = same_channel
            && tags.len() == n
            && max.is_some_and(|max| {
                let mut out = shared.outstanding();
                let below: Vec<u64> = out.range(..=max).copied().collect();
                let ok = below.len() == tags.len() && below.iter().all(|t| tags.contains(t));
                if ok {
                    for t in &below {
                        out.remove(t);
                    }
                }
                ok
            });
        if let (true, Some(max)) = (contiguous, max) {
            let r = shared
                .channel
                .basic_ack(max, BasicAckOptions { multiple: true })
                .await
                .map_err(|e| BrokerError::op(BROKER, "basic.ack (multiple)", e));
            return match r {
                Ok(()) => (0..n).map(|_| Ok(())).collect(),
                Err(e) => {
                    let e: AckError = e.into();
                    (0..n)
                        .map(|_| Err(AckError::new(e.message.clone(), e.retryable, None)))
                        .collect()
                }
            };
        }
        let mut out = Vec::with_capacity(n);
        for (acker, _proof) in items {
            out.push(acker.shared.ack_one(acker.tag).await);
        }
        out
    }
}
