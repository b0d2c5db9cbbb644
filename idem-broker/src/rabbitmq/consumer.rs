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
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::Stream;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    BasicRejectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};
use tokio::sync::mpsc;

use super::config::{QueueType, RabbitConfig};
use super::publisher::{confirmed_publish, OutMessage};
use super::{check_name, confirm_channel, connect, declare, open, watch_blocking, BROKER};
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

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

/// A frame that settles one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    /// `basic.ack`: done, removed from the queue.
    Ack,
    /// `basic.reject` with `requeue = true`: a failed attempt. Every quorum queue counts
    /// it in `x-delivery-count` (3.x, and 4.x, where it is a `modify` with
    /// `delivery-failed`), so it counts towards the delivery limit.
    Reject,
    /// `basic.nack` with `requeue = true`: handed back, nobody's failure. RabbitMQ 4.3+
    /// counts no delivery for it; 3.x and 4.0–4.2 count every requeue.
    Nack,
}

/// How a delivery is settled, as the core (or a drop) asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settle {
    /// [`Acker::ack`].
    Ack,
    /// [`Acker::nack`]: a failed attempt, to run again after the delay if any.
    Fail(Option<Duration>),
    /// [`Acker::defer`]: its key is held by another transaction; not the message's fault.
    Defer(Duration),
    /// [`Acker::dead_letter`], once the publish to `NAME.dead-letter` is confirmed or
    /// has failed.
    DeadLettered {
        /// The broker confirmed the dead letter.
        confirmed: bool,
    },
    /// The acker was dropped unsettled (its task cancelled).
    Dropped,
}

/// What the consumer can do for a delivery besides sending a frame at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Room {
    /// Fewer deliveries than the hold limit are held.
    can_hold: bool,
    /// The consumer is open: a held delivery can come back through its stream.
    open: bool,
    /// How long the delivery has been unacked here.
    unacked_for: Duration,
}

/// The frames and holds a settlement is carried out with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// The frame, at once.
    Send(Frame),
    /// Held unacked (its prefetch slot kept, no one else gets it) for the delay, then the
    /// frame; at once when the consumer closes.
    HoldThen(Duration, Frame),
    /// Held unacked for the delay, then handed back through the consumer's stream with
    /// the same attempt and headers: no frame, so the broker counts nothing. When the
    /// consumer closes first, [`Frame::Nack`].
    HoldThenHandBack(Duration),
}

/// The settlement plan: the one place that chooses frames.
///
/// - `Ack` → `basic.ack`.
/// - `Fail` → `basic.reject` (requeue) — after holding for the delay when there is one
///   and room to hold it.
/// - `Defer` → held and handed back through the stream, even past the hold limit (the
///   prefetch bounds what is held: deferrals that fill it stop the broker's sending);
///   `basic.nack` (requeue) only when the consumer is closing, or the delivery would stay
///   unacked past [`MAX_UNACKED`].
/// - `DeadLettered` → `basic.ack` once the dead letter is confirmed; otherwise held
///   [`DEAD_LETTER_RETRY`] and then `basic.reject` (a failed attempt: a dead-letter queue
///   that stays broken ends in the broker's own dead-lettering at the delivery limit).
/// - `Dropped` → `basic.nack` (requeue).
fn plan(settle: Settle, room: Room) -> Plan {
    match settle {
        Settle::Ack | Settle::DeadLettered { confirmed: true } => Plan::Send(Frame::Ack),
        Settle::Fail(Some(delay)) if !delay.is_zero() && room.can_hold && room.open => {
            Plan::HoldThen(delay.min(MAX_HOLD), Frame::Reject)
        }
        Settle::Fail(_) => Plan::Send(Frame::Reject),
        // Whatever is held already: a deferral keeps its prefetch slot, so once deferrals
        // fill the prefetch the broker sends nothing more (fetching stops, memory stays
        // bounded by the prefetch) and no requeue is counted against a message.
        Settle::Defer(delay)
            if room.open && room.unacked_for.saturating_add(delay.min(MAX_HOLD)) <= MAX_UNACKED =>
        {
            Plan::HoldThenHandBack(delay.min(MAX_HOLD))
        }
        Settle::Defer(_) | Settle::Dropped => Plan::Send(Frame::Nack),
        Settle::DeadLettered { confirmed: false } if room.open => {
            Plan::HoldThen(DEAD_LETTER_RETRY, Frame::Reject)
        }
        Settle::DeadLettered { confirmed: false } => Plan::Send(Frame::Reject),
    }
}

