//! Producing to a topic: [`KafkaPublisher`] for the relay, [`publish_raw`] for bodies as
//! they are, and [`pending_count`].

use std::time::Duration;

use async_trait::async_trait;
use idem_core::{OutboxEvent, PublishError, Publisher};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use super::{
    blocking, ensure_topic, partition_count, producer, KafkaConfig, BROKER, REQUEST_TIMEOUT,
};
use crate::BrokerError;

/// Partitions of a topic the publisher creates.
const DEFAULT_PARTITIONS: i32 = 4;

/// Produces outbox events to a topic with the idempotent producer (`acks=all`): the
/// subject (award id) as the key, so one award's events stay in order on one partition;
/// the event id and type in headers.
pub struct KafkaPublisher {
    producer: FutureProducer,
    topic: String,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

/// One message to produce.
struct Outgoing<'a> {
    key: Option<&'a [u8]>,
    payload: &'a [u8],
    headers: Vec<(String, String)>,
}

impl KafkaPublisher {
    /// Connects to `brokers` over plain TCP for producing to `topic` (created with 4
    /// partitions if missing); [`connect_config`](Self::connect_config) takes TLS, SASL
    /// and compression.
    ///
    /// # Errors
    /// The cluster cannot be reached; an invalid name.
    pub async fn connect(brokers: &str, topic: &str) -> Result<Self, BrokerError> {
        Self::connect_with_partitions(brokers, topic, DEFAULT_PARTITIONS).await
    }

    /// As [`connect`](Self::connect), creating a missing topic with `partitions`.
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub async fn connect_with_partitions(
        brokers: &str,
        topic: &str,
        partitions: i32,
    ) -> Result<Self, BrokerError> {
        Self::connect_config(&KafkaConfig::new(brokers, topic).with_partitions(partitions)).await
    }

    /// Connects with `config`'s brokers, [security](KafkaConfig::security), partitions
    /// (of a created topic), producer batch size and compression, for producing to
    /// `config.name` ([`KafkaConfig::producer_config`]).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub async fn connect_config(config: &KafkaConfig) -> Result<Self, BrokerError> {
        ensure_topic(config, &config.name).await?;
        Ok(Self {
            producer: producer(config)?,
            topic: config.name.clone(),
        })
    }

    /// Enqueues every message, then waits for every delivery report.
    async fn produce_all(&self, messages: Vec<Outgoing<'_>>) -> Result<(), BrokerError> {
        let mut inflight: Vec<DeliveryFuture> = Vec::new();
        for m in messages {
            let mut headers = OwnedHeaders::new_with_capacity(m.headers.len());
            for (k, v) in &m.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: Some(v.as_bytes()),
                });
            }
            let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&self.topic)
                .payload(m.payload)
                .headers(headers);
            if let Some(k) = m.key {
                record = record.key(k);
            }
            loop {
                match self.producer.send_result(record) {
                    Ok(f) => {
                        inflight.push(f);
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                        // The local queue is full: wait for what is in flight.
                        record = r;
                        for f in inflight.drain(..) {
                            check(f.await)?;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err((e, _)) => return Err(produce_error("produce", e)),
                }
            }
        }
        for f in inflight {
            check(f.await)?;
        }
        Ok(())
    }

    /// As [`publish_raw`](Self::publish_raw), each record with `headers`.
    ///
    /// # Errors
    /// As [`publish_raw`](Self::publish_raw).
    pub async fn publish_raw_with_headers(
        &self,
        bodies: &[Vec<u8>],
        headers: &[(String, String)],
    ) -> Result<(), BrokerError> {
        self.publish_keyed(bodies, &[], headers).await
    }

    /// As [`publish_raw_with_headers`](Self::publish_raw_with_headers), the body at `i`
    /// with key `keys[i]` (none where `keys` is shorter or holds `None`): records of one
    /// key go to one partition, in the order given, so its members read them in that
    /// order.
    ///
    /// # Errors
    /// As [`publish_raw`](Self::publish_raw).
    pub async fn publish_keyed(
        &self,
        bodies: &[Vec<u8>],
        keys: &[Option<Vec<u8>>],
        headers: &[(String, String)],
    ) -> Result<(), BrokerError> {
        self.produce_all(
            bodies
                .iter()
                .enumerate()
                .map(|(i, b)| Outgoing {
                    key: keys.get(i).and_then(Option::as_deref),
                    payload: b,
                    headers: headers.to_vec(),
                })
                .collect(),
        )
        .await
    }
}

/// Whether Kafka (or librdkafka, before sending) refuses the record itself — its size,
/// its form — so that no retry can help: the relay then moves the event aside rather than
/// retrying its batch forever.
pub(crate) fn refused_for_good(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::MessageBatchTooLarge
                | RDKafkaErrorCode::InvalidRecord
        )
    )
}

/// A produce error, not retryable when [`refused_for_good`].
fn produce_error(action: &'static str, e: KafkaError) -> BrokerError {
    BrokerError::Operation {
        broker: BROKER,
        action,
        retryable: !refused_for_good(&e),
        source: Box::new(e),
    }
}

