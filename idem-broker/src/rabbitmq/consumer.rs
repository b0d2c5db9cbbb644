//! Consuming a queue: [`RabbitConsumer`] and its [`RabbitAcker`].
//!
//! Settling is one step per channel: every ack, nack and dead-letter takes the channel's
//! settle lock, updates the set of outstanding delivery tags and sends its frame before
//! the lock is released. A multiple-ack is decided from that set under the same lock, so
//! it can never cover a delivery another task is about to nack.

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use futures::Stream;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use super::config::{QueueType, RabbitConfig};
use super::publisher::{confirmed_publish, OutMessage};
use super::{check_name, confirm_channel, connect, declare, BROKER};
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

/// The longest a delayed nack holds its delivery before requeueing it.
const MAX_HOLD: Duration = Duration::from_secs(60);

/// How long a delivery whose dead-letter publish failed is held before it is requeued
/// (so a broken dead-letter queue is not a hot redelivery loop).
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(5);

/// The quorum queue header counting a message's earlier deliveries.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// What every acker of one consumer shares: the channel, the dead-letter channel, and
/// the delivery tags handed out and not yet settled (for safe multiple-acks).
struct Shared {
    channel: Channel,
    dead_letters: Channel,
    dead_letter_queue: String,
    /// Held from deciding a settlement until its frame is sent: one settlement at a time
    /// per channel, in the order decided.
    settle: tokio::sync::Mutex<()>,
    /// Tags delivered and not yet settled. Inserted by the stream, removed under
    /// `settle` only.
    outstanding: Mutex<BTreeSet<u64>>,
    /// Tags of deliveries dropped unsettled, requeued by the next settlement.
    dropped: Mutex<Vec<u64>>,
    /// Deliveries held for a delayed requeue.
    held: AtomicUsize,
    /// At most this many are held; past it a delayed nack requeues at once.
    hold_limit: usize,
    /// Set when the consumer is dropped: held deliveries are requeued at once.
    closing: tokio::sync::watch::Sender<bool>,
}

#[derive(Debug, Clone, Copy)]
enum Frame {
    Ack,
    Requeue,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    async fn send(&self, tag: u64, frame: Frame, multiple: bool) -> Result<(), BrokerError> {
        match frame {
            Frame::Ack => self
                .channel
                .basic_ack(tag, BasicAckOptions { multiple })
                .await
                .map_err(|e| BrokerError::op(BROKER, "basic.ack", e)),
            Frame::Requeue => self
                .channel
                .basic_nack(
                    tag,
                    BasicNackOptions {
                        multiple,
                        requeue: true,
                    },
                )
                .await
                .map_err(|e| BrokerError::op(BROKER, "basic.nack", e)),
        }
    }

    /// Requeues the deliveries dropped unsettled. Call with `settle` held.
    async fn flush_dropped(&self) {
        loop {
            // One at a time: cancelled midway, the rest stay listed.
            let Some(tag) = lock(&self.dropped).pop() else {
                return;
            };
            if lock(&self.outstanding).remove(&tag) {
                tracing::debug!(target: "idem::broker", broker = BROKER, tag, "requeueing a delivery dropped unsettled");
                if let Err(e) = self.send(tag, Frame::Requeue, false).await {
                    tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "requeue of a dropped delivery failed; the broker requeues it when the channel closes");
                }
            }
        }
    }

    /// Settles one delivery: one step under the settle lock.
    async fn settle_one(&self, tag: u64, frame: Frame) -> Result<(), AckError> {
        let _step = self.settle.lock().await;
        self.flush_dropped().await;
        lock(&self.outstanding).remove(&tag);
        self.send(tag, frame, false).await.map_err(Into::into)
    }

    /// Acks `tags` (all of this channel): one multiple-ack up to the highest tag below
    /// which every outstanding delivery is in `tags`, one ack each for the rest.
    async fn ack_many(&self, tags: &BTreeSet<u64>) -> Result<(), AckError> {
        let _step = self.settle.lock().await;
        self.flush_dropped().await;
        let cut = {
            let mut out = lock(&self.outstanding);
            let mut cut = None;
            let mut covered = 0usize;
            for t in out.iter() {
                if !tags.contains(t) {
                    break;
                }
                cut = Some(*t);
                covered += 1;
            }
            let cut = cut.filter(|_| covered > 1);
            for t in tags {
                out.remove(t);
            }
            cut
        };
        let rest: Vec<u64> = match cut {
            Some(c) => tags.range(c + 1..).copied().collect(),
            None => tags.iter().copied().collect(),
        };
        let multiple = async {
            match cut {
                Some(c) => self.send(c, Frame::Ack, true).await,
                None => Ok(()),
            }
        };
        // Every frame is queued, in order, on the first poll; then all are awaited.
        let singles =
            futures::future::join_all(rest.iter().map(|t| self.send(*t, Frame::Ack, false)));
        let (m, singles) = futures::join!(multiple, singles);
        m?;
        for r in singles {
            r?;
        }
        Ok(())
    }
}

