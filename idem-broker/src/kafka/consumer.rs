//! Consuming a topic in a group: [`KafkaConsumer`] and its [`KafkaAcker`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::Stream;
use idem_core::{
    AckError, AckProof, Acker, Delivery, Headers, PositionMove, PositionStore, RejectReason,
};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Header, Headers as _, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{mpsc, oneshot, Notify};

use super::attempts::{self, attempts_name};
use super::config::KafkaConfig;
use super::lwm::LowWaterMark;
use super::{blocking, ensure_topic, ensure_topic_with, producer, BROKER};
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

/// How often a failed dead-letter produce is tried before the delivery is handed back.
const DEAD_LETTER_TRIES: u32 = 3;
/// How far past the delivery being handed out a record's `ahead` reaches: one write to
/// `NAME.attempts` per this many deliveries (at most), and at most this many offsets
/// counted once too often by a successor (they run as reruns, which the gate records
/// in the store rather than charging them).
const AHEAD_WINDOW: i64 = 256;

/// The first and the longest wait before a failed commit is tried again.
const COMMIT_RETRY_FIRST: Duration = Duration::from_millis(100);
const COMMIT_RETRY_MAX: Duration = Duration::from_secs(5);
/// How long a delivery whose dead-letter produce failed waits before it comes back.
const DEAD_LETTER_RETRY_DELAY: Duration = Duration::from_secs(1);

/// One partition as this member owns it: an assignment generation and its tracker.
#[derive(Debug)]
struct Part {
    generation: u64,
    lwm: LowWaterMark,
    /// The first offset this ownership delivered: where a successor would start too.
    first: Option<i64>,
    /// The partition's record in `NAME.attempts` as last read or written; `None` until
    /// read (once per ownership, before its first delivery is handed out).
    durable: Option<attempts::Record>,
    /// With positions stored: the partition as this ownership took it from the store
    /// (once, before its first delivery is handed out); `None` until then.
    taken: Option<Taken>,
    /// Seeking back to the stored position from the first offset fetched (the group's
    /// offset was ahead of it): until a delivery at or below that offset arrives, those
    /// above it were fetched before the seek and are dropped ([`Owned::rewind`]).
    rewind: Option<i64>,
}

/// A partition taken from the position store ([`idem_core::PositionStore`]).
#[derive(Debug)]
struct Taken {
    epoch: i64,
    /// Every offset below it is done: skipped.
    next: Option<i64>,
    /// Offsets at or past `next` that are done: skipped.
    done: std::collections::BTreeSet<i64>,
}

#[derive(Debug, Default)]
struct Owned {
    parts: HashMap<i32, Part>,
    next_generation: u64,
    /// Deliveries of each offset by this member not yet committed past, counted across
    /// its ownerships of the partition and the nacks in between.
    attempts: HashMap<i32, BTreeMap<i64, u32>>,
    /// Per partition, the highest [`attempts::Record::ahead`] read: every offset up to
    /// it may have been handed out by an earlier member, so this member counts it as
    /// delivered once before.
    inherited: HashMap<i32, i64>,
}

impl Owned {
    fn part(&mut self, partition: i32) -> &mut Part {
        let next = &mut self.next_generation;
        self.parts.entry(partition).or_insert_with(|| {
            *next += 1;
            Part {
                generation: *next,
                lwm: LowWaterMark::new(),
                first: None,
                durable: None,
                taken: None,
                rewind: None,
            }
        })
    }

    /// Ends the ownership of every partition but `held`.
    fn forget_all_but(&mut self, held: impl IntoIterator<Item = i32>) {
        let held: std::collections::BTreeSet<i32> = held.into_iter().collect();
        self.parts.retain(|p, _| held.contains(p));
    }

