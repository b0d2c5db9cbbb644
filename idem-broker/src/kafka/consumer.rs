//! Consuming a topic in a group: [`KafkaConsumer`] and its [`KafkaAcker`].

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::Stream;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{Header, Headers as _, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{mpsc, oneshot, Notify};

use super::config::KafkaConfig;
use super::lwm::LowWaterMark;
use super::{base_config, blocking, ensure_topic, producer, BROKER};
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

/// One partition as this member owns it: an assignment generation and its tracker.
#[derive(Debug)]
struct Part {
    generation: u64,
    lwm: LowWaterMark,
}

#[derive(Debug, Default)]
struct Owned {
    parts: HashMap<i32, Part>,
    next_generation: u64,
}

impl Owned {
    fn part(&mut self, partition: i32) -> &mut Part {
        let next = &mut self.next_generation;
        self.parts.entry(partition).or_insert_with(|| {
            *next += 1;
            Part {
                generation: *next,
                lwm: LowWaterMark::new(),
            }
        })
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

fn lock(m: &Mutex<Owned>) -> MutexGuard<'_, Owned> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The consumer's context: keeps the trackers in step with the group's assignment.
struct GroupContext {
    topic: String,
    debug: bool,
    owned: Arc<Mutex<Owned>>,
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
            // Commit the settled prefix of what is taken away, drop the rest: the new
            // owner receives it again and skips the committed part as duplicates.
            let mut commit = TopicPartitionList::new();
            {
                let mut owned = lock(&self.owned);
                for e in tpl.elements_for_topic(&self.topic) {
                    if let Some(mut part) = owned.parts.remove(&e.partition()) {
                        if let Some(o) = part.lwm.take_commit() {
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
                if let Err(e) = base.commit(&commit, CommitMode::Sync) {
                    tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "commit on revoke failed; the new owner skips the redeliveries");
                }
            }
        }
    }

    fn post_rebalance(&self, _base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            {
                let mut owned = lock(&self.owned);
                for e in tpl.elements_for_topic(&self.topic) {
                    // A fresh generation: settlements of an earlier ownership are ignored.
                    owned.parts.remove(&e.partition());
                    owned.part(e.partition());
                }
            }
            self.assigned.notify_one();
        }
    }
}

type Inner = StreamConsumer<GroupContext>;

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
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: Headers,
}

struct Shared {
    topic: String,
    dead_letter: String,
    settle: mpsc::UnboundedSender<Settle>,
    retry: mpsc::UnboundedSender<Retry>,
    producer: FutureProducer,
}

/// Gathers settlements and commits each partition's low-water mark, once per burst.
async fn committer(
    consumer: Arc<Inner>,
    owned: Arc<Mutex<Owned>>,
    topic: String,
    mut rx: mpsc::UnboundedReceiver<Settle>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while let Ok(s) = rx.try_recv() {
            batch.push(s);
        }
        let tpl = {
            let mut o = lock(&owned);
            for s in &batch {
                match o.parts.get_mut(&s.partition) {
                    Some(p) if p.generation == s.generation => {
                        p.lwm.settle(s.offset);
                    }
                    // Revoked since: the new owner receives it again.
                    _ => {}
                }
            }
            o.commits(&topic)
        };
        let result = if tpl.count() == 0 {
            Ok(())
        } else {
            let c = Arc::clone(&consumer);
            let committed = tpl.clone();
            let r = blocking(move || c.commit(&committed, CommitMode::Sync)).await;
            match r {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(BrokerError::op(BROKER, "commit", e)),
                Err(e) => Err(e),
            }
            .map_err(|e| {
                // Take the same marks again with the next commit.
                let mut o = lock(&owned);
                for el in tpl.elements() {
                    if let Some(p) = o.parts.get_mut(&el.partition()) {
                        p.lwm.forget_commit();
                    }
                }
                AckError::from(e)
            })
        };
        for s in batch {
            let r = match &result {
                Ok(()) => Ok(()),
                Err(e) => Err(AckError::new(e.message.clone(), e.retryable, None)),
            };
            let _ = s.done.send(r);
        }
    }
    // Every acker and the stream are gone: close the consumer (it leaves the group)
    // off the async workers. A plain drop; no unsubscribe first (that hung on tansu).
    let _ = blocking(move || drop(consumer)).await;
}

/// Deliveries of a topic to this member of a consumer group, as a stream of
/// `Result<Delivery<KafkaAcker>, BrokerError>`. Each delivery carries the message key
/// (if any) in the `idem-kafka-key` header.
pub struct KafkaConsumer {
    inner: BoxStream<'static, Result<Delivery<KafkaAcker>, BrokerError>>,
    name: String,
    group: String,
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

struct Reader {
    consumer: Arc<Inner>,
    owned: Arc<Mutex<Owned>>,
    shared: Arc<Shared>,
    retries: mpsc::UnboundedReceiver<Retry>,
    first: Option<Delivery<KafkaAcker>>,
}

impl Reader {
    fn delivery(&self, m: &rdkafka::message::BorrowedMessage<'_>) -> Delivery<KafkaAcker> {
        let (partition, offset) = (m.partition(), m.offset());
        let generation = {
            let mut o = lock(&self.owned);
            let part = o.part(partition);
            if part.lwm.register(offset) {
                part.generation
            } else {
                // Not above what this ownership saw: settling it must not move the mark.
                0
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
            attempt: None,
            acker: KafkaAcker {
                partition,
                offset,
                generation,
                key,
                payload,
                headers,
                shared: Arc::clone(&self.shared),
            },
        }
    }

    fn retried(&self, r: Retry) -> Option<Delivery<KafkaAcker>> {
        let current = lock(&self.owned)
            .parts
            .get(&r.partition)
            .map(|p| p.generation);
        if current != Some(r.generation) {
            // Revoked meanwhile: its new owner has it.
            return None;
        }
        Some(Delivery {
            payload: r.payload.clone(),
            headers: r.headers.clone(),
            attempt: None,
            acker: KafkaAcker {
                partition: r.partition,
                offset: r.offset,
                generation: r.generation,
                key: r.key,
                payload: r.payload,
                headers: r.headers,
                shared: Arc::clone(&self.shared),
            },
        })
    }
}

impl crate::pull::Pull for Reader {
    type Acker = KafkaAcker;

