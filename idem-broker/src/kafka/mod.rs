//! Kafka through rdkafka (feature `kafka`).
//!
//! - **Names**: a `NAME` is a topic, created if missing with
//!   [`KafkaConfig::partitions`] partitions and [`KafkaConfig::replication`] replicas
//!   (default `min(3, brokers in the cluster)`; brokers such as tansu do not create
//!   topics on first use); its dead letters go to the topic `NAME.dead-letter`, created
//!   the same way, and its groups' delivery counts to the topic `NAME.attempts`
//!   (compacted; see **Attempts**). An existing topic is used as it is.
//! - **Consuming** ([`KafkaConsumer`]): a consumer group (default `idem`) with manual
//!   offset commits and the `cooperative-sticky` strategy by default
//!   ([`KafkaConfig::assignment`]). Offsets are positional, so [`KafkaAcker`] commits per
//!   partition only the contiguous [`LowWaterMark`]: the smallest offset still in
//!   flight, never past a message that has not settled. Settlements are gathered by one
//!   committer, so a batch (or a burst of concurrent acks) costs one commit; a failed
//!   commit is tried again after a growing delay (to 5 s) whether or not anything else
//!   settles. Commits are **fenced by the assignment**: taking the marks and committing
//!   them happen under one lock that the revoke callback also takes, so a mark taken
//!   before a revoke is committed before the revoke completes or never, and a settlement
//!   of an earlier ownership of a partition is ignored. On a revoke the settled prefix of
//!   each revoked partition is committed and the rest dropped: the new owner receives it
//!   again and skips what was committed as duplicates.
//! - `nack(delay)` hands the message back to this consumer's stream after the delay (its
//!   offset stays uncommitted). `dead_letter` produces it to `NAME.dead-letter` with the
//!   reason in the [`DEAD_LETTER_REASON_HEADER`](crate::DEAD_LETTER_REASON_HEADER) header
//!   (three tries), then settles it; if the produce keeps failing (the broker cut off)
//!   the delivery comes back to the stream after a second, so it is rejected and
//!   dead-lettered again instead of holding the partition's commits back until a
//!   restart. A dead letter refused for good (its size over the dead-letter topic's
//!   `max.message.bytes`, its form, the producer's right to write the topic) is a
//!   [`BrokerError::Config`] as an
//!   [`AckError::config`](idem_core::AckError::config): the delivery is left unsettled
//!   and idem-engine's `consumer::run` stops, since every retry would be refused the
//!   same way. The consumer's producer takes records up to librdkafka's
//!   `receive.message.max.bytes` (100,000,000), so that any record the consumer received
//!   can be dead-lettered; librdkafka's own default, 1,000,000, is below Kafka's for a
//!   topic.
//! - **Attempts**: [`Delivery::attempt`](idem_core::Delivery::attempt) counts the
//!   deliveries of an offset in the group: fetches, nacks, and the partition coming back
//!   before the offset was committed; a deferral ([`defer`](idem_core::Acker::defer))
//!   hands the message back without counting, so the count holds runs only. The counts a
//!   successor needs outlive the member: before a delivery is handed out, the
//!   partition's counts are written to `NAME.attempts` (key `GROUP/PARTITION`, value
//!   `OFFSET:COUNT,…`; acked by the broker) when it is the first delivery of this
//!   ownership of the partition — the offset a restarted or new member starts at too, and
//!   possibly one whose earlier run killed its process — or a redelivery (count 2 and
//!   up). A member reads its partition's counts once per ownership, before its first
//!   delivery of it. So a message that kills its process counts one more in each next
//!   member instead of starting from 1 again. The record also says how far its member
//!   may have handed out deliveries (`ahead`, written 256 offsets ahead, so one write
//!   covers the next 256 deliveries): a successor counts every offset up to it as
//!   delivered once at least, so a message fetched behind the first of an ownership —
//!   whose earlier neighbours' commits never landed before it killed its process — is
//!   still a rerun to the next member, not a first delivery for ever. Up to 256 offsets
//!   after a restart or a rebalance may so count one delivery more than they had; the
//!   gate runs them as reruns (alone, recorded in the store, never charged a run they
//!   did not start). Not the committed offset's metadata, where Kafka
//!   itself could keep it: tansu 0.6 stores an offset commit's metadata but answers
//!   every OffsetFetch with an empty one. A failed read or write is logged, and the
//!   member's own count used.
//! - **Errors from the poll**: librdkafka reports passing trouble — a broker's
//!   connection lost (`BrokerTransportFailure`), every broker down (`AllBrokersDown`), a
//!   partition's leader moving — as errors from the consumer's poll, and recovers from
//!   it by itself (reconnects, rejoins, resumes fetching). The stream goes on through
//!   them: each is logged and counted ([`KafkaConsumer::transient_errors`]). Only a fatal
//!   error (librdkafka's fatal state, in which the client instance is no longer usable)
//!   ends the stream, so a broker restart does not end a member and rebalance its group.
//! - **Prefetch and liveness**: a task of its own polls librdkafka, keeping at most
//!   [`KafkaConfig::prefetch`] deliveries waiting (and librdkafka's own queue bounded by
//!   `queued.min.messages` and [`KafkaConfig::queued_kbytes`]); when they are not taken
//!   for a while (a tenth of `max.poll.interval.ms`, at most 1 s) it pauses the
//!   partitions and keeps polling, so however slow the handler the member meets
//!   `max.poll.interval.ms` ([`KafkaConfig::max_poll_interval`]) and stays in the group.
//!   A consumer that merely takes one delivery at a time never pauses (a pause and
//!   resume costs a fetch round trip).
//! - **Publishing** ([`KafkaPublisher`]): the idempotent producer (`enable.idempotence`,
//!   `acks=all`), the subject (award id) as the message key (order per award), the event
//!   id and type in headers.
//! - **Counting** ([`pending_count`]): per partition, the high watermark minus the
//!   group's committed offset (or the low watermark when nothing was committed).
//! - **URL parameters** (`kafka://127.0.0.1:9092?group=billing`, read by
//!   [`KafkaConfig::from_url`], whose table gives their defaults and ranges): `group`
//!   (default `idem`), `partitions` (default 4) and `replication` (default
//!   `min(3, brokers)`) of a topic created here, `session_timeout` (default `10s`),
//!   `max_poll_interval` (default `5m`), `assignment` (default `cooperative-sticky`),
//!   `batch_messages` (the producer's record-batch size), `queued_kbytes` (default
//!   4096) and `compression.type` (the producer's codec: `none`, `gzip`, `lz4`, `snappy`
//!   or `zstd`; the consumer reads them all). The URL's authority is the bootstrap list;
//!   any other parameter is an error.
//! - **TLS and SASL** ([`KafkaSecurity`], the second table of [`KafkaConfig`]):
//!   `kafkas://` is TLS (`security.protocol=ssl`, or `sasl_ssl` with credentials);
//!   `security.protocol`, `sasl.mechanism` (`PLAIN`, `SCRAM-SHA-256`, `SCRAM-SHA-512`),
//!   `sasl.username` and `sasl.password` (or `user:password@` before the hosts),
//!   `ssl.ca.location`, `ssl.certificate.location`, `ssl.key.location`,
//!   `ssl.key.password` and `ssl.endpoint.identification.algorithm` go to every client
//!   the adapter makes ([`KafkaConfig::client_config`]): the consumer, the producers,
//!   the metadata and admin clients. librdkafka does TLS with the system's OpenSSL.
//!   Credentials on `kafka://` without a `security.protocol` are refused rather than
//!   sent over plain TCP, as is an `ssl.` setting without TLS; passwords show as `***`.
//! - **tansu 0.6** (the test broker) differs from Kafka in ways that matter here:
//!   its fetch starts at the first record batch whose base offset is at or after the
//!   requested offset, skipping the rest of a batch a committed offset points into
//!   (hence [`KafkaConfig::batch_messages`] `= 1` against it); its group
//!   coordinator never hands a dead member's partitions to the surviving members: the
//!   heartbeat that finds the session expired drops the member but keeps the group's
//!   generation and assignments, so the survivors' rejoin gets their old partitions
//!   back. The dead member's partitions are consumed again only after a member joins or
//!   leaves the group (a restarted or replacement consumer, or a survivor that
//!   reconnects); nothing is lost or doubled, it waits. tansu is a single broker, so
//!   topics get one replica there. Its OffsetFetch answers an empty metadata string
//!   whatever was committed with the offset (hence `NAME.attempts`), and its
//!   DescribeConfigs reports only the settings given when a topic was created (no
//!   broker defaults: the [horizon](crate::horizon) of a topic created without
//!   `retention.ms` and `segment.ms` is unknown there). Its `memory://` storage starts
//!   empty after a restart.
//! - **Debugging**: `IDEM_KAFKA_DEBUG=cgrp,consumer` (librdkafka's `debug` contexts)
//!   prints the client's debug log to stderr, e.g. to watch the group's joins and
//!   assignments.

