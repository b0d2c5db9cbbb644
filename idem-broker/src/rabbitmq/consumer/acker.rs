//! [`RabbitAcker`]: settling one delivery, and handing a deferred one back.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};
use lapin::types::AMQPValue;

use super::plan::{plan, Frame, Plan, Settle};
use super::shared::{Shared, TagGuard};
use super::DELIVERY_COUNT_HEADER;
use crate::names::carried_to_dead_letter;
use crate::rabbitmq::config::QueueType;
use crate::rabbitmq::publisher::OutMessage;
use crate::rabbitmq::BROKER;
use crate::DEAD_LETTER_REASON_HEADER;

/// What an acker keeps of its delivery, to hand it back into the stream after a
/// deferral exactly as it came.
pub(super) struct Kept {
    pub(super) payload: Vec<u8>,
    pub(super) headers: Headers,
    pub(super) attempt: Option<u32>,
    /// When the broker delivered it (the deferrals since do not reset it).
    pub(super) received: Instant,
}

/// A deferred delivery on its way back into the consumer's stream, still unacked.
pub(super) struct HandBack {
    guard: TagGuard,
    kept: Kept,
}

impl HandBack {
    pub(super) fn into_delivery(self) -> Delivery<RabbitAcker> {
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
pub(super) fn attempt_of(headers: &Headers, queue_type: QueueType) -> Option<u32> {
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
pub(super) fn headers_of(props: &lapin::BasicProperties) -> Headers {
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
    pub(super) guard: TagGuard,
    pub(super) kept: Kept,
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
        let mut out: Vec<(String, String)> =
            carried_to_dead_letter(headers, |k| k == "message-id" || k == DELIVERY_COUNT_HEADER)
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
        let Some(shared) = crate::batch::one_connection(&items, |a| &a.guard.shared) else {
            return Self::ack_each(items).await;
        };
        let mut ackers: Vec<Self> = items.into_iter().map(|(a, _)| a).collect();
        let tags: BTreeSet<u64> = ackers.iter().map(|a| a.guard.tag).collect();
        let r = shared.ack_many(&tags).await;
        for a in &mut ackers {
            a.guard.disarm();
        }
        crate::batch::each_of(ackers.len(), r)
    }
}
