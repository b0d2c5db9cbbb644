//! Consuming a queue: [`RabbitConsumer`] and its [`RabbitAcker`].
//!
//! Settling is one step per channel: every ack, reject, nack and dead-letter takes the
//! channel's settle lock, updates the set of outstanding delivery tags and sends its frame
//! before the lock is released. A multiple-ack is decided from that set under the same
//! lock, so it can never cover a delivery another task is about to reject.
//!
//! Which frame (or hold) each settlement becomes is decided by one pure function,
//! [`plan`]: a failed attempt is `basic.reject` with requeue (counted in `x-delivery-count`
//! by every RabbitMQ version), a deferral is held here and handed back through the
//! consumer's stream without any frame, and only a requeue that is nobody's failure (a
//! deferral past the hold limit, a delivery dropped unsettled) is `basic.nack` with
//! requeue (counted by 3.x and 4.0–4.2, not by 4.3+).

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use idem_core::Delivery;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::sync::mpsc;

use super::config::{QueueType, RabbitConfig};
use super::{check_name, declare, open, watch_blocking, BROKER};
use crate::{dead_letter_name, BrokerError};

mod acker;
mod plan;
mod shared;
#[cfg(test)]
mod tests;

pub use acker::RabbitAcker;
use acker::{attempt_of, headers_of, HandBack, Kept};
use shared::{lock, DeadLetters, Shared, TagGuard};

/// The longest one hold (a delayed failure, a deferral) keeps its delivery.
const MAX_HOLD: Duration = Duration::from_secs(60);

/// The longest a delivery is kept unacked here across deferrals, counted from its
/// arrival; a deferral that would keep it longer requeues it instead. Half RabbitMQ's
/// default `consumer_timeout` (30 minutes), past which the broker closes the channel of a
/// consumer that holds a delivery unacked.
const MAX_UNACKED: Duration = Duration::from_secs(15 * 60);

/// How long a delivery whose dead-letter publish failed is held before it is requeued
/// (so a broken dead-letter queue is not a hot redelivery loop).
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(5);

/// The quorum queue header counting a message's earlier deliveries.
const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// Deliveries from a RabbitMQ queue, as a stream of
/// `Result<Delivery<RabbitAcker>, BrokerError>`: the broker's deliveries, and deferred
/// ones handed back after their delay.
///
/// The connections close when the consumer and every acker are dropped; deliveries not
/// acked by then go back to the queue.
pub struct RabbitConsumer {
    // Kept so the connection lives as long as the stream.
    connection: Connection,
    inner: lapin::Consumer,
    shared: Arc<Shared>,
    /// Deferred deliveries whose delay has passed.
    handed_back: mpsc::UnboundedReceiver<HandBack>,
    queue: String,
    queue_type: QueueType,
    /// How many deliveries the consumer takes ahead now.
    pace: Pace,
    /// The prefetch of [`Pace::Full`] (the configured one).
    prefetch: u16,
    /// The configured consumer tag (empty: the server names each consumer).
    consumer_tag: String,
    /// The change to [`Pace::Full`] under way: the current consumer is being cancelled
    /// (the deliveries it received still come through it, then it ends) and this task
    /// starts its successor once no rerun is held.
    switch: Option<tokio::task::JoinHandle<Result<lapin::Consumer, BrokerError>>>,
    /// The consumer cancelled for a change of pace has ended: the next comes from
    /// `switch`.
    drained: bool,
}

/// How many deliveries a consumer of a quorum queue takes ahead.
///
/// A message that kills its consumer (an OOM kill, an abort) is returned with everything
/// that consumer held, and each return counts towards the queue's delivery limit. So
/// that a few such messages in one prefetch window do not push their innocent
/// neighbours to the limit (dead-lettered by RabbitMQ, without a reason) while the
/// process dies again and again on them, a consumer starts [`Solo`](Pace::Solo), one
/// delivery at a time: the reruns a restart finds at the head of the queue come alone,
/// and each death costs only the rerun that caused it. At the first delivery the queue
/// has not delivered before, and once no rerun is held, it goes [`Full`](Pace::Full): a
/// consumer's prefetch cannot change while it consumes (and a quorum queue refuses a
/// channel-wide one), so it cancels its consumer (what the broker sent already still
/// comes through) and consumes again at the configured prefetch; the delivery held by
/// the first consumer does not count against the second's prefetch, so one more than
/// the prefetch may be in hand around the change. A rerun that reaches a consumer at
/// full pace (handed over by another consumer that died) runs beside its window.
/// Classic and stream queues count nothing and always consume at full pace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pace {
    /// Prefetch 1.
    Solo,
    /// The configured prefetch.
    Full,
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
        // Held deliveries are settled now (deferred ones requeued).
        self.shared.closing.send_replace(true);
        if let Some(switch) = self.switch.take() {
            switch.abort();
        }
    }
}

