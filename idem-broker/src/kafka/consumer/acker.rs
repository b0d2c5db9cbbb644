//! [`KafkaAcker`]: settling a delivery.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{AckError, AckProof, Acker, Headers, PositionMove, RejectReason};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use tokio::sync::oneshot;

use super::committer::{Retry, Settle, Shared};
use super::{DEAD_LETTER_RETRY_DELAY, DEAD_LETTER_TRIES, KEY_HEADER};
use crate::kafka::BROKER;
use crate::names::carried_to_dead_letter;
use crate::{BrokerError, DEAD_LETTER_REASON_HEADER};

/// A delivery's place for its claim transaction, with positions stored.
#[derive(Debug, Clone, Copy)]
pub(super) struct At {
    /// The ownership's epoch (at least 1: `Option<At>` takes no more room than `At`).
    pub(super) epoch: std::num::NonZeroI64,
    /// Every offset below it was settled when the delivery was handed out.
    pub(super) floor: i64,
}

/// Settles one message: marks its offset settled, and the committer commits the
/// partition's low-water mark.
pub struct KafkaAcker {
    pub(super) partition: i32,
    pub(super) offset: i64,
    pub(super) generation: u64,
    /// With positions stored: the ownership's epoch and the settled prefix when handed
    /// out.
    pub(super) at: Option<At>,
    pub(super) key: Option<Vec<u8>>,
    pub(super) payload: Vec<u8>,
    pub(super) headers: Headers,
    /// Not settled yet: dropped so, it tells the stream ([`Converter::dropped`]).
    pub(super) armed: AtomicBool,
    pub(super) shared: Arc<Shared>,
}

/// A delivery dropped without being settled, for the stream ([`Converter::dropped`]).
pub(super) struct Dropped {
    pub(super) partition: i32,
    pub(super) generation: u64,
    pub(super) offset: i64,
}

impl Drop for KafkaAcker {
    /// Dropped before it was settled (acked, handed back or dead-lettered): a fenced
    /// transaction or an abandoned handler. The stream hears of it.
    fn drop(&mut self) {
        if *self.armed.get_mut() {
            let _ = self.shared.dropped.send(Dropped {
                partition: self.partition,
                generation: self.generation,
                offset: self.offset,
            });
        }
    }
}

impl std::fmt::Debug for KafkaAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaAcker")
            .field("topic", &self.shared.topic)
            .field("partition", &self.partition)
            .field("offset", &self.offset)
            .finish_non_exhaustive()
    }
}

impl KafkaAcker {
    /// The message's partition.
    pub fn partition(&self) -> i32 {
        self.partition
    }

    /// The message's offset.
    pub fn offset(&self) -> i64 {
        self.offset
    }

    /// Hands the delivery back to the stream after `delay` (`deferred`: without
    /// counting another delivery).
    fn hand_back(mut self, delay: Option<Duration>, deferred: bool) -> Result<(), AckError> {
        self.disarm();
        let retry = Retry {
            partition: self.partition,
            generation: self.generation,
            offset: self.offset,
            deferred,
            key: self.key.take(),
            payload: std::mem::take(&mut self.payload),
            headers: std::mem::take(&mut self.headers),
        };
        let tx = self.shared.retry.clone();
        // Counted until the stream takes it again (`Reader::next`).
        self.shared.holding.fetch_add(1, Ordering::AcqRel);
        match delay {
            Some(d) if !d.is_zero() => {
                tokio::spawn(async move {
                    tokio::time::sleep(d).await;
                    let _ = tx.send(retry);
                });
                Ok(())
            }
            _ => tx.send(retry).map_err(|_| {
                self.shared.holding.fetch_sub(1, Ordering::AcqRel);
                AckError::new("kafka: the consumer is closed", false, None)
            }),
        }
    }

    /// Settled (or handed back): its drop says nothing.
    /// Whether this member still owns the delivery's partition under the ownership it
    /// was delivered in.
    fn owned(&self) -> bool {
        self.generation != 0
            && self
                .shared
                .own
                .owned()
                .parts
                .get(&self.partition)
                .is_some_and(|p| p.generation == self.generation)
    }

    fn disarm(&self) {
        self.armed.store(false, Ordering::Release);
    }

    /// Sends the settlement; the receiver answers once it is committed (or ignored).
    pub(super) fn send_settle(&self) -> Result<oneshot::Receiver<Result<(), AckError>>, AckError> {
        self.disarm();
        let (tx, rx) = oneshot::channel();
        self.shared
            .settle
            .send(Settle {
                partition: self.partition,
                generation: self.generation,
                offset: self.offset,
                done: tx,
            })
            .map_err(|_| AckError::new("kafka: the consumer is closed", false, None))?;
        Ok(rx)
    }

    async fn settle(self) -> Result<(), AckError> {
        wait(self.send_settle()?).await
    }
}

pub(super) async fn wait(rx: oneshot::Receiver<Result<(), AckError>>) -> Result<(), AckError> {
    rx.await
        .unwrap_or_else(|_| Err(AckError::new("kafka: the committer stopped", false, None)))
}