/// A delivery tag not yet settled. Dropped while armed (the delivery was neither acked
/// nor nacked, e.g. its task was cancelled), it is requeued by a task spawned on the
/// current runtime, or by the channel's next settlement.
struct TagGuard {
    tag: u64,
    shared: Arc<Shared>,
    armed: bool,
}

impl TagGuard {
    fn disarm(&mut self) -> u64 {
        self.armed = false;
        self.tag
    }
}

impl Drop for TagGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        lock(&self.shared.dropped).push(self.tag);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let shared = Arc::clone(&self.shared);
            rt.spawn(async move {
                let _step = shared.settle.lock().await;
                shared.flush_dropped().await;
            });
        }
    }
}

/// Deliveries from a RabbitMQ queue, as a stream of
/// `Result<Delivery<RabbitAcker>, BrokerError>`.
///
/// The connection closes when the consumer and every acker are dropped; deliveries not
/// acked by then go back to the queue.
pub struct RabbitConsumer {
    // Kept so the connection lives as long as the stream.
    connection: Connection,
    inner: lapin::Consumer,
    shared: Arc<Shared>,
    queue: String,
    queue_type: QueueType,
}

impl std::fmt::Debug for RabbitConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConsumer")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl Drop for RabbitConsumer {
    fn drop(&mut self) {
        // Deliveries held for a delayed requeue go back now.
        self.shared.closing.send_replace(true);
    }
}

impl RabbitConsumer {
    /// Connects, declares the queue and its dead-letter queue (durable, of
    /// [`RabbitConfig::queue_type`]), sets the prefetch and starts consuming with manual
    /// acks.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the broker cannot be reached; an invalid name;
    /// [`BrokerError::Config`] when a queue exists with other arguments; a refused
    /// declaration.
    pub async fn connect(config: &RabbitConfig) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        let connection = connect(&config.url).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| BrokerError::op(BROKER, "channel.open", e))?;
        let dead_letters = confirm_channel(&connection).await?;
        let dead_letter_queue = dead_letter_name(&config.name);
        declare(&dead_letters, &dead_letter_queue, config).await?;
        declare(&channel, &config.name, config).await?;
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
            connection,
            inner,
            shared: Arc::new(Shared {
                channel,
                dead_letters,
                dead_letter_queue,
                settle: tokio::sync::Mutex::new(()),
                outstanding: Mutex::new(BTreeSet::new()),
                dropped: Mutex::new(Vec::new()),
                held: AtomicUsize::new(0),
                hold_limit: usize::from(config.prefetch / 2).max(1),
                closing: tokio::sync::watch::channel(false).0,
            }),
            queue: config.name.clone(),
            queue_type: config.queue_type,
        })
    }

    /// Closes the connection: every delivery not settled goes back to the queue, and
    /// settling one of this consumer's deliveries from now on is an error.
    ///
    /// # Errors
    /// The close handshake failed (the connection is gone either way).
    pub async fn close(&self) -> Result<(), BrokerError> {
        self.shared.closing.send_replace(true);
        self.connection
            .close(200, "consumer closed".into())
            .await
            .map_err(|e| BrokerError::op(BROKER, "connection.close", e))
    }

    /// How many deliveries this consumer handed out are not settled yet (held ones
    /// included).
    pub fn unsettled(&self) -> usize {
        lock(&self.shared.outstanding).len()
    }

    /// How many deliveries are held for a delayed requeue right now.
    pub fn held(&self) -> usize {
        self.shared.held.load(Ordering::Relaxed)
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
                lock(&self.shared.outstanding).insert(tag);
                let headers = headers_of(&d.properties);
                let attempt = attempt_of(&headers, self.queue_type);
                Poll::Ready(Some(Ok(Delivery {
                    payload: d.data,
                    headers,
                    attempt,
                    acker: RabbitAcker {
                        guard: TagGuard {
                            tag,
                            shared: Arc::clone(&self.shared),
                            armed: true,
                        },
                    },
                })))
            }
        }
    }
}

/// The attempt number: a quorum queue's `x-delivery-count` (earlier deliveries) + 1, 1
/// when it is absent; unknown for a classic queue.
fn attempt_of(headers: &Headers, queue_type: QueueType) -> Option<u32> {
    let count = headers
        .iter()
        .find(|(k, _)| k == DELIVERY_COUNT_HEADER)
        .and_then(|(_, v)| v.parse::<u32>().ok());
    match (count, queue_type) {
        (Some(n), _) => Some(n.saturating_add(1)),
        (None, QueueType::Quorum) => Some(1),
        (None, _) => None,
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

/// Settles one RabbitMQ delivery on the channel it came from. Dropped unsettled, the
/// delivery is requeued.
pub struct RabbitAcker {
    guard: TagGuard,
}

impl std::fmt::Debug for RabbitAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitAcker")
            .field("delivery_tag", &self.guard.tag)
            .finish_non_exhaustive()
    }
}