    /// Starts the ownership of `partition` (at `generation`) over, for a seek back to
    /// an earlier offset: a new generation (what was handed out or fetched under the old
    /// one is dropped, never settled), an empty tracker, each offset in flight uncounted
    /// (it comes again), and the deliveries fetched past the highest one registered
    /// dropped until the seek takes effect ([`Part::rewind`]). `retake`: the partition is
    /// taken from the position store again before its next delivery. Returns the new
    /// generation and the old tracker's mark (where nothing is lost by reading again),
    /// or `None` when the partition was revoked meanwhile.
    fn rewind(
        &mut self,
        partition: i32,
        generation: u64,
        retake: bool,
    ) -> Option<(u64, Option<i64>)> {
        let old = self.parts.remove(&partition)?;
        if old.generation != generation {
            self.parts.insert(partition, old);
            return None;
        }
        if let Some(counts) = self.attempts.get_mut(&partition) {
            for offset in old.lwm.in_flight_offsets() {
                if let Some(n) = counts.get_mut(&offset) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        counts.remove(&offset);
                    }
                }
            }
        }
        self.next_generation += 1;
        let generation = self.next_generation;
        self.parts.insert(
            partition,
            Part {
                generation,
                lwm: LowWaterMark::new(),
                first: None,
                durable: old.durable,
                taken: if retake { None } else { old.taken },
                rewind: old.lwm.highest(),
            },
        );
        Some((generation, old.lwm.mark()))
    }

    /// One more delivery of `offset`: its attempt number.
    fn attempt(&mut self, partition: i32, offset: i64) -> u32 {
        let before = u32::from(self.inherited.get(&partition).is_some_and(|&a| offset <= a));
        let n = self
            .attempts
            .entry(partition)
            .or_default()
            .entry(offset)
            .or_insert(before);
        *n = n.saturating_add(1);
        *n
    }

    /// The count of the delivery of `offset` under way (1 when none was counted).
    fn current_attempt(&self, partition: i32, offset: i64) -> u32 {
        self.attempts
            .get(&partition)
            .and_then(|a| a.get(&offset))
            .copied()
            .unwrap_or(1)
            .max(1)
    }

    /// Takes the record read from `NAME.attempts` into this member's counts: an offset
    /// delivered already (its delivery under way) is at least one past the record, one
    /// not delivered yet starts from it; an offset up to the record's `ahead` that it
    /// does not count was delivered once.
    fn seed(&mut self, partition: i32, read: &attempts::Record) {
        let mine = self.attempts.entry(partition).or_default();
        if let Some(a) = read.ahead {
            let inherited = self.inherited.entry(partition).or_insert(a);
            *inherited = (*inherited).max(a);
            for (offset, m) in mine.range_mut(..=a) {
                if !read.counts.contains_key(offset) {
                    *m = (*m).max(2);
                }
            }
        }
        for (&offset, &n) in &read.counts {
            mine.entry(offset)
                .and_modify(|m| *m = (*m).max(n.saturating_add(1)))
                .or_insert(n);
        }
    }

    /// Forgets the counts of offsets below a committed `mark`.
    fn committed(&mut self, partition: i32, mark: i64) {
        if let Some(a) = self.attempts.get_mut(&partition) {
            *a = a.split_off(&mark);
        }
    }

    /// Each partition's offset to commit, if it moved.
    fn commits(&mut self, topic: &str) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        for (p, part) in &mut self.parts {
            if let Some(o) = part.lwm.take_commit() {
                let _ = tpl.add_partition_offset(topic, *p, Offset::Offset(o));
            }
        }
        tpl
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the member owns, and the fence that keeps commits inside the ownership.
#[derive(Debug, Default)]
struct Ownership {
    owned: Mutex<Owned>,
    /// Held across "take the marks, commit them" by the committer, and across the
    /// revoke by the rebalance callback: a mark taken before a revoke is committed
    /// before the revoke completes, or not at all (the revoke drops the partition's
    /// tracker, and the next round takes nothing for it).
    fence: Mutex<()>,
}

impl Ownership {
    fn owned(&self) -> MutexGuard<'_, Owned> {
        lock(&self.owned)
    }
}

/// The consumer's context: keeps the trackers in step with the group's assignment.
struct GroupContext {
    topic: String,
    debug: bool,
    own: Arc<Ownership>,
    assigned: Arc<Notify>,
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        if self.debug {
            // Asked for with IDEM_KAFKA_DEBUG: straight to stderr, with the time.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            eprintln!(
                "{}.{:03} rdkafka {level:?} {fac}: {log_message}",
                t.as_secs(),
                t.subsec_millis()
            );
        } else {
            DefaultClientContext.log(level, fac, log_message);
        }
    }
}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // Wait for a commit in flight, then commit the settled prefix of what is
            // taken away and drop the rest: the new owner receives it again and skips
            // the committed part as duplicates.
            //
            // An assignment *lost* (the session timed out, or the member was fenced)
            // commits nothing: the partitions may have gone to another member, which
            // has committed further since, and a commit of this member's older mark —
            // sent once the coordinator answers again, under a generation a server may
            // not check (tansu does not) — would move the group's offset backwards.
            let _fence = lock(&self.own.fence);
            let lost = base.assignment_lost();
            let mut commit = TopicPartitionList::new();
            {
                let mut owned = self.own.owned();
                for e in tpl.elements_for_topic(&self.topic) {
                    if let Some(mut part) = owned.parts.remove(&e.partition()) {
                        if lost {
                            tracing::info!(target: "idem::broker", broker = BROKER, partition = e.partition(), "assignment lost: the partition's settled offsets are left uncommitted (its new owner skips them as duplicates)");
                        } else if let Some(o) = part.lwm.take_commit() {
                            let _ = commit.add_partition_offset(
                                &self.topic,
                                e.partition(),
                                Offset::Offset(o),
                            );
                        }
                        if part.lwm.in_flight() > 0 {
                            tracing::debug!(target: "idem::broker", broker = BROKER, partition = e.partition(), dropped = part.lwm.in_flight(), "partition revoked with deliveries in flight");
                        }
                    }
                }
            }
            if commit.count() > 0 {
                match base.commit(&commit, CommitMode::Sync) {
                    Ok(()) => {
                        let mut owned = self.own.owned();
                        for e in commit.elements() {
                            if let Offset::Offset(m) = e.offset() {
                                owned.committed(e.partition(), m);
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "commit on revoke failed; the new owner skips the redeliveries");
                    }
                }
            }
        }
    }

    fn post_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                {
                    let mut owned = self.own.owned();
                    for e in tpl.elements_for_topic(&self.topic) {
                        // A fresh generation: settlements of an earlier ownership are
                        // ignored.
                        owned.parts.remove(&e.partition());
                        owned.part(e.partition());
                    }
                }
                self.assigned.notify_one();
            }
            Rebalance::Error(e) => {
                // rdkafka has unassigned what the failed rebalance named (every
                // partition, under an eager protocol): the ownership of what this
                // member no longer holds ends here, so none of its deliveries settles
                // or is dead-lettered under it.
                let held = base.assignment().ok();
                let held = held
                    .as_ref()
                    .map(|tpl| tpl.elements_for_topic(&self.topic))
                    .unwrap_or_default();
                let mut owned = self.own.owned();
                let before = owned.parts.len();
                owned.forget_all_but(held.iter().map(|e| e.partition()));
                tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, released = before - owned.parts.len(), "rebalance failed; the partitions it took away are no longer this member's");
            }
            Rebalance::Revoke(_) => {}
        }
    }
}