#[async_trait]
impl Acker for KafkaAcker {
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        self.settle().await
    }

    /// Hands the message back to this consumer's stream after `delay`; its offset stays
    /// uncommitted meanwhile (a crash redelivers it from the broker). It comes back as
    /// the next delivery (its attempt one higher).
    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.hand_back(delay, false)
    }

    /// Hands the message back after `delay` without counting another delivery: a
    /// deferral is not an attempt.
    async fn defer(self, delay: Duration) -> Result<(), AckError> {
        self.hand_back(Some(delay), true)
    }

    /// True: the attempt counts the runs of the offset (deliveries handed out, kept in
    /// `NAME.attempts` across members and restarts), and a deferral does not raise it.
    fn attempt_counts_runs(&self) -> bool {
        true
    }

    /// With positions stored ([`Positions::Store`](crate::kafka::Positions::Store)): the
    /// offset, the ownership's epoch, and the partition's settled prefix now (or when
    /// handed out, if the partition was revoked since).
    fn position(&self) -> Option<PositionMove> {
        let at = self.at?;
        let (_, source) = self.shared.positions.as_ref()?;
        let settled_below = {
            let o = self.shared.own.owned();
            o.parts
                .get(&self.partition)
                .filter(|p| p.generation == self.generation)
                .and_then(|p| p.lwm.mark())
                .map_or(at.floor, |m| m.max(at.floor).min(self.offset))
        };
        Some(PositionMove {
            source: Arc::clone(source),
            partition: self.partition,
            offset: self.offset,
            settled_below,
            epoch: at.epoch.get(),
        })
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        if !self.owned() {
            // Revoked since it was handed out: its new owner receives it again and
            // decides; a dead letter from here would be a second one, or one of a
            // message the new owner processes.
            self.disarm();
            return Err(AckError::new(
                format!(
                    "partition {} was revoked since offset {} was delivered: not \
                     dead-lettered here (its new owner receives it again)",
                    self.partition, self.offset
                ),
                false,
                None,
            ));
        }
        let reason = reason.to_string();
        let mut h = OwnedHeaders::new();
        for (k, v) in carried_to_dead_letter(headers, |k| k == KEY_HEADER) {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        h = h.insert(Header {
            key: DEAD_LETTER_REASON_HEADER,
            value: Some(reason.as_bytes()),
        });
        let mut last = None;
        for attempt in 0..DEAD_LETTER_TRIES {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(200) * 2u32.pow(attempt)).await;
            }
            let mut record: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(&self.shared.dead_letter)
                    .payload(payload)
                    .headers(h.clone());
            if let Some(k) = &self.key {
                record = record.key(k.as_slice());
            }
            match self
                .shared
                .producer
                .send(record, Duration::from_secs(30))
                .await
            {
                Ok(_) => return self.settle().await,
                Err((e, _)) => {
                    if let Some(fix) = dead_letter_refused(&e) {
                        // No retry helps, and a hand-back would loop for ever: the
                        // delivery stays unsettled (its offset uncommitted, so the next
                        // member receives it again) and the consumer stops.
                        self.disarm();
                        let size = payload.len() + reason.len();
                        let destination = format!(
                            "the dead-letter topic {:?} (partition {} offset {}, {size} bytes \
                             and more)",
                            self.shared.dead_letter, self.partition, self.offset
                        );
                        return Err(BrokerError::dead_letter_refused(
                            BROKER,
                            &destination,
                            &e.to_string(),
                            "unsettled",
                            fix,
                        )
                        .into());
                    }
                    last = Some(e);
                }
            }
        }
        // Not dead-lettered: hand the delivery back to this consumer's stream (its
        // offset stays uncommitted), so it is rejected and dead-lettered again rather
        // than holding the partition's commits back until a restart. Through
        // `hand_back`, which counts it as held until the stream takes it again.
        let e = BrokerError::op(
            BROKER,
            "produce dead-letter",
            last.map_or_else(|| "no attempt".to_owned(), |e| e.to_string()),
        );
        self.hand_back(Some(DEAD_LETTER_RETRY_DELAY), false)?;
        Err(e.into())
    }

    /// Marks every offset settled at once: one commit for the batch.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        let pending: Vec<_> = items.iter().map(|(a, _)| a.send_settle()).collect();
        drop(items);
        let mut out = Vec::with_capacity(pending.len());
        for p in pending {
            out.push(match p {
                Ok(rx) => wait(rx).await,
                Err(e) => Err(e),
            });
        }
        out
    }
}

/// What an operator must change when Kafka (or librdkafka, before sending) refuses a
/// dead letter for good: the record's size or form, or the producer's right to write the
/// topic. `None` for a failure a retry may get past (a broker cut off, a leader moving).
fn dead_letter_refused(e: &KafkaError) -> Option<&'static str> {
    if crate::kafka::publisher::refused_for_good(e) {
        return Some(
            "raise the dead-letter topic's max.message.bytes to the source topic's (and \
             librdkafka's message.max.bytes, if set as a client setting)",
        );
    }
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed
                | RDKafkaErrorCode::PolicyViolation
        )
    )
    .then_some("let the consumer's principal write the dead-letter topic (its ACLs or policy)")
}