impl RabbitConsumer {
    /// Connects, declares the queue and its dead-letter queue (durable, of
    /// [`RabbitConfig::queue_type`]), sets the prefetch and starts consuming with manual
    /// acks. Dead letters are published on a second connection of their own.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the broker cannot be reached; an invalid name;
    /// [`BrokerError::InvalidParam`] for a quorum `delivery_limit` of 0;
    /// [`BrokerError::Config`] when a queue exists with other arguments; a refused
    /// declaration.
    pub async fn connect(config: &RabbitConfig) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        config.check()?;
        super::within_connection_timeout(&config.url, async |opening| {
            let dead_letters = open(&config.url, opening).await?;
            let connection = open(&config.url, opening).await?;
            Self::start(connection, dead_letters, true, config).await
        })
        .await
    }

    /// As [`connect`](Self::connect), on connections the application opened itself
    /// (its TLS settings, credentials, connection properties): the consumer consumes and
    /// settles on `connection` and publishes dead letters on `dead_letters`, a second
    /// connection (RabbitMQ blocks a publishing connection in a resource alarm, and acks
    /// must not wait for that). Both are the consumer's from now on and closed by
    /// [`close`](Self::close). `config.url` is not used; everything else in `config` is.
    ///
    /// A lost `connection` ends the consumer's stream, as with [`connect`](Self::connect);
    /// a lost `dead_letters` is not reopened (its channel is): each dead letter fails
    /// until the connection is back (lapin's own recovery, if the application enabled
    /// it), and the delivery is rejected for another attempt.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use futures::StreamExt;
    /// use idem_broker::rabbitmq::{RabbitConfig, RabbitConsumer};
    /// use lapin::{Connection, ConnectionProperties};
    ///
    /// let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
    /// let open = || Connection::connect(url, ConnectionProperties::default());
    /// let config = RabbitConfig::new(url, "grants").with_prefetch(64);
    /// let mut deliveries =
    ///     RabbitConsumer::from_connection(open().await?, open().await?, &config).await?;
    /// while let Some(delivery) = deliveries.next().await {
    ///     let delivery = delivery?;
    ///     // hand it to an `idem_engine::Gate`, which acks only after the commit
    /// #   drop(delivery);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// An invalid name; [`BrokerError::InvalidParam`] for a quorum `delivery_limit` of
    /// 0; [`BrokerError::Config`] when a queue exists with other arguments; a closed
    /// connection or a refused declaration.
    pub async fn from_connection(
        connection: Connection,
        dead_letters: Connection,
        config: &RabbitConfig,
    ) -> Result<Self, BrokerError> {
        Self::start(connection, dead_letters, false, config).await
    }

    /// Declares the queues and starts consuming on `connection`; `reopen`: the
    /// dead-letter connection came from the URL and may be opened again from it.
    async fn start(
        connection: Connection,
        dead_letters: Connection,
        reopen: bool,
        config: &RabbitConfig,
    ) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        config.check()?;
        watch_blocking(&connection);
        watch_blocking(&dead_letters);
        let dead_letter_queue = dead_letter_name(&config.name);
        let dead_letter_link = DeadLetters::link(dead_letters, config, &dead_letter_queue).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| BrokerError::op(BROKER, "channel.open", e))?;
        declare(&channel, &config.name, config).await?;
        let prefetch = config.prefetch.max(1);
        let pace = if config.queue_type == QueueType::Quorum && prefetch > 1 {
            Pace::Solo
        } else {
            Pace::Full
        };
        let inner = consume(
            &channel,
            &config.name,
            &config.consumer_tag,
            if pace == Pace::Solo { 1 } else { prefetch },
        )
        .await?;
        let (hand_back, handed_back) = mpsc::unbounded_channel();
        Ok(Self {
            connection,
            inner,
            shared: Arc::new(Shared {
                channel,
                dead_letters: DeadLetters {
                    config: config.clone(),
                    queue: dead_letter_queue,
                    link: tokio::sync::Mutex::new(Some(dead_letter_link)),
                    reopen,
                },
                settle: tokio::sync::Mutex::new(()),
                outstanding: Mutex::new(BTreeSet::new()),
                dropped: Mutex::new(Vec::new()),
                held: AtomicUsize::new(0),
                hold_limit: usize::from(config.prefetch / 2).max(1),
                closing: tokio::sync::watch::channel(false).0,
                hand_back,
                reruns: Mutex::new(BTreeSet::new()),
                rerun_settled: tokio::sync::Notify::new(),
            }),
            handed_back,
            queue: config.name.clone(),
            queue_type: config.queue_type,
            pace,
            prefetch,
            consumer_tag: config.consumer_tag.clone(),
            switch: None,
            drained: false,
        })
    }

    /// Goes [`Pace::Full`]: cancels the current consumer and starts, once no rerun is
    /// held, a successor at the configured prefetch.
    fn go_full(&mut self) {
        self.pace = Pace::Full;
        let (shared, old) = (Arc::clone(&self.shared), self.inner.tag());
        let (queue, tag, prefetch) = (self.queue.clone(), self.consumer_tag.clone(), self.prefetch);
        tracing::debug!(target: "idem::broker", broker = BROKER, queue = %queue, prefetch, "changing the prefetch");
        self.switch = Some(tokio::spawn(async move {
            shared
                .channel
                .basic_cancel(old, BasicCancelOptions::default())
                .await
                .map_err(|e| BrokerError::op(BROKER, "basic.cancel", e))?;
            shared.reruns_settled().await;
            consume(&shared.channel, &queue, &tag, prefetch).await
        }));
    }

    /// Closes the connections: every delivery not settled (held ones included) goes back
    /// to the queue, and settling one of this consumer's deliveries from now on is an
    /// error.
    ///
    /// # Errors
    /// The close handshake failed (the connection is gone either way).
    pub async fn close(&self) -> Result<(), BrokerError> {
        self.shared.closing.send_replace(true);
        self.shared.dead_letters.close().await;
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

    /// How many deliveries are held right now: failed ones waiting for their retry
    /// delay, deferred ones waiting to come back through the stream.
    pub fn held(&self) -> usize {
        self.shared.held.load(Ordering::Relaxed)
    }
}