type Inner = StreamConsumer<GroupContext>;

/// The longest the polling task waits for room before it pauses the partitions.
const PAUSE_AFTER_MAX: Duration = Duration::from_secs(1);

/// A settled delivery, for the committer.
struct Settle {
    partition: i32,
    generation: u64,
    offset: i64,
    done: oneshot::Sender<Result<(), AckError>>,
}

/// A nacked delivery, handed back to the stream.
struct Retry {
    partition: i32,
    generation: u64,
    offset: i64,
    /// Deferred, not failed: handed back without counting another delivery.
    deferred: bool,
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: Headers,
}

struct Shared {
    topic: String,
    dead_letter: String,
    /// Where the delivery counts of this group's partitions are kept.
    attempts: attempts::Store,
    settle: mpsc::UnboundedSender<Settle>,
    retry: mpsc::UnboundedSender<Retry>,
    /// Deliveries dropped unsettled, for the stream.
    dropped: mpsc::UnboundedSender<Dropped>,
    producer: FutureProducer,
    /// With positions stored: the store and this consumer's source name in it.
    positions: Option<(Arc<dyn PositionStore>, Arc<str>)>,
    /// [`KafkaConfig::accept_position_gap`].
    accept_position_gap: bool,
    /// What this member owns (a delivery's settled prefix, for its position).
    own: Arc<Ownership>,
    /// Deliveries handed back (deferred or nacked) and not yet taken again: while they
    /// fill the prefetch the stream takes nothing new from the poller (whose channel
    /// fills, so it pauses the partitions), and memory stays bounded however long the
    /// store makes them wait.
    holding: AtomicUsize,
    /// [`KafkaConfig::prefetch`].
    prefetch: usize,
}

/// Settles `batch` and commits each owned partition's low-water mark, inside the fence.
fn commit_round(
    consumer: &Inner,
    own: &Ownership,
    topic: &str,
    batch: &[Settle],
) -> Result<(), BrokerError> {
    let _fence = lock(&own.fence);
    let tpl = {
        let mut o = own.owned();
        for s in batch {
            match o.parts.get_mut(&s.partition) {
                Some(p) if p.generation == s.generation => {
                    p.lwm.settle(s.offset);
                }
                // Revoked since: the new owner receives it again.
                _ => {}
            }
        }
        o.commits(topic)
    };
    if tpl.count() == 0 {
        return Ok(());
    }
    if consumer.assignment_lost() {
        // The session ended (the revoke is on its way): these marks may be behind what
        // a new owner committed since, so they are not sent (see `pre_rebalance`).
        let mut o = own.owned();
        for el in tpl.elements() {
            if let Some(p) = o.parts.get_mut(&el.partition()) {
                p.lwm.forget_commit();
            }
        }
        return Ok(());
    }
    let started = std::time::Instant::now();
    let r = consumer.commit(&tpl, CommitMode::Sync);
    tracing::debug!(target: "idem::broker", broker = BROKER, settled = batch.len(), took = ?started.elapsed(), "offset commit");
    match r {
        Ok(()) => {
            let mut o = own.owned();
            for el in tpl.elements() {
                if let Offset::Offset(m) = el.offset() {
                    o.committed(el.partition(), m);
                }
            }
            Ok(())
        }
        Err(e) => {
            // Take the same marks again in the next round.
            let mut o = own.owned();
            for el in tpl.elements() {
                if let Some(p) = o.parts.get_mut(&el.partition()) {
                    p.lwm.forget_commit();
                }
            }
            Err(BrokerError::op(BROKER, "commit", e))
        }
    }
}