    async fn next(&mut self) -> Result<Delivery<KafkaAcker>, BrokerError> {
        if let Some(d) = self.first.take() {
            return Ok(d);
        }
        loop {
            tokio::select! {
                biased;
                Some(r) = self.retries.recv() => {
                    if let Some(d) = self.retried(r) {
                        return Ok(d);
                    }
                }
                m = self.consumer.recv() => {
                    let m = m.map_err(|e| BrokerError::op(BROKER, "poll", e))?;
                    return Ok(self.delivery(&m));
                }
            }
        }
    }
}

impl KafkaConsumer {
    /// Creates the topic and its dead-letter topic if missing, joins the group and
    /// waits (up to [`KafkaConfig::join_timeout`]) for its first assignment.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the cluster cannot be reached or the group assigns
    /// nothing in time; an invalid name.
    pub async fn connect(config: &KafkaConfig) -> Result<Self, BrokerError> {
        let dead_letter = dead_letter_name(&config.name);
        ensure_topic(&config.brokers, &config.name, config.partitions).await?;
        ensure_topic(&config.brokers, &dead_letter, config.partitions).await?;
        let owned = Arc::new(Mutex::new(Owned::default()));
        let assigned = Arc::new(Notify::new());
        let context = GroupContext {
            topic: config.name.clone(),
            debug: super::debug_contexts().is_some(),
            owned: Arc::clone(&owned),
            assigned: Arc::clone(&assigned),
        };
        let session = config.session_timeout.as_millis().max(1_000);
        let consumer: Inner = base_config(&config.brokers)
            .set("group.id", &config.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false")
            .set("session.timeout.ms", session.to_string())
            .set("heartbeat.interval.ms", (session / 4).max(250).to_string())
            .create_with_context(context)
            .map_err(|e| BrokerError::connect(BROKER, e))?;
        consumer
            .subscribe(&[&config.name])
            .map_err(|e| BrokerError::op(BROKER, "subscribe", e))?;
        let consumer = Arc::new(consumer);
        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        let (retry_tx, retry_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            topic: config.name.clone(),
            dead_letter,
            settle: settle_tx,
            retry: retry_tx,
            producer: producer(&config.brokers, config.batch_messages)?,
        });
        tokio::spawn(committer(
            Arc::clone(&consumer),
            Arc::clone(&owned),
            config.name.clone(),
            settle_rx,
        ));
        let mut reader = Reader {
            consumer,
            owned,
            shared,
            retries: retry_rx,
            first: None,
        };
        // Polling drives the join; stop at the first assignment or message.
        let joined = tokio::time::timeout(config.join_timeout, async {
            tokio::select! {
                () = assigned.notified() => Ok(()),
                m = reader.consumer.recv() => {
                    let m = m.map_err(|e| BrokerError::op(BROKER, "poll", e))?;
                    let d = reader.delivery(&m);
                    reader.first = Some(d);
                    Ok(())
                }
            }
        })
        .await;
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(BrokerError::connect(
                    BROKER,
                    format!(
                        "group {:?} assigned no partition of {:?} within {:?}",
                        config.group, config.name, config.join_timeout
                    ),
                ))
            }
        }
        Ok(Self {
            inner: crate::pull::deliveries(reader),
            name: config.name.clone(),
            group: config.group.clone(),
        })
    }
}

impl Stream for KafkaConsumer {
    type Item = Result<Delivery<KafkaAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// Settles one message: marks its offset settled, and the committer commits the
/// partition's low-water mark.
pub struct KafkaAcker {
    partition: i32,
    offset: i64,
    generation: u64,
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: Headers,
    shared: Arc<Shared>,
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

    /// Sends the settlement; the receiver answers once it is committed (or ignored).
    fn send_settle(&self) -> Result<oneshot::Receiver<Result<(), AckError>>, AckError> {
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
    /// uncommitted meanwhile (a crash redelivers it from the broker).
    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        let retry = Retry {
            partition: self.partition,
            generation: self.generation,
            offset: self.offset,
            key: self.key,
            payload: self.payload,
            headers: self.headers,
        };
        let tx = self.shared.retry.clone();
        match delay {
            Some(d) if !d.is_zero() => {
                tokio::spawn(async move {
                    tokio::time::sleep(d).await;
                    let _ = tx.send(retry);
                });
                Ok(())
            }
            _ => tx
                .send(retry)
                .map_err(|_| AckError::new("kafka: the consumer is closed", false, None)),
        }
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
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
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&self.shared.dead_letter)
            .payload(payload)
            .headers(h);
        if let Some(k) = &self.key {
            record = record.key(k.as_slice());
        }
        match self
            .shared
            .producer
            .send(record, Duration::from_secs(30))
            .await
        {
            Ok(_) => self.settle().await,
            // Not dead-lettered: the offset stays uncommitted and comes back.
            Err((e, _)) => Err(BrokerError::op(BROKER, "produce dead-letter", e).into()),
        }
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