impl Stream for RabbitConsumer {
    type Item = Result<Delivery<RabbitAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Poll::Ready(Some(back)) = self.handed_back.poll_recv(cx) {
            return Poll::Ready(Some(Ok(back.into_delivery())));
        }
        let d = loop {
            if self.drained {
                // The consumer ended by its change of pace: its successor comes.
                let Some(switch) = self.switch.as_mut() else {
                    return Poll::Ready(None);
                };
                let next = match Pin::new(switch).poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(next) => next,
                };
                self.switch = None;
                match next {
                    Ok(Ok(consumer)) => {
                        self.inner = consumer;
                        self.drained = false;
                    }
                    Ok(Err(e)) => return Poll::Ready(Some(Err(e))),
                    Err(e) => {
                        return Poll::Ready(Some(Err(BrokerError::op(BROKER, "basic.consume", e))))
                    }
                }
            }
            match Pin::new(&mut self.inner).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => {
                    return Poll::Ready(Some(Err(BrokerError::Operation {
                        broker: BROKER,
                        action: "basic.consume",
                        retryable: true,
                        source: Box::new(e),
                    })))
                }
                Poll::Ready(Some(Ok(d))) => break d,
                // The broker's cancel or a closed channel: the end.
                Poll::Ready(None) if self.switch.is_none() => return Poll::Ready(None),
                // Cancelled for a change of pace.
                Poll::Ready(None) => self.drained = true,
            }
        };
        let tag = d.delivery_tag;
        lock(&self.shared.outstanding).insert(tag);
        let headers = headers_of(&d.properties);
        let attempt = attempt_of(&headers, self.queue_type);
        if self.queue_type == QueueType::Quorum && self.prefetch > 1 {
            let rerun = attempt.is_some_and(|a| a > 1);
            if rerun {
                lock(&self.shared.reruns).insert(tag);
            }
            if self.pace == Pace::Solo && !rerun {
                self.go_full();
            }
        }
        Poll::Ready(Some(Ok(Delivery {
            payload: d.data.clone(),
            headers: headers.clone(),
            attempt,
            acker: RabbitAcker {
                guard: TagGuard {
                    tag,
                    shared: Arc::clone(&self.shared),
                    armed: true,
                },
                kept: Kept {
                    payload: d.data,
                    headers,
                    attempt,
                    received: Instant::now(),
                },
            },
        })))
    }
}

/// Sets the prefetch of `channel`'s next consumer and starts it on `queue`.
async fn consume(
    channel: &Channel,
    queue: &str,
    tag: &str,
    prefetch: u16,
) -> Result<lapin::Consumer, BrokerError> {
    channel
        .basic_qos(prefetch, BasicQosOptions { global: false })
        .await
        .map_err(|e| BrokerError::op(BROKER, "basic.qos", e))?;
    channel
        .basic_consume(
            queue.into(),
            tag.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| BrokerError::op(BROKER, "basic.consume", e))
}
