//! Polled messages to deliveries.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Delivery, Headers};
use rdkafka::consumer::Consumer;
use rdkafka::message::{BorrowedMessage, Header, Headers as _};
use rdkafka::Message;
use rdkafka::Offset;

use super::acker::{At, Dropped, KafkaAcker};
use super::committer::{Retry, Shared};
use super::ownership::{Owned, Ownership, Taken};
use super::poll::check_log;
use super::{Inner, AHEAD_WINDOW, COMMIT_RETRY_FIRST, COMMIT_RETRY_MAX, KEY_HEADER};
use crate::kafka::attempts;
use crate::kafka::{blocking, BROKER};
use crate::BrokerError;

/// Turns polled messages into deliveries.
pub(super) struct Converter {
    pub(super) own: Arc<Ownership>,
    pub(super) shared: Arc<Shared>,
    /// For the seek to a stored position (`None` where nothing seeks).
    pub(super) consumer: Option<Arc<Inner>>,
    /// Deliveries skipped because the position store holds them done.
    pub(super) skipped: Arc<AtomicU64>,
}

impl Converter {
    pub(super) fn delivery(&self, m: &BorrowedMessage<'_>) -> Delivery<KafkaAcker> {
        let (partition, offset) = (m.partition(), m.offset());
        let (generation, attempt) = {
            let mut o = self.own.owned();
            let part = o.part(partition);
            let stale = match part.rewind {
                // Fetched before the seek back: dropped, not counted as a delivery.
                Some(from) if offset > from => true,
                Some(_) => {
                    part.rewind = None;
                    false
                }
                None => false,
            };
            if stale {
                (0, 1)
            } else {
                let attempt = o.attempt(partition, offset);
                let part = o.part(partition);
                let generation = if part.lwm.register(offset) {
                    part.first.get_or_insert(offset);
                    part.generation
                } else {
                    // Not above what this ownership saw: settling it must not move the mark.
                    0
                };
                (generation, attempt)
            }
        };
        let mut headers: Headers = Vec::new();
        if let Some(h) = m.headers() {
            for Header { key, value } in h.iter() {
                headers.push((
                    key.to_owned(),
                    String::from_utf8_lossy(value.unwrap_or_default()).into_owned(),
                ));
            }
        }
        let key = m.key().map(<[u8]>::to_vec);
        if let Some(k) = &key {
            headers.push((
                KEY_HEADER.to_owned(),
                String::from_utf8_lossy(k).into_owned(),
            ));
        }
        let payload = m.payload().unwrap_or_default().to_vec();
        Delivery {
            payload: payload.clone(),
            headers: headers.clone(),
            attempt: Some(attempt),
            acker: KafkaAcker {
                partition,
                offset,
                generation,
                at: None,
                key,
                payload,
                headers,
                // A delivery outside every ownership (generation 0) settles nothing.
                armed: AtomicBool::new(generation != 0),
                shared: Arc::clone(&self.shared),
            },
        }
    }