mod attempts;
mod config;
mod consumer;
mod lwm;
mod publisher;

pub use config::{
    Assignment, Compression, EndpointIdentification, KafkaConfig, KafkaSecurity, PositionHandle,
    Positions, SaslMechanism, SecurityProtocol,
};
pub use consumer::{KafkaAcker, KafkaConsumer, KEY_HEADER};
pub use lwm::LowWaterMark;
pub use publisher::{pending_count, pending_count_with, publish_raw, KafkaPublisher};

use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::FutureProducer;
use rdkafka::types::RDKafkaErrorCode;

use crate::BrokerError;

pub(crate) const BROKER: &str = "kafka";

/// How long one metadata or admin request may take.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The bootstrap servers of a `kafka://[user:password@]host:port[,host:port]` URL (or
/// `kafkas://`).
///
/// ```
/// use idem_broker::kafka::brokers_of_url;
/// assert_eq!(brokers_of_url("kafka://127.0.0.1:9092").unwrap(), "127.0.0.1:9092");
/// assert_eq!(brokers_of_url("kafka://a:1,b:2/?x=1").unwrap(), "a:1,b:2");
/// assert_eq!(brokers_of_url("kafkas://u:p@a:1,b:2").unwrap(), "a:1,b:2");
/// assert!(brokers_of_url("kafka://").is_err());
/// ```
///
/// # Errors
/// [`BrokerError::InvalidUrl`] without a host.
pub fn brokers_of_url(url: &str) -> Result<String, BrokerError> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if hosts.is_empty() {
        return Err(BrokerError::InvalidUrl(
            "kafka:// needs host:port of a broker".to_owned(),
        ));
    }
    Ok(hosts.to_owned())
}