/// The dead-letter queue, published to on a connection of its own: a publishing
/// connection is what RabbitMQ blocks in a resource alarm (and lapin then writes nothing
/// on it), so the consumer's connection, which only consumes and settles, never is: acks
/// keep flowing while dead letters wait. A connection opened from the URL is reopened
/// when it was lost; one handed to [`RabbitConsumer::from_connection`] is not (only its
/// channel is).
struct DeadLetters {
    config: RabbitConfig,
    queue: String,
    link: tokio::sync::Mutex<Option<(Connection, Channel)>>,
    /// The connection came from `config.url` and may be opened again from it.
    reopen: bool,
}

impl DeadLetters {
    /// Opens a confirm channel on `connection` and declares the dead-letter queue.
    async fn link(
        connection: Connection,
        config: &RabbitConfig,
        queue: &str,
    ) -> Result<(Connection, Channel), BrokerError> {
        let channel = confirm_channel(&connection).await?;
        declare(&channel, queue, config).await?;
        Ok((connection, channel))
    }

    /// A confirm channel, reopened if it or its connection was lost (within the confirm
    /// timeout).
    async fn channel(&self) -> Result<Channel, BrokerError> {
        let mut link = self.link.lock().await;
        if let Some((connection, channel)) = &mut *link {
            if connection.status().connected() {
                if channel.status().connected() {
                    return Ok(channel.clone());
                }
                *channel = self.within_timeout(confirm_channel(connection)).await?;
                return Ok(channel.clone());
            }
        }
        if !self.reopen {
            return Err(BrokerError::op(
                BROKER,
                "dead-letter connection",
                std::io::Error::other(
                    "the connection given for dead letters is closed (idem does not reopen a \
                     connection it was given)",
                ),
            ));
        }
        *link = None;
        let opened = self
            .within_timeout(async {
                let connection = connect(&self.config.url).await?;
                Self::link(connection, &self.config, &self.queue).await
            })
            .await?;
        let channel = opened.1.clone();
        *link = Some(opened);
        Ok(channel)
    }

    /// `step`, failed when it takes longer than the confirm timeout.
    async fn within_timeout<T>(
        &self,
        step: impl std::future::Future<Output = Result<T, BrokerError>>,
    ) -> Result<T, BrokerError> {
        tokio::time::timeout(self.config.confirm_timeout, step)
            .await
            .map_err(|_| {
                BrokerError::op(
                    BROKER,
                    "dead-letter connection",
                    std::io::Error::other(format!(
                        "not open within the confirm timeout ({})",
                        humantime::format_duration(self.config.confirm_timeout)
                    )),
                )
            })?
    }

    /// Publishes `msg` to the dead-letter queue and waits (up to the confirm timeout)
    /// for the broker's confirm.
    async fn publish(&self, msg: &OutMessage<'_>) -> Result<(), BrokerError> {
        let channel = self.channel().await?;
        confirmed_publish(
            &channel,
            &self.queue,
            std::slice::from_ref(msg),
            self.config.confirm_timeout,
        )
        .await
    }

    async fn close(&self) {
        if let Some((connection, _)) = self.link.lock().await.take() {
            let _ = connection.close(200, "consumer closed".into()).await;
        }
    }
}

/// What every acker of one consumer shares: the channel, the dead letters' connection,
/// and the delivery tags handed out and not yet settled (for safe multiple-acks).
struct Shared {
    channel: Channel,
    dead_letters: DeadLetters,
    /// Held from deciding a settlement until its frame is sent: one settlement at a time
    /// per channel, in the order decided.
    settle: tokio::sync::Mutex<()>,
    /// Tags delivered and not yet settled (held ones included). Inserted by the stream,
    /// removed under `settle` only.
    outstanding: Mutex<BTreeSet<u64>>,
    /// Tags of deliveries dropped unsettled, requeued by the next settlement.
    dropped: Mutex<Vec<u64>>,
    /// Deliveries held (a delayed failure, a deferral).
    held: AtomicUsize,
    /// At most this many are held; past it a settlement sends its frame at once.
    hold_limit: usize,
    /// Set when the consumer is dropped or closed: held deliveries are settled at once.
    closing: tokio::sync::watch::Sender<bool>,
    /// Deferred deliveries coming back into the consumer's stream.
    hand_back: mpsc::UnboundedSender<HandBack>,
    /// Tags of reruns (deliveries the queue counts as delivered before) not yet settled:
    /// while one is held, a solo consumer does not go full (see [`Pace`]).
    reruns: Mutex<BTreeSet<u64>>,
    /// Notified whenever a rerun is settled.
    rerun_settled: tokio::sync::Notify,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Takes `tags` off the outstanding set (and the reruns); whether the first was on it.
    fn forget(&self, tags: impl IntoIterator<Item = u64>) -> bool {
        let (mut out, mut reruns) = (lock(&self.outstanding), lock(&self.reruns));
        let (mut first, mut any_rerun) = (None, false);
        for t in tags {
            let was = out.remove(&t);
            first.get_or_insert(was);
            any_rerun |= reruns.remove(&t);
        }
        drop((out, reruns));
        if any_rerun {
            self.rerun_settled.notify_waiters();
        }
        first.unwrap_or(false)
    }