/// Gathers settlements and commits each partition's low-water mark, once per burst. A
/// failed commit is tried again after a growing delay (up to 5 s) even when nothing
/// else settles, so a partition's mark never stays behind until a restart.
async fn committer(
    consumer: Arc<Inner>,
    own: Arc<Ownership>,
    topic: String,
    mut rx: mpsc::UnboundedReceiver<Settle>,
) {
    let mut retry: Option<Duration> = None;
    loop {
        let batch = match retry {
            None => match rx.recv().await {
                Some(first) => vec![first],
                None => break,
            },
            Some(wait) => tokio::select! {
                s = rx.recv() => match s {
                    Some(first) => vec![first],
                    None => break,
                },
                () = tokio::time::sleep(wait) => Vec::new(),
            },
        };
        let mut batch = batch;
        while let Ok(s) = rx.try_recv() {
            batch.push(s);
        }
        let (c, o, t) = (Arc::clone(&consumer), Arc::clone(&own), topic.clone());
        let (batch, result) = match blocking(move || {
            let r = commit_round(&c, &o, &t, &batch);
            (batch, r)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(target: "idem::broker", broker = BROKER, error = %e, "the commit task failed");
                retry = Some(COMMIT_RETRY_FIRST);
                continue;
            }
        };
        retry = match &result {
            Ok(()) => None,
            Err(e) => {
                tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "commit failed; trying again");
                Some(retry.map_or(COMMIT_RETRY_FIRST, |w| (w * 2).min(COMMIT_RETRY_MAX)))
            }
        };
        for s in batch {
            let r = match &result {
                Ok(()) => Ok(()),
                Err(e) => Err(AckError::new(e.to_string(), true, None)),
            };
            let _ = s.done.send(r);
        }
    }
    if retry.is_some() {
        // A failed commit, and nothing more will settle: one last try.
        let (c, o, t) = (Arc::clone(&consumer), Arc::clone(&own), topic.clone());
        let _ = blocking(move || commit_round(&c, &o, &t, &[])).await;
    }
    // Every acker and the stream are gone: close the consumer (it leaves the group)
    // off the async workers. A plain drop; no unsubscribe first (that hung on tansu).
    let _ = blocking(move || drop(consumer)).await;
}

