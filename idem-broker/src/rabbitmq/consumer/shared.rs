//! What the ackers of one consumer share: the channel, the dead letters' connection, and
//! the delivery tags outstanding.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use idem_core::AckError;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::{Channel, Connection};
use tokio::sync::mpsc;

use super::acker::HandBack;
use super::plan::{plan, Frame, Plan, Room, Settle};
use crate::rabbitmq::config::RabbitConfig;
use crate::rabbitmq::publisher::{confirmed_publish, OutMessage};
use crate::rabbitmq::{confirm_channel, connect, declare, BROKER};
use crate::BrokerError;

/// The dead-letter queue, published to on a connection of its own: a publishing
/// connection is what RabbitMQ blocks in a resource alarm (and lapin then writes nothing
/// on it), so the consumer's connection, which only consumes and settles, never is: acks
/// keep flowing while dead letters wait. A connection opened from the URL is reopened
/// when it was lost; one handed to [`RabbitConsumer::from_connection`] is not (only its
/// channel is).
pub(super) struct DeadLetters {
    pub(super) config: RabbitConfig,
    pub(super) queue: String,
    pub(super) link: tokio::sync::Mutex<Option<(Connection, Channel)>>,
    /// The connection came from `config.url` and may be opened again from it.
    pub(super) reopen: bool,
}

impl DeadLetters {
    /// Opens a confirm channel on `connection` and declares the dead-letter queue.
    pub(super) async fn link(
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
                        crate::show_duration(self.config.confirm_timeout)
                    )),
                )
            })?
    }

    /// Publishes `msg` to the dead-letter queue and waits (up to the confirm timeout)
    /// for the broker's confirm.
    pub(super) async fn publish(&self, msg: &OutMessage<'_>) -> Result<(), BrokerError> {
        let channel = self.channel().await?;
        confirmed_publish(
            &channel,
            &self.queue,
            std::slice::from_ref(msg),
            self.config.confirm_timeout,
        )
        .await
    }

    pub(super) async fn close(&self) {
        if let Some((connection, _)) = self.link.lock().await.take() {
            let _ = connection.close(200, "consumer closed".into()).await;
        }
    }
}

/// What every acker of one consumer shares: the channel, the dead letters' connection,
/// and the delivery tags handed out and not yet settled (for safe multiple-acks).
pub(super) struct Shared {
    pub(super) channel: Channel,
    pub(super) dead_letters: DeadLetters,
    /// Held from deciding a settlement until its frame is sent: one settlement at a time
    /// per channel, in the order decided.
    pub(super) settle: tokio::sync::Mutex<()>,
    /// Tags delivered and not yet settled (held ones included). Inserted by the stream,
    /// removed under `settle` only.
    pub(super) outstanding: Mutex<BTreeSet<u64>>,
    /// Tags of deliveries dropped unsettled, requeued by the next settlement.
    pub(super) dropped: Mutex<Vec<u64>>,
    /// Deliveries held (a delayed failure, a deferral).
    pub(super) held: AtomicUsize,
    /// At most this many are held; past it a settlement sends its frame at once.
    pub(super) hold_limit: usize,
    /// Set when the consumer is dropped or closed: held deliveries are settled at once.
    pub(super) closing: tokio::sync::watch::Sender<bool>,
    /// Deferred deliveries coming back into the consumer's stream.
    pub(super) hand_back: mpsc::UnboundedSender<HandBack>,
    /// Tags of reruns (deliveries the queue counts as delivered before) not yet settled:
    /// while one is held, a solo consumer does not go full (see [`Pace`]).
    pub(super) reruns: Mutex<BTreeSet<u64>>,
    /// Notified whenever a rerun is settled.
    pub(super) rerun_settled: tokio::sync::Notify,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
    pub(super) async fn reruns_settled(&self) {
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
    pub(super) fn room(&self, received: Instant) -> Room {
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
    pub(super) async fn settle_one(&self, tag: u64, frame: Frame) -> Result<(), AckError> {
        let _step = self.settle.lock().await;
        self.flush_dropped().await;
        self.forget([tag]);
        self.send(tag, frame, false).await.map_err(Into::into)
    }

    /// Acks `tags` (all of this channel): one multiple-ack up to the highest tag below
    /// which every outstanding delivery is in `tags`, one ack each for the rest.
    pub(super) async fn ack_many(&self, tags: &BTreeSet<u64>) -> Result<(), AckError> {
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
pub(super) struct TagGuard {
    pub(super) tag: u64,
    pub(super) shared: Arc<Shared>,
    pub(super) armed: bool,
}

impl TagGuard {
    pub(super) fn disarm(&mut self) -> u64 {
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