    /// Waits until no rerun is held.
    async fn reruns_settled(&self) {
        loop {
            let settled = self.rerun_settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if lock(&self.reruns).is_empty() {
                return;
            }
            settled.await;
        }
    }

    /// Sends `frame` for `tag` (`multiple` for an ack or a nack only).
    async fn send(&self, tag: u64, frame: Frame, multiple: bool) -> Result<(), BrokerError> {
        match frame {
            Frame::Ack => self
                .channel
                .basic_ack(tag, BasicAckOptions { multiple })
                .await
                .map_err(|e| BrokerError::op(BROKER, "basic.ack", e)),
            Frame::Reject => self
                .channel
                .basic_reject(tag, BasicRejectOptions { requeue: true })
                .await
                .map_err(|e| BrokerError::op(BROKER, "basic.reject", e)),
            Frame::Nack => self
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

    /// What this consumer has room for, for a delivery received at `received`.
    fn room(&self, received: Instant) -> Room {
        Room {
            can_hold: self.held.load(Ordering::Relaxed) < self.hold_limit,
            open: !*self.closing.borrow() && !self.hand_back.is_closed(),
            unacked_for: received.elapsed(),
        }
    }

    /// Requeues the deliveries dropped unsettled. Call with `settle` held.
    async fn flush_dropped(&self) {
        loop {
            // One at a time: cancelled midway, the rest stay listed.
            let Some(tag) = lock(&self.dropped).pop() else {
                return;
            };
            if self.forget([tag]) {
                tracing::debug!(target: "idem::broker", broker = BROKER, tag, "requeueing a delivery dropped unsettled");
                // A requeue that is nobody's failure (see `plan`).
                let frame = match plan(Settle::Dropped, self.room(Instant::now())) {
                    Plan::Send(frame) => frame,
                    Plan::HoldThen(..) | Plan::HoldThenHandBack(_) => Frame::Nack,
                };
                if let Err(e) = self.send(tag, frame, false).await {
                    tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "requeue of a dropped delivery failed; the broker requeues it when the channel closes");
                }
            }
        }
    }

    /// Settles one delivery: one step under the settle lock.
    async fn settle_one(&self, tag: u64, frame: Frame) -> Result<(), AckError> {
        let _step = self.settle.lock().await;
        self.flush_dropped().await;
        self.forget([tag]);
        self.send(tag, frame, false).await.map_err(Into::into)
    }

    /// Acks `tags` (all of this channel): one multiple-ack up to the highest tag below
    /// which every outstanding delivery is in `tags`, one ack each for the rest.
    async fn ack_many(&self, tags: &BTreeSet<u64>) -> Result<(), AckError> {
        let _step = self.settle.lock().await;
        self.flush_dropped().await;
        let cut = {
            let out = lock(&self.outstanding);
            let mut cut = None;
            let mut covered = 0usize;
            for t in out.iter() {
                if !tags.contains(t) {
                    break;
                }
                cut = Some(*t);
                covered += 1;
            }
            cut.filter(|_| covered > 1)
        };
        self.forget(tags.iter().copied());
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
    ///     // hand it to an `idem_core::Gate`, which acks only after the commit
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

/// What an acker keeps of its delivery, to hand it back into the stream after a
/// deferral exactly as it came.
struct Kept {
    payload: Vec<u8>,
    headers: Headers,
    attempt: Option<u32>,
    /// When the broker delivered it (the deferrals since do not reset it).
    received: Instant,
}

/// A deferred delivery on its way back into the consumer's stream, still unacked.
struct HandBack {
    guard: TagGuard,
    kept: Kept,
}

impl HandBack {
    fn into_delivery(self) -> Delivery<RabbitAcker> {
        Delivery {
            payload: self.kept.payload.clone(),
            headers: self.kept.headers.clone(),
            attempt: self.kept.attempt,
            acker: RabbitAcker {
                guard: self.guard,
                kept: self.kept,
            },
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

/// Settles one RabbitMQ delivery on the channel it came from (the frames each settlement
/// sends are in the module docs).
/// Dropped unsettled, the delivery is requeued. It keeps a copy of the delivery's body
/// and headers, to hand a deferred delivery back into the stream.
pub struct RabbitAcker {
    guard: TagGuard,
    kept: Kept,
}

impl std::fmt::Debug for RabbitAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitAcker")
            .field("delivery_tag", &self.guard.tag)
            .field("attempt", &self.kept.attempt)
            .finish_non_exhaustive()
    }
}

/// What is done once a hold ends.
enum AfterHold {
    /// Send this frame.
    Send(Frame),
    /// Hand the delivery back into the consumer's stream.
    HandBack(Kept),
}

/// Holds delivery `tag` unacked (so no one else gets it) for `delay`, then does `then`;
/// if the consumer closes first, sends the frame (or, for a hand-back, `basic.nack`) at
/// once. If the process dies meanwhile, the channel closes and the broker requeues it.
fn hold(shared: Arc<Shared>, tag: u64, delay: Duration, then: AfterHold) {
    shared.held.fetch_add(1, Ordering::Relaxed);
    let mut closing = shared.closing.subscribe();
    // Requeued by the next settlement if this task never runs to its end.
    let mut guard = TagGuard {
        tag,
        shared: Arc::clone(&shared),
        armed: true,
    };
    tokio::spawn(async move {
        let closed = tokio::select! {
            () = tokio::time::sleep(delay) => false,
            _ = closing.wait_for(|c| *c) => true,
        };
        let frame = match then {
            AfterHold::Send(frame) => frame,
            AfterHold::HandBack(kept) if !closed => {
                shared.held.fetch_sub(1, Ordering::Relaxed);
                // A consumer gone meanwhile drops it: its guard requeues it.
                let _ = shared.hand_back.send(HandBack { guard, kept });
                return;
            }
            AfterHold::HandBack(_) => Frame::Nack,
        };
        let tag = guard.disarm();
        if let Err(e) = shared.settle_one(tag, frame).await {
            tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "settling a held delivery failed; the broker requeues it when the channel closes");
        }
        shared.held.fetch_sub(1, Ordering::Relaxed);
    });
}

impl RabbitAcker {
    /// The delivery tag (per channel).
    pub fn delivery_tag(&self) -> u64 {
        self.guard.tag
    }

    fn shared(&self) -> Arc<Shared> {
        Arc::clone(&self.guard.shared)
    }

    /// Carries out `settle` as [`plan`] decides.
    async fn settle(mut self, settle: Settle) -> Result<(), AckError> {
        let shared = self.shared();
        match plan(settle, shared.room(self.kept.received)) {
            Plan::Send(frame) => {
                // Disarmed once settled: cancelled before, the guard requeues the
                // delivery if the settlement had not taken it off the outstanding set yet.
                let r = shared.settle_one(self.guard.tag, frame).await;
                self.guard.disarm();
                r
            }
            Plan::HoldThen(delay, frame) => {
                hold(shared, self.guard.disarm(), delay, AfterHold::Send(frame));
                Ok(())
            }
            Plan::HoldThenHandBack(delay) => {
                let kept = std::mem::replace(
                    &mut self.kept,
                    Kept {
                        payload: Vec::new(),
                        headers: Headers::new(),
                        attempt: None,
                        received: Instant::now(),
                    },
                );
                hold(
                    shared,
                    self.guard.disarm(),
                    delay,
                    AfterHold::HandBack(kept),
                );
                Ok(())
            }
        }
    }
}

#[async_trait]
impl Acker for RabbitAcker {
    /// `basic.ack`.
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        self.settle(Settle::Ack).await
    }

    /// A failed attempt: `basic.reject` with requeue, which every quorum queue counts in
    /// `x-delivery-count` (so towards its delivery limit). RabbitMQ has no delayed
    /// requeue: with a delay, the delivery is held unacked for it (at most a minute) and
    /// then rejected; it keeps its prefetch slot meanwhile, so when half the prefetch is
    /// already held, it is rejected at once instead.
    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.settle(Settle::Fail(delay)).await
    }

    /// Not the message's fault, so it costs no delivery: held unacked here for the delay
    /// (at most a minute) and handed back through the consumer's stream with the same
    /// attempt and headers; the broker sees no frame. Held however many are held already:
    /// each keeps its prefetch slot, so deferrals that fill the prefetch stop the broker's
    /// sending until they come back (memory stays bounded by the prefetch). Requeued with
    /// `basic.nack` instead only when the consumer is closing, or when the delivery would
    /// stay unacked here past 15 minutes (half RabbitMQ's default `consumer_timeout`).
    async fn defer(self, delay: Duration) -> Result<(), AckError> {
        self.settle(Settle::Defer(delay)).await
    }

    /// True: a quorum queue's `x-delivery-count` rises on a failure (`basic.reject`) and
    /// on a delivery lost with its channel (a crash); a deferral is held here. (A
    /// deferral past the hold limit is requeued, which RabbitMQ 3.x and 4.0–4.2 count.)
    fn attempt_counts_runs(&self) -> bool {
        true
    }

    /// A confirmed, persistent publish to `NAME.dead-letter` (on the dead letters' own
    /// connection, waiting at most the confirm timeout), then `basic.ack`. Not confirmed,
    /// the delivery is held 5 s and then rejected (requeued, counted): never acked
    /// without a confirm.
    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
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
        let published = self.guard.shared.dead_letters.publish(&msg).await;
        match published {
            Ok(()) => self.settle(Settle::DeadLettered { confirmed: true }).await,
            Err(e) => {
                tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "dead letter not confirmed; the delivery is requeued after a pause");
                // Not dead-lettered: give the delivery back rather than lose it, after a
                // pause (an immediate requeue would loop as fast as the broker delivers).
                let _ = self.settle(Settle::DeadLettered { confirmed: false }).await;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn room() -> Room {
        Room {
            can_hold: true,
            open: true,
            unacked_for: Duration::ZERO,
        }
    }

    /// The frames each settlement is carried out with: a failure is a counted
    /// `basic.reject`, a deferral is held and handed back without any frame, and
    /// `basic.nack` (not counted by RabbitMQ 4.3+) is kept for requeues that are nobody's
    /// failure.
    #[test]
    fn each_settlement_has_its_frames() {
        let s = Duration::from_secs;
        let full = Room {
            can_hold: false,
            ..room()
        };
        let closing = Room {
            open: false,
            ..room()
        };
        for (settle, room, want) in [
            (Settle::Ack, room(), Plan::Send(Frame::Ack)),
            (Settle::Fail(None), room(), Plan::Send(Frame::Reject)),
            (
                Settle::Fail(Some(Duration::ZERO)),
                room(),
                Plan::Send(Frame::Reject),
            ),
            (
                Settle::Fail(Some(s(3))),
                room(),
                Plan::HoldThen(s(3), Frame::Reject),
            ),
            (
                Settle::Fail(Some(s(600))),
                room(),
                Plan::HoldThen(MAX_HOLD, Frame::Reject),
            ),
            (Settle::Fail(Some(s(3))), full, Plan::Send(Frame::Reject)),
            (Settle::Fail(Some(s(3))), closing, Plan::Send(Frame::Reject)),
            (Settle::Defer(s(1)), room(), Plan::HoldThenHandBack(s(1))),
            (
                Settle::Defer(Duration::ZERO),
                room(),
                Plan::HoldThenHandBack(Duration::ZERO),
            ),
            (
                Settle::Defer(s(600)),
                room(),
                Plan::HoldThenHandBack(MAX_HOLD),
            ),
            // Deferrals that fill the prefetch stop the broker's sending; no requeue.
            (Settle::Defer(s(1)), full, Plan::HoldThenHandBack(s(1))),
            (Settle::Defer(s(1)), closing, Plan::Send(Frame::Nack)),
            (
                Settle::Defer(s(1)),
                Room {
                    unacked_for: MAX_UNACKED,
                    ..room()
                },
                Plan::Send(Frame::Nack),
            ),
            (
                Settle::Defer(s(1)),
                Room {
                    unacked_for: MAX_UNACKED - s(1),
                    ..room()
                },
                Plan::HoldThenHandBack(s(1)),
            ),
            (
                Settle::DeadLettered { confirmed: true },
                room(),
                Plan::Send(Frame::Ack),
            ),
            (
                Settle::DeadLettered { confirmed: false },
                room(),
                Plan::HoldThen(DEAD_LETTER_RETRY, Frame::Reject),
            ),
            // A dead letter that failed is held even at the hold limit: no hot loop.
            (
                Settle::DeadLettered { confirmed: false },
                full,
                Plan::HoldThen(DEAD_LETTER_RETRY, Frame::Reject),
            ),
            (
                Settle::DeadLettered { confirmed: false },
                closing,
                Plan::Send(Frame::Reject),
            ),
            (Settle::Dropped, room(), Plan::Send(Frame::Nack)),
        ] {
            assert_eq!(plan(settle, room), want, "{settle:?} with {room:?}");
        }
    }
}