/// Deliveries of a topic to this member of a consumer group, as a stream of
/// `Result<Delivery<KafkaAcker>, BrokerError>`. Each delivery carries the message key
/// (if any) in the `idem-kafka-key` header, and its [`attempt`](Delivery::attempt):
/// how often the group delivered that offset (a nack, or the partition coming back
/// before the offset was committed, counts again; a deferral does not), kept across
/// members and restarts in `NAME.attempts` (see the [module docs](super)).
///
/// Errors librdkafka recovers from by itself (a broker connection lost, every broker
/// down) are logged and counted ([`transient_errors`](Self::transient_errors)) and the
/// stream goes on; a fatal one ends it, and so does a cluster of which no broker answered
/// for the [session timeout](KafkaConfig::session_timeout) (a
/// [`BrokerError::Connect`]: by then the group has dropped the member).
///
/// A task of its own polls librdkafka and keeps up to
/// [`prefetch`](KafkaConfig::prefetch) deliveries waiting; when they are not taken for
/// a while (a tenth of `max.poll.interval.ms`, at most 1 s) it pauses the assigned
/// partitions and keeps polling (so the member stays in the group however slow the
/// handler: `max.poll.interval.ms` is met), and resumes them once there is room.
/// Deliveries handed back (deferred, or nacked with a delay) count against the prefetch
/// until they come back: while they fill it the stream takes nothing new, so the
/// partitions pause and memory stays bounded however long the store makes them wait.
pub struct KafkaConsumer {
    inner: BoxStream<'static, Result<Delivery<KafkaAcker>, BrokerError>>,
    name: String,
    group: String,
    transient_errors: Arc<AtomicU64>,
    skipped: Arc<AtomicU64>,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("name", &self.name)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

/// The header that carries a message's key (lossy UTF-8) on a delivery.
pub const KEY_HEADER: &str = "idem-kafka-key";

/// Turns polled messages into deliveries.
struct Converter {
    own: Arc<Ownership>,
    shared: Arc<Shared>,
    /// For the seek to a stored position (`None` where nothing seeks).
    consumer: Option<Arc<Inner>>,
    /// Deliveries skipped because the position store holds them done.
    skipped: Arc<AtomicU64>,
}

impl Converter {
    fn delivery(&self, m: &BorrowedMessage<'_>) -> Delivery<KafkaAcker> {
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
    async fn positioned(
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
    async fn dropped(&self, d: Dropped) -> Result<(), BrokerError> {
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
    async fn counted(&self, mut d: Delivery<KafkaAcker>) -> Delivery<KafkaAcker> {
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

    fn retried(&self, r: Retry) -> Option<Delivery<KafkaAcker>> {
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

type Polled = Result<Delivery<KafkaAcker>, BrokerError>;

/// Checks a partition's stored position `next` against its log: past the log's end, the
/// position belongs to another log (the topic was recreated, or the store serves another
/// cluster) and skipping up to it would skip records never processed; behind the log's
/// start with the group's committed offset behind it too (or none), the records between
/// were deleted by the topic's retention before anyone processed them. Either is a
/// [`BrokerError::Config`] (the second only unless `accept`); a failed request another
/// error (the caller tries again). Returns the log's start (its low watermark).
fn check_log(
    consumer: &Inner,
    topic: &str,
    partition: i32,
    next: i64,
    accept: bool,
) -> Result<i64, BrokerError> {
    let (low, high) = consumer
        .fetch_watermarks(topic, partition, super::REQUEST_TIMEOUT)
        .map_err(|e| BrokerError::op(BROKER, "fetch the watermarks", e))?;
    if next > high {
        return Err(BrokerError::Config {
            broker: BROKER,
            detail: format!(
                "partition {partition} of {topic:?}: the stored position {next} is past the \
                 end of the log ({high}): the topic was recreated, or the store belongs to \
                 another cluster; nothing of the partition is consumed (delete its rows from \
                 idem_positions to start from the group's offsets)"
            ),
        });
    }
    if next >= low || accept {
        return Ok(low);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    let committed = consumer
        .committed_offsets(tpl, super::REQUEST_TIMEOUT)
        .map_err(|e| BrokerError::op(BROKER, "read the group's committed offset", e))?;
    let group_offset = committed
        .find_partition(topic, partition)
        .and_then(|e| match e.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        });
    if group_offset.is_some_and(|c| c >= low) {
        // The records between were settled by a member (the group's offset moves only
        // past settled records) before the retention deleted them.
        return Ok(low);
    }
    Err(BrokerError::Config {
        broker: BROKER,
        detail: format!(
            "partition {partition} of {topic:?}: the stored position {next} is behind the \
             start of the log ({low}) and so is the group's offset ({}): records {next} to \
             {} were deleted before they were processed (`positions_gap=accept` goes on from \
             {low})",
            group_offset.map_or_else(|| "none".to_owned(), |c| c.to_string()),
            low - 1
        ),
    })
}

/// Pauses (or resumes) every partition assigned now.
fn set_paused(consumer: &Inner, paused: bool) {
    let Ok(assignment) = consumer.assignment() else {
        return;
    };
    if assignment.count() == 0 {
        return;
    }
    let r = if paused {
        consumer.pause(&assignment)
    } else {
        consumer.resume(&assignment)
    };
    if let Err(e) = r {
        tracing::debug!(target: "idem::broker", broker = BROKER, error = %e, paused, "pause/resume");
    }
}

/// Sorts an error from the consumer's poll: `None` for one librdkafka recovers from by
/// itself (logged and counted in `errors`; polling goes on), the error that ends the
/// stream for a fatal one (librdkafka's fatal-error state: the client instance is no
/// longer usable).
///
/// librdkafka hands its transient trouble to the poll as errors: a broker connection
/// lost (`BrokerTransportFailure`), every broker down (`AllBrokersDown`), a partition's
/// leader unknown for a while, a rejoin. It reconnects, rejoins the group and resumes
/// fetching on its own, so ending the stream on them would turn a broker restart into a
/// rebalance of the whole group.
fn poll_error(
    consumer: &Inner,
    e: KafkaError,
    errors: &AtomicU64,
    down: &Mutex<Option<std::time::Instant>>,
) -> Option<BrokerError> {
    let fatal = match &e {
        KafkaError::MessageConsumptionFatal(_) => true,
        _ => consumer.client().fatal_error().is_some(),
    };
    if fatal {
        let detail = consumer.client().fatal_error().map_or_else(
            || e.to_string(),
            |(code, text)| format!("{e}: {code}: {text}"),
        );
        tracing::error!(target: "idem::broker", broker = BROKER, error = %detail, "fatal consumer error: the stream ends");
        return Some(BrokerError::op(BROKER, "poll", detail));
    }
    // Trouble from here on: the watchdog (`unreachable`) asks the cluster until it answers.
    lock(down).get_or_insert_with(std::time::Instant::now);
    let n = errors.fetch_add(1, Ordering::Relaxed) + 1;
    tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, code = ?e.rdkafka_error_code(), transient_errors = n, "consumer error; librdkafka recovers, polling goes on");
    None
}

/// Polls librdkafka for the stream: up to the channel's capacity ahead. When the channel
/// is full it waits for room (librdkafka goes on fetching into its own bounded queue);
/// only when no room comes within `pause_after` (a slow handler) are the partitions
/// paused and polling goes on (serving rebalances and librdkafka's
/// `max.poll.interval.ms`) until there is room again. Pausing at once whenever the
/// channel is full made a consumer that takes one delivery at a time pause and resume
/// for every few messages, each resume waiting for a new fetch (57 msg/s on tansu).
/// librdkafka reports passing trouble (a broker's connection lost, every broker down, a
/// partition's leader moving) as errors from the consumer's poll and recovers by itself:
/// those are logged and counted in `errors` and polling goes on ([`poll_error`]). Ends
/// when the stream is dropped, or after handing over a fatal error.
async fn poller(
    consumer: Arc<Inner>,
    convert: Converter,
    tx: mpsc::Sender<Polled>,
    pause_after: Duration,
    errors: Arc<AtomicU64>,
    down: Arc<Mutex<Option<std::time::Instant>>>,
) {
    // Messages that arrived while paused (fetched before the pause, or from a partition
    // assigned meanwhile): handed over first.
    let mut held: VecDeque<Polled> = VecDeque::new();
    let mut paused = false;
    loop {
        let permit = match tx.try_reserve() {
            Ok(p) => p,
            Err(mpsc::error::TrySendError::Closed(())) => return,
            Err(mpsc::error::TrySendError::Full(())) => {
                if !paused {
                    tokio::select! {
                        p = tx.reserve() => match p {
                            Ok(p) => p,
                            Err(_) => return,
                        },
                        () = tokio::time::sleep(pause_after) => {
                            set_paused(&consumer, true);
                            paused = true;
                            continue;
                        }
                    }
                } else {
                    tokio::select! {
                    p = tx.reserve() => match p {
                        Ok(p) => p,
                        Err(_) => return,
                    },
                    m = consumer.recv() => {
                        let m = match m {
                            Ok(m) => {
                                *lock(&down) = None;
                                Ok(convert.delivery(&m))
                            }
                            Err(e) => match poll_error(&consumer, e, &errors, &down) {
                                Some(fatal) => Err(fatal),
                                None => continue,
                            },
                        };
                        // A partition assigned while paused is not paused: pause again.
                        set_paused(&consumer, true);
                        held.push_back(m);
                        continue;
                    }
                    }
                }
            }
        };
        if paused && held.is_empty() {
            set_paused(&consumer, false);
            paused = false;
        }
        let item = match held.pop_front() {
            Some(item) => item,
            None => tokio::select! {
                m = consumer.recv() => match m {
                    Ok(m) => {
                        *lock(&down) = None;
                        Ok(convert.delivery(&m))
                    }
                    Err(e) => match poll_error(&consumer, e, &errors, &down) {
                        Some(fatal) => Err(fatal),
                        // The permit is dropped and taken again: nothing is lost.
                        None => continue,
                    },
                },
                () = tx.closed() => return,
            },
        };
        let failed = item.is_err();
        permit.send(item);
        if failed {
            return;
        }
    }
}

/// How often the watchdog asks an unanswering cluster for its metadata.
const UNREACHABLE_PROBE_EVERY: Duration = Duration::from_secs(2);

/// Ends the stream once every broker has stayed unreachable for the member's session
/// timeout: librdkafka reconnects for ever and reports its trouble as transient errors
/// (a cluster gone for good, a revoked credential, an ACL that now refuses), and by then
/// the group has dropped the member, so nothing is lost by starting over. While the poll
/// reports trouble (`down` is set) it asks the cluster for the topic's metadata every
/// two seconds; an answer (or a message) clears it. The error it hands the stream is a
/// [`BrokerError::Connect`]: `idem consume` reconnects under `--reconnect-timeout`, and a
/// cluster that stays away ends the run with exit 1.
async fn unreachable(
    consumer: Arc<Inner>,
    topic: String,
    tx: mpsc::Sender<Polled>,
    session: Duration,
    down: Arc<Mutex<Option<std::time::Instant>>>,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(UNREACHABLE_PROBE_EVERY) => {}
            () = tx.closed() => return,
        }
        let Some(since) = *lock(&down) else {
            continue;
        };
        let (c, t) = (Arc::clone(&consumer), topic.clone());
        let answered = blocking(move || {
            c.fetch_metadata(Some(&t), UNREACHABLE_PROBE_EVERY)
                .map(drop)
                .map_err(|e| BrokerError::op(BROKER, "fetch the metadata", e))
        })
        .await
        .and_then(|r| r);
        if answered.is_ok() {
            *lock(&down) = None;
            continue;
        }
        let gone = since.elapsed();
        if gone >= session {
            tracing::error!(target: "idem::broker", broker = BROKER, seconds = gone.as_secs(), "every broker unreachable for the session timeout: the stream ends");
            let _ = tx
                .send(Err(BrokerError::connect(
                    BROKER,
                    format!(
                        "no broker of the cluster answered for {} s (the session timeout: the \
                         group has dropped this member)",
                        gone.as_secs()
                    ),
                )))
                .await;
            return;
        }
    }
}

struct Reader {
    /// The delivery polled while joining, handed out first.
    joined: Option<Delivery<KafkaAcker>>,
    polled: mpsc::Receiver<Polled>,
    convert: Arc<Converter>,
    retries: mpsc::UnboundedReceiver<Retry>,
    dropped: mpsc::UnboundedReceiver<Dropped>,
}

impl crate::pull::Pull for Reader {
    type Acker = KafkaAcker;

    async fn next(&mut self) -> Result<Delivery<KafkaAcker>, BrokerError> {
        if let Some(d) = self.joined.take() {
            if let Some(d) = self.convert.positioned(d).await? {
                return Ok(self.convert.counted(d).await);
            }
        }
        loop {
            // Deliveries handed back fill the prefetch: only they are taken until there is
            // room (the poller's channel fills meanwhile and it pauses the partitions).
            let shared = &self.convert.shared;
            let room = shared.holding.load(Ordering::Acquire) < shared.prefetch;
            tokio::select! {
                biased;
                Some(d) = self.dropped.recv() => self.convert.dropped(d).await?,
                Some(r) = self.retries.recv() => {
                    self.convert.shared.holding.fetch_sub(1, Ordering::AcqRel);
                    if let Some(d) = self.convert.retried(r) {
                        return Ok(self.convert.counted(d).await);
                    }
                }
                m = self.polled.recv(), if room => {
                    match m {
                        Some(Ok(d)) => {
                            if let Some(d) = self.convert.positioned(d).await? {
                                return Ok(self.convert.counted(d).await);
                            }
                        }
                        Some(Err(e)) => return Err(e),
                        None => {
                            return Err(BrokerError::op(BROKER, "poll", "the polling task ended"))
                        }
                    }
                }
            }
        }
    }
}

impl KafkaConsumer {
    /// Creates the topic and its dead-letter topic if missing (replication
    /// [`KafkaConfig::replication`]), joins the group and waits (up to
    /// [`KafkaConfig::join_timeout`]) for its first assignment.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the cluster cannot be reached or the group assigns
    /// nothing in time; an invalid name.
    pub async fn connect(config: &KafkaConfig) -> Result<Self, BrokerError> {
        let positions = match &config.positions {
            super::Positions::Broker => None,
            super::Positions::Store(Some(h)) => {
                Some((Arc::clone(&h.0), Arc::<str>::from(config.position_source())))
            }
            super::Positions::Store(None) => {
                return Err(BrokerError::InvalidParam {
                    param: "positions".to_owned(),
                    value: "store".to_owned(),
                    reason: "needs a position store: KafkaConfig::with_position_store (idem \
                             consume gives its --store, which must be Postgres or SQLite)"
                        .to_owned(),
                })
            }
        };
        let dead_letter = dead_letter_name(&config.name);
        ensure_topic(config, &config.name).await?;
        ensure_topic(config, &dead_letter).await?;
        let attempts_topic = attempts_name(&config.name);
        ensure_topic_with(config, &attempts_topic, &[("cleanup.policy", "compact")]).await?;
        let attempts_partitions = {
            let (meta_config, topic) = (config.client_config(), attempts_topic.clone());
            blocking(move || {
                let meta: BaseConsumer = meta_config
                    .create()
                    .map_err(|e| BrokerError::connect(BROKER, e))?;
                super::partition_count(&meta, &topic)
            })
            .await??
        };
        let own = Arc::new(Ownership::default());
        let assigned = Arc::new(Notify::new());
        let context = GroupContext {
            topic: config.name.clone(),
            debug: super::debug_contexts().is_some(),
            own: Arc::clone(&own),
            assigned: Arc::clone(&assigned),
        };
        let prefetch = config.prefetch.max(1);
        let consumer: Inner = config
            .consumer_config()
            .create_with_context(context)
            .map_err(|e| BrokerError::connect(BROKER, e))?;
        consumer
            .subscribe(&[&config.name])
            .map_err(|e| BrokerError::op(BROKER, "subscribe", e))?;
        let consumer = Arc::new(consumer);
        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        let (retry_tx, retry_rx) = mpsc::unbounded_channel();
        let (dropped_tx, dropped_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            topic: config.name.clone(),
            dead_letter,
            attempts: attempts::Store {
                kafka: config.clone(),
                topic: attempts_topic,
                group: config.group.clone(),
                partitions: i32::try_from(attempts_partitions).unwrap_or(1).max(1),
            },
            settle: settle_tx,
            retry: retry_tx,
            dropped: dropped_tx,
            producer: producer(config)?,
            positions,
            accept_position_gap: config.accept_position_gap,
            own: Arc::clone(&own),
            holding: AtomicUsize::new(0),
            prefetch,
        });
        tokio::spawn(committer(
            Arc::clone(&consumer),
            Arc::clone(&own),
            config.name.clone(),
            settle_rx,
        ));
        let skipped = Arc::new(AtomicU64::new(0));
        let convert = Converter {
            own: Arc::clone(&own),
            shared: Arc::clone(&shared),
            consumer: None,
            skipped: Arc::clone(&skipped),
        };
        let (polled_tx, mut polled) = mpsc::channel(prefetch);
        let retries_convert = Arc::new(Converter {
            own,
            shared,
            consumer: Some(Arc::clone(&consumer)),
            skipped: Arc::clone(&skipped),
        });
        // Pause only for a stall well inside max.poll.interval.ms (see `poller`).
        let pause_after = (config.max_poll_interval / 10).min(PAUSE_AFTER_MAX);
        let transient_errors = Arc::new(AtomicU64::new(0));
        let down = Arc::new(Mutex::new(None));
        tokio::spawn(unreachable(
            Arc::clone(&consumer),
            config.name.clone(),
            polled_tx.clone(),
            config.session_timeout,
            Arc::clone(&down),
        ));
        tokio::spawn(poller(
            Arc::clone(&consumer),
            convert,
            polled_tx,
            pause_after,
            Arc::clone(&transient_errors),
            down,
        ));
        // Polling drives the join; stop at the first assignment or message.
        let mut first: Option<Polled> = None;
        let joined = tokio::time::timeout(config.join_timeout, async {
            tokio::select! {
                () = assigned.notified() => {}
                m = polled.recv() => first = m,
            }
        })
        .await;
        if joined.is_err() {
            return Err(BrokerError::connect(
                BROKER,
                format!(
                    "group {:?} assigned no partition of {:?} within {:?}",
                    config.group, config.name, config.join_timeout
                ),
            ));
        }
        let joined = match first {
            Some(Err(e)) => return Err(e),
            Some(Ok(d)) => Some(d),
            None => None,
        };
        let reader = Reader {
            joined,
            polled,
            convert: retries_convert,
            retries: retry_rx,
            dropped: dropped_rx,
        };
        let inner = crate::pull::deliveries(reader);
        Ok(Self {
            inner,
            name: config.name.clone(),
            group: config.group.clone(),
            transient_errors,
            skipped,
        })
    }

    /// How many errors librdkafka reported from the poll that it recovers from by itself
    /// (a broker connection lost, every broker down): logged, counted here, and the
    /// stream goes on. Only a fatal error ends the stream.
    pub fn transient_errors(&self) -> u64 {
        self.transient_errors.load(Ordering::Relaxed)
    }

    /// With positions stored: how many deliveries were skipped, not handed out, because
    /// the position store holds them done (fetched before the seek to the stored
    /// position took effect, or done past it).
    pub fn skipped_by_position(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }
}

impl Stream for KafkaConsumer {
    type Item = Result<Delivery<KafkaAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// A delivery's place for its claim transaction, with positions stored.
#[derive(Debug, Clone, Copy)]
struct At {
    /// The ownership's epoch (at least 1: `Option<At>` takes no more room than `At`).
    epoch: std::num::NonZeroI64,
    /// Every offset below it was settled when the delivery was handed out.
    floor: i64,
}

/// Settles one message: marks its offset settled, and the committer commits the
/// partition's low-water mark.
pub struct KafkaAcker {
    partition: i32,
    offset: i64,
    generation: u64,
    /// With positions stored: the ownership's epoch and the settled prefix when handed
    /// out.
    at: Option<At>,
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: Headers,
    /// Not settled yet: dropped so, it tells the stream ([`Converter::dropped`]).
    armed: AtomicBool,
    shared: Arc<Shared>,
}

/// A delivery dropped without being settled, for the stream ([`Converter::dropped`]).
struct Dropped {
    partition: i32,
    generation: u64,
    offset: i64,
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
    fn send_settle(&self) -> Result<oneshot::Receiver<Result<(), AckError>>, AckError> {
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

async fn wait(rx: oneshot::Receiver<Result<(), AckError>>) -> Result<(), AckError> {
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

    /// With positions stored ([`Positions::Store`](super::Positions::Store)): the
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
        mut self,
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
        for (k, v) in headers
            .iter()
            .filter(|(k, _)| k != DEAD_LETTER_REASON_HEADER && k != KEY_HEADER)
        {
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
                Err((e, _)) => last = Some(e),
            }
        }
        // Not dead-lettered: hand the delivery back to this consumer's stream (its
        // offset stays uncommitted), so it is rejected and dead-lettered again rather
        // than holding the partition's commits back until a restart.
        let e = BrokerError::op(
            BROKER,
            "produce dead-letter",
            last.map_or_else(|| "no attempt".to_owned(), |e| e.to_string()),
        );
        self.disarm();
        let retry = Retry {
            partition: self.partition,
            generation: self.generation,
            offset: self.offset,
            deferred: false,
            key: self.key.take(),
            payload: std::mem::take(&mut self.payload),
            headers: std::mem::take(&mut self.headers),
        };
        let tx = self.shared.retry.clone();
        tokio::spawn(async move {
            tokio::time::sleep(DEAD_LETTER_RETRY_DELAY).await;
            let _ = tx.send(retry);
        });
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