fn check(
    r: Result<
        rdkafka::producer::future_producer::OwnedDeliveryResult,
        futures::channel::oneshot::Canceled,
    >,
) -> Result<(), BrokerError> {
    match r {
        Ok(Ok(_)) => Ok(()),
        Ok(Err((e, _))) if refused_for_good(&e) => Err(produce_error("delivery", e)),
        Ok(Err((e, _))) => Err(BrokerError::NotConfirmed {
            broker: BROKER,
            detail: e.to_string(),
        }),
        Err(_) => Err(BrokerError::NotConfirmed {
            broker: BROKER,
            detail: "the producer was dropped before the delivery report".into(),
        }),
    }
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        self.produce_all(
            events
                .iter()
                .map(|e| Outgoing {
                    key: Some(e.subject.as_bytes()),
                    payload: &e.payload,
                    headers: e.headers(),
                })
                .collect(),
        )
        .await
        .map_err(Into::into)
    }
}

crate::raw::raw_publishing! {
    /// Produces each body as it is, without a key, and waits for every acknowledgement.
    ///
    /// # Errors
    /// A refused or failed produce; bodies before it may have been produced.
    method of KafkaPublisher;
    /// Produces each body to `topic` as it is (see [`KafkaPublisher::publish_raw`]).
    ///
    /// # Errors
    /// As [`KafkaPublisher::connect`] and [`KafkaPublisher::publish_raw`].
    fn publish_raw(brokers: &str, topic: &str);
}

/// What group `group` has not settled in `topic` at `brokers` (plain TCP): per
/// partition, the high watermark minus the group's committed offset (the low watermark
/// when it committed nothing). The topic is created if missing.
///
/// # Errors
/// The cluster cannot be reached.
pub async fn pending_count(brokers: &str, topic: &str, group: &str) -> Result<u64, BrokerError> {
    let config = KafkaConfig::new(brokers, topic)
        .with_group(group)
        .with_partitions(DEFAULT_PARTITIONS);
    pending_count_with(&config).await
}

/// As [`pending_count`], for group `config.group` in topic `config.name`, reaching the
/// cluster as `config` says ([`KafkaConfig::security`]).
///
/// # Errors
/// The cluster cannot be reached.
pub async fn pending_count_with(config: &KafkaConfig) -> Result<u64, BrokerError> {
    ensure_topic(config, &config.name).await?;
    let consumer: BaseConsumer = config
        .client_config()
        .set("group.id", &config.group)
        .set("enable.auto.commit", "false")
        .create()
        .map_err(|e| BrokerError::connect(BROKER, e))?;
    let topic = config.name.clone();
    let config = config.clone();
    blocking(move || {
        let n = partition_count(&consumer, &topic)?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..n {
            tpl.add_partition(&topic, i32::try_from(p).unwrap_or(i32::MAX));
        }
        let committed = consumer
            .committed_offsets(tpl, REQUEST_TIMEOUT)
            .map_err(|e| BrokerError::op(BROKER, "OffsetFetch", e))?;
        let mut pending = 0u64;
        for e in committed.elements_for_topic(&topic) {
            let (low, high) = consumer
                .fetch_watermarks(&topic, e.partition(), REQUEST_TIMEOUT)
                .map_err(|err| BrokerError::op(BROKER, "ListOffsets", err))?;
            let from = match e.offset() {
                Offset::Offset(o) => o.max(low),
                _ => low,
            };
            let end = true_end(&config, &topic, e.partition(), high)?;
            pending += u64::try_from(end.saturating_sub(from)).unwrap_or(0);
        }
        Ok(pending)
    })
    .await?
}

/// One past the last offset of `partition`: the high watermark, or further when a
/// message at or after it can be read. Some brokers (tansu 0.6) report the start of the
/// last record batch plus one as the high watermark; reading from just below it finds the
/// real end.
fn true_end(
    config: &KafkaConfig,
    topic: &str,
    partition: i32,
    high: i64,
) -> Result<i64, BrokerError> {
    let reader: BaseConsumer = config
        .client_config()
        .set("group.id", "idem-pending-probe")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .create()
        .map_err(|e| BrokerError::connect(BROKER, e))?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset((high - 1).max(0)))
        .map_err(|e| BrokerError::op(BROKER, "assign", e))?;
    reader
        .assign(&tpl)
        .map_err(|e| BrokerError::op(BROKER, "assign", e))?;
    let mut end = high;
    let deadline = std::time::Instant::now() + REQUEST_TIMEOUT;
    while std::time::Instant::now() < deadline {
        match reader.poll(Duration::from_millis(500)) {
            Some(Ok(m)) => end = end.max(rdkafka::Message::offset(&m) + 1),
            // The end of the partition (or nothing more within the poll).
            Some(Err(KafkaError::PartitionEOF(_))) | None => break,
            Some(Err(e)) => return Err(BrokerError::op(BROKER, "Fetch", e)),
        }
    }
    Ok(end)
}