impl RabbitAcker {
    /// The delivery tag (per channel).
    pub fn delivery_tag(&self) -> u64 {
        self.guard.tag
    }

    fn shared(&self) -> Arc<Shared> {
        Arc::clone(&self.guard.shared)
    }
}

/// Holds delivery `tag` unacked (so no one else gets it) for `delay`, or until the
/// consumer is dropped, then requeues it. If the process dies meanwhile, the channel
/// closes and the broker requeues it anyway.
fn hold_then_requeue(shared: Arc<Shared>, tag: u64, delay: Duration) {
    shared.held.fetch_add(1, Ordering::Relaxed);
    let mut closing = shared.closing.subscribe();
    // Requeued by the next settlement if this task never runs to its end.
    let mut guard = TagGuard {
        tag,
        shared: Arc::clone(&shared),
        armed: true,
    };
    tokio::spawn(async move {
        tokio::select! {
            () = tokio::time::sleep(delay.min(MAX_HOLD)) => {}
            _ = closing.wait_for(|c| *c) => {}
        }
        let tag = guard.disarm();
        if let Err(e) = shared.settle_one(tag, Frame::Requeue).await {
            tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "delayed requeue failed; the broker requeues on channel close");
        }
        shared.held.fetch_sub(1, Ordering::Relaxed);
    });
}

#[async_trait]
impl Acker for RabbitAcker {
    async fn ack(mut self, _proof: AckProof) -> Result<(), AckError> {
        // Disarmed once settled: cancelled before, the guard requeues the delivery if
        // the settlement had not taken it off the outstanding set yet.
        let r = self.shared().settle_one(self.guard.tag, Frame::Ack).await;
        self.guard.disarm();
        r
    }

    /// `basic.nack` with requeue. RabbitMQ has no delayed requeue: with a delay, the
    /// delivery is held unacked for it (at most a minute) and then requeued; it keeps its
    /// prefetch slot meanwhile, so when half the prefetch is already held, it is
    /// requeued at once instead.
    async fn nack(mut self, delay: Option<Duration>) -> Result<(), AckError> {
        let shared = self.shared();
        match delay {
            Some(d) if !d.is_zero() && shared.held.load(Ordering::Relaxed) < shared.hold_limit => {
                hold_then_requeue(shared, self.guard.disarm(), d);
                Ok(())
            }
            _ => {
                let r = shared.settle_one(self.guard.tag, Frame::Requeue).await;
                self.guard.disarm();
                r
            }
        }
    }

    async fn dead_letter(
        mut self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let shared = self.shared();
        let mut out: Vec<(String, String)> = headers
            .iter()
            .filter(|(k, _)| {
                k != "message-id" && k != DEAD_LETTER_REASON_HEADER && k != DELIVERY_COUNT_HEADER
            })
            .cloned()
            .collect();
        out.push((DEAD_LETTER_REASON_HEADER.to_owned(), reason.to_string()));
        let msg = OutMessage {
            payload,
            headers: &out,
            message_id: None,
        };
        let published = confirmed_publish(
            &shared.dead_letters,
            &shared.dead_letter_queue,
            std::slice::from_ref(&msg),
        )
        .await;
        match published {
            Ok(()) => {
                let r = shared.settle_one(self.guard.tag, Frame::Ack).await;
                self.guard.disarm();
                r
            }
            Err(e) => {
                // Not dead-lettered: give the delivery back rather than lose it, after a
                // pause (an immediate requeue would loop as fast as the broker delivers).
                hold_then_requeue(shared, self.guard.disarm(), DEAD_LETTER_RETRY);
                Err(e.into())
            }
        }
    }

    /// One step under the channel's settle lock: a multiple-ack for the longest run of
    /// the channel's oldest outstanding deliveries that are all in the batch, one ack
    /// each for the rest.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        let n = items.len();
        let Some((first, _)) = items.first() else {
            return Vec::new();
        };
        let shared = first.shared();
        if !items
            .iter()
            .all(|(a, _)| Arc::ptr_eq(&a.guard.shared, &shared))
        {
            let mut out = Vec::with_capacity(n);
            for (acker, proof) in items {
                out.push(acker.ack(proof).await);
            }
            return out;
        }
        let mut ackers: Vec<Self> = items.into_iter().map(|(a, _)| a).collect();
        let tags: BTreeSet<u64> = ackers.iter().map(|a| a.guard.tag).collect();
        let r = shared.ack_many(&tags).await;
        for a in &mut ackers {
            a.guard.disarm();
        }
        match r {
            Ok(()) => (0..n).map(|_| Ok(())).collect(),
            Err(e) => (0..n)
                .map(|_| Err(AckError::new(e.message.clone(), e.retryable, None)))
                .collect(),
        }
    }
}