    /// With positions stored: takes the partition from the store before its first
    /// delivery of this ownership (raising its epoch: the previous owner is fenced from
    /// then on), seeks past what the store holds done, and skips — settles without
    /// handing out — a delivery the store holds done. Sets the delivery's epoch and
    /// settled prefix for its claim transaction ([`Acker::position`]). `None`: skipped.
    /// A take that fails is tried again (growing to 5 s): no delivery of the partition
    /// can be handed out unfenced. A stored position that the log contradicts ends the
    /// stream ([`check_log`]).
    pub(super) async fn positioned(
        &self,
        mut d: Delivery<KafkaAcker>,
    ) -> Result<Option<Delivery<KafkaAcker>>, BrokerError> {
        let Some((store, source)) = self.shared.positions.clone() else {
            return Ok(Some(d));
        };
        let (partition, offset, generation) =
            (d.acker.partition, d.acker.offset, d.acker.generation);
        let mut wait = COMMIT_RETRY_FIRST;
        loop {
            let owned = {
                let o = self.own.owned();
                o.parts
                    .get(&partition)
                    .filter(|p| generation != 0 && p.generation == generation)
                    .map(|p| p.taken.is_some())
            };
            match owned {
                // Revoked since (or an offset this ownership already handed out): not
                // handed out. Run here, its commit would record no position and the new
                // owner would read it again; the new owner has it (the ownership's own
                // delivery of that offset settles it).
                None => return Ok(None),
                Some(true) => break,
                Some(false) => {}
            }
            match store.take_position(&source, partition).await {
                Ok(t) => {
                    // Where the store says the partition starts: its position, or the
                    // log's start where retention deleted records settled before.
                    let mut start = t.next;
                    if let (Some(next), Some(consumer)) = (t.next, self.consumer.clone()) {
                        let (topic, accept) =
                            (self.shared.topic.clone(), self.shared.accept_position_gap);
                        let checked =
                            blocking(move || check_log(&consumer, &topic, partition, next, accept))
                                .await?;
                        match checked {
                            Ok(low) => start = Some(next.max(low)),
                            Err(e @ BrokerError::Config { .. }) => return Err(e),
                            Err(e) => {
                                tracing::warn!(target: "idem::broker", broker = BROKER, partition, error = %e, "checking the stored position against the log failed; trying again");
                                tokio::time::sleep(wait).await;
                                wait = (wait * 2).min(COMMIT_RETRY_MAX);
                                continue;
                            }
                        }
                    }
                    tracing::debug!(target: "idem::broker", broker = BROKER, partition, epoch = t.epoch, next = ?t.next, done = t.done.len(), "partition taken from the position store");
                    let seek = start.filter(|&n| n > offset);
                    let back = start.filter(|&n| n < offset && self.consumer.is_some());
                    {
                        let mut o = self.own.owned();
                        if let Some(p) = o
                            .parts
                            .get_mut(&partition)
                            .filter(|p| p.generation == generation)
                        {
                            p.taken = Some(Taken {
                                epoch: t.epoch,
                                next: t.next,
                                done: t.done.into_iter().collect(),
                            });
                        }
                    }
                    if let Some(to) = back {
                        // The group's offset is ahead of the store (an offset reset, or
                        // another client committing in the group): the store is the
                        // authority, so the member reads again from its position.
                        tracing::warn!(target: "idem::broker", broker = BROKER, partition, group_offset = offset, stored = to, "the group's offset is ahead of the stored position (an offset reset, or another client committing in the group): reading again from the stored position");
                        self.seek_back(partition, generation, Some(to), false)
                            .await?;
                        return Ok(None);
                    }
                    if let (Some(next), Some(consumer)) = (seek, self.consumer.clone()) {
                        // Read on from the stored position; what was fetched below it
                        // already is skipped below.
                        if let Err(e) = self.seek(consumer, partition, next).await {
                            tracing::debug!(target: "idem::broker", broker = BROKER, partition, next, error = %e, "seek to the stored position failed; skipping up to it instead");
                        }
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(target: "idem::broker", broker = BROKER, partition, error = %e, "taking the partition from the position store failed; trying again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(COMMIT_RETRY_MAX);
                }
            }
        }
        let (skip, epoch, floor) = {
            let o = self.own.owned();
            let Some((p, t)) = o
                .parts
                .get(&partition)
                .filter(|p| p.generation == generation)
                .and_then(|p| p.taken.as_ref().map(|t| (p, t)))
            else {
                // Revoked while it was being taken: the new owner has it.
                return Ok(None);
            };
            let skip = t.next.is_some_and(|n| offset < n) || t.done.contains(&offset);
            (skip, t.epoch, p.lwm.mark().unwrap_or(offset).min(offset))
        };
        if skip {
            self.skipped.fetch_add(1, Ordering::Relaxed);
            // Done in the store: settled without being handed out, so the partition's
            // mark (and the group's committed offset) moves past it.
            let _ = d.acker.send_settle();
            return Ok(None);
        }
        d.acker.at = std::num::NonZeroI64::new(epoch).map(|epoch| At { epoch, floor });
        Ok(Some(d))
    }

    /// Seeks `partition` to `offset`, off the async workers.
    async fn seek(
        &self,
        consumer: Arc<Inner>,
        partition: i32,
        offset: i64,
    ) -> Result<(), BrokerError> {
        let topic = self.shared.topic.clone();
        blocking(move || {
            consumer
                .seek(
                    &topic,
                    partition,
                    Offset::Offset(offset),
                    Duration::from_secs(10),
                )
                .map_err(|e| BrokerError::op(BROKER, "seek", e))
        })
        .await
        .and_then(|r| r)
    }

    /// Seeks `partition` back to `to` under a new generation ([`Owned::rewind`]; `retake`:
    /// taken from the position store again first): what was fetched and handed out under
    /// the old one is dropped unsettled, and the partition is read again from `to` (what
    /// the store holds done there is skipped as usual). `to` is `None`: back to the old
    /// tracker's mark. A seek that keeps failing ends the stream: nothing of the partition
    /// could be handed out without skipping what is not done.
    async fn seek_back(
        &self,
        partition: i32,
        generation: u64,
        to: Option<i64>,
        retake: bool,
    ) -> Result<(), BrokerError> {
        let Some(consumer) = self.consumer.clone() else {
            return Ok(());
        };
        let Some((_, mark)) = self.own.owned().rewind(partition, generation, retake) else {
            // Revoked meanwhile: the new owner takes it from the store.
            return Ok(());
        };
        let Some(to) = to.or(mark) else {
            return Ok(());
        };
        let mut wait = COMMIT_RETRY_FIRST;
        for _ in 0..5 {
            match self.seek(Arc::clone(&consumer), partition, to).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::warn!(target: "idem::broker", broker = BROKER, partition, to, error = %e, "seek back failed; trying again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(COMMIT_RETRY_MAX);
                }
            }
        }
        Err(BrokerError::op(
            BROKER,
            "seek",
            format!("partition {partition}: the seek back to offset {to} failed"),
        ))
    }

    /// A delivery was dropped unsettled (its transaction fenced, its handler abandoned):
    /// while this ownership holds its partition, the partition's tracker could never pass
    /// it, so the ownership starts over from the tracker's mark, and with positions
    /// stored takes the partition from the store again (a member that lost it took it
    /// late, after this one: the new take fences that member, which no longer reads it).
    pub(super) async fn dropped(&self, d: Dropped) -> Result<(), BrokerError> {
        let owned = self
            .own
            .owned()
            .parts
            .get(&d.partition)
            .is_some_and(|p| p.generation == d.generation && d.generation != 0);
        if !owned {
            return Ok(());
        }
        tracing::warn!(target: "idem::broker", broker = BROKER, partition = d.partition, offset = d.offset, "a delivery was dropped unsettled (fenced, or abandoned): reading the partition again from its mark");
        self.seek_back(d.partition, d.generation, None, true).await
    }

    /// Sets the attempt of a delivery about to be handed out from the counts kept in
    /// `NAME.attempts` (read once per ownership of the partition), and writes the
    /// partition's counts there first when a successor needs them: for the first
    /// delivery of the ownership (a restarted or new member starts at that offset too,
    /// and it may be one whose earlier run killed its process) and for every redelivery.
    /// A failed read or write is logged and the delivery handed out with this member's
    /// count: the count is advice, never a reason to stop consuming.
    pub(super) async fn counted(&self, mut d: Delivery<KafkaAcker>) -> Delivery<KafkaAcker> {
        let (partition, offset, generation) =
            (d.acker.partition, d.acker.offset, d.acker.generation);
        let owned_now = |o: &Owned| {
            o.parts
                .get(&partition)
                .filter(|p| generation != 0 && p.generation == generation)
                .map(|p| p.durable.is_none())
        };
        let Some(unread) = owned_now(&self.own.owned()) else {
            // Revoked since (or a duplicate fetch): settling it changes nothing.
            return d;
        };
        if unread {
            let store = self.shared.attempts.clone();
            let read = blocking(move || store.read(partition))
                .await
                .and_then(|r| r)
                .unwrap_or_else(|e| {
                    tracing::warn!(target: "idem::broker", broker = BROKER, partition, error = %e, "delivery counts not read; counting from this member's");
                    attempts::Record::default()
                });
            let mut o = self.own.owned();
            if owned_now(&o) == Some(true) {
                o.seed(partition, &read);
                if let Some(p) = o.parts.get_mut(&partition) {
                    p.durable = Some(read);
                }
            }
        }
        let write = {
            let o = self.own.owned();
            let Some(part) = o
                .parts
                .get(&partition)
                .filter(|p| p.generation == generation)
            else {
                return d;
            };
            let attempt = o
                .current_attempt(partition, offset)
                .max(d.attempt.unwrap_or(1));
            d.attempt = Some(attempt);
            let recorded = part
                .durable
                .as_ref()
                .and_then(|r| r.counts.get(&offset))
                .copied()
                .unwrap_or(0);
            let ahead = part.durable.as_ref().and_then(|r| r.ahead);
            let first = part.first;
            let counted = (first == Some(offset) || attempt >= 2) && attempt > recorded;
            // Handed out past the record's `ahead`: a successor would not know this
            // member may have run it. Written ahead by a window, so one write covers the
            // next AHEAD_WINDOW deliveries.
            let uncovered = ahead.is_none_or(|a| offset > a);
            (counted || uncovered).then(|| attempts::Record {
                counts: o
                    .attempts
                    .get(&partition)
                    .map(|a| {
                        a.iter()
                            .filter(|(&off, &n)| n >= 2 || Some(off) == first)
                            .map(|(&off, &n)| (off, n))
                            .collect::<BTreeMap<i64, u32>>()
                    })
                    .unwrap_or_default(),
                ahead: Some(
                    ahead
                        .filter(|_| !uncovered)
                        .unwrap_or(offset + AHEAD_WINDOW),
                ),
            })
        };
        if let Some(mut record) = write {
            record.counts.insert(offset, d.attempt.unwrap_or(1));
            match self
                .shared
                .attempts
                .write(&self.shared.producer, partition, &record)
                .await
            {
                Ok(()) => {
                    let mut o = self.own.owned();
                    if let Some(p) = o
                        .parts
                        .get_mut(&partition)
                        .filter(|p| p.generation == generation)
                    {
                        p.durable = Some(record);
                    }
                }
                Err(e) => {
                    tracing::warn!(target: "idem::broker", broker = BROKER, partition, offset, error = %e, "delivery count not kept; a restart may count this delivery again from 1");
                }
            }
        }
        d
    }

    pub(super) fn retried(&self, r: Retry) -> Option<Delivery<KafkaAcker>> {
        let (attempt, at) = {
            let mut o = self.own.owned();
            let part = o.parts.get(&r.partition);
            if part.map(|p| p.generation) != Some(r.generation) {
                // Revoked meanwhile: its new owner has it.
                return None;
            }
            let at = part.and_then(|p| {
                let t = p.taken.as_ref()?;
                Some(At {
                    epoch: std::num::NonZeroI64::new(t.epoch)?,
                    floor: p.lwm.mark().unwrap_or(r.offset).min(r.offset),
                })
            });
            let attempt = if r.deferred {
                o.current_attempt(r.partition, r.offset)
            } else {
                o.attempt(r.partition, r.offset)
            };
            (attempt, at)
        };
        Some(Delivery {
            payload: r.payload.clone(),
            headers: r.headers.clone(),
            attempt: Some(attempt),
            acker: KafkaAcker {
                partition: r.partition,
                offset: r.offset,
                generation: r.generation,
                at,
                key: r.key,
                payload: r.payload,
                headers: r.headers,
                armed: AtomicBool::new(r.generation != 0),
                shared: Arc::clone(&self.shared),
            },
        })
    }
}