pub(crate) fn check_name(name: &str) -> Result<(), BrokerError> {
    let reason = if name.is_empty() {
        Some("empty")
    } else if name.len() > 249 {
        Some("a Kafka topic name has at most 249 characters")
    } else if name == "." || name == ".." {
        Some("'.' and '..' are not topic names")
    } else if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        Some("a Kafka topic name has only letters, digits, '.', '_' and '-'")
    } else {
        None
    };
    BrokerError::refuse_name(name, reason)
}

/// The environment variable that turns librdkafka's debug contexts on (its `debug`
/// setting, e.g. `cgrp,consumer,fetch`): the consumer's logs then go to stderr.
pub const DEBUG_ENV: &str = "IDEM_KAFKA_DEBUG";

/// librdkafka's `debug` contexts from [`DEBUG_ENV`], if set and not empty.
pub(crate) fn debug_contexts() -> Option<String> {
    std::env::var(DEBUG_ENV)
        .ok()
        .filter(|d| !d.trim().is_empty())
}

/// The producer of [`KafkaConfig::producer_config`].
pub(crate) fn producer(config: &KafkaConfig) -> Result<FutureProducer, BrokerError> {
    config
        .producer_config()
        .create()
        .map_err(|e| BrokerError::connect(BROKER, e))
}

/// The largest record a consumer can be delivered: librdkafka's
/// `receive.message.max.bytes`, the largest response it reads (default 100,000,000).
const RECEIVABLE_BYTES: u32 = 100_000_000;

/// The consumer's producer, of its dead letters and delivery counts: librdkafka's
/// `message.max.bytes` raised to [`RECEIVABLE_BYTES`] unless the application sets it
/// ([`KafkaConfig::with_client_setting`]), so that a dead letter of any record the
/// consumer received is refused, if at all, by the dead-letter topic's own
/// `max.message.bytes`. librdkafka's default, 1,000,000, is below Kafka's own for a topic
/// (1,048,588): a record between the two, published by another client, could be received
/// and never dead-lettered.
pub(crate) fn consumer_producer(config: &KafkaConfig) -> Result<FutureProducer, BrokerError> {
    let mut c = config.producer_config();
    if !config
        .client_settings
        .iter()
        .any(|(k, _)| k == "message.max.bytes")
    {
        c.set("message.max.bytes", RECEIVABLE_BYTES.to_string());
    }
    c.create().map_err(|e| BrokerError::connect(BROKER, e))
}

/// Partitions of `topic` as the cluster reports them (0 when it does not know the topic).
pub(crate) fn partition_count(consumer: &BaseConsumer, topic: &str) -> Result<usize, BrokerError> {
    let md = consumer
        .fetch_metadata(Some(topic), REQUEST_TIMEOUT)
        .map_err(|e| BrokerError::connect(BROKER, e))?;
    Ok(md
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map_or(0, |t| t.partitions().len()))
}

/// Creates `topic` on `config`'s cluster with its [`partitions`](KafkaConfig::partitions)
/// and [`replication`](KafkaConfig::replication) (`None`: `min(3, brokers in the
/// cluster)`) unless it exists, and waits until the cluster reports it. An existing
/// topic is used as it is.
pub(crate) async fn ensure_topic(config: &KafkaConfig, topic: &str) -> Result<(), BrokerError> {
    ensure_topic_with(config, topic, &[]).await
}

/// [`ensure_topic`] with topic `configs` (e.g. `cleanup.policy=compact`) for a topic
/// created here.
pub(crate) async fn ensure_topic_with(
    config: &KafkaConfig,
    topic: &str,
    configs: &[(&str, &str)],
) -> Result<(), BrokerError> {
    check_name(topic)?;
    let (partitions, replication) = (config.partitions, config.replication);
    let meta: BaseConsumer = config
        .client_config()
        .set("allow.auto.create.topics", "false")
        .create()
        .map_err(|e| BrokerError::connect(BROKER, e))?;
    let probe = {
        let topic = topic.to_owned();
        move |c: &BaseConsumer| partition_count(c, &topic)
    };
    let (meta, n, cluster) = blocking(move || {
        let n = probe(&meta);
        let cluster = meta
            .fetch_metadata(None, REQUEST_TIMEOUT)
            .map(|md| md.brokers().len());
        (meta, n, cluster)
    })
    .await?;
    if n? > 0 {
        return Ok(());
    }
    let replication = match replication {
        Some(r) => r.max(1),
        None => default_replication(cluster.map_err(|e| BrokerError::connect(BROKER, e))?),
    };
    let admin: AdminClient<DefaultClientContext> = config
        .client_config()
        .create()
        .map_err(|e| BrokerError::connect(BROKER, e))?;
    let mut new = NewTopic::new(
        topic,
        partitions.max(1),
        TopicReplication::Fixed(replication),
    );
    for (k, v) in configs {
        new = new.set(k, v);
    }
    let results = admin
        .create_topics(
            [&new],
            &AdminOptions::new().operation_timeout(Some(REQUEST_TIMEOUT)),
        )
        .await
        .map_err(|e| BrokerError::op(BROKER, "CreateTopics", e))?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, code)) => {
                return Err(BrokerError::op(
                    BROKER,
                    "CreateTopics",
                    format!("topic {t:?}: {code}"),
                ))
            }
        }
    }
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let topic = topic.to_owned();
    blocking(move || loop {
        match partition_count(&meta, &topic) {
            Ok(n) if n > 0 => return Ok(()),
            _ if Instant::now() > deadline => {
                return Err(BrokerError::op(
                    BROKER,
                    "CreateTopics",
                    format!("topic {topic:?} not visible after creation"),
                ))
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    })
    .await?
}

/// The replication factor of a topic created on a cluster of `brokers`: three copies
/// where there are three brokers, one per broker on a smaller cluster.
pub(crate) fn default_replication(brokers: usize) -> i32 {
    i32::try_from(brokers.clamp(1, 3)).unwrap_or(1)
}

/// Runs a blocking librdkafka call off the async workers.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, BrokerError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| BrokerError::op(BROKER, "blocking call", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_names() {
        assert!(check_name("grants.dead-letter").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name("a b").is_err());
        assert!(check_name("..").is_err());
        assert!(check_name(&"x".repeat(250)).is_err());
    }

    #[test]
    fn replication_is_three_where_the_cluster_has_three() {
        assert_eq!(default_replication(0), 1);
        assert_eq!(default_replication(1), 1);
        assert_eq!(default_replication(2), 2);
        assert_eq!(default_replication(3), 3);
        assert_eq!(default_replication(7), 3);
    }
}
