//! How long a source can still redeliver a message: its **redelivery horizon**.
//!
//! A dedup record may only be purged once no broker can redeliver its message any more
//! (docs/operations.md). [`redelivery_horizon`] reads, from the broker itself, how
//! long a source keeps a message:
//!
//! | broker | read from | kept until |
//! |---|---|---|
//! | SQS | the queue's `MessageRetentionPeriod` | that age ([`Retention::Limited`]) |
//! | Kafka | the topic's `retention.ms`, `segment.ms` and `cleanup.policy` | `retention.ms + segment.ms` (a segment is deleted once its newest record is past `retention.ms`, and it takes records for up to `segment.ms` before it rolls); `retention.ms=-1`: for ever ([`Retention::Unbounded`]); a compacted topic (`cleanup.policy` with `compact`) keeps each key's last record for ever, and a broker that does not report both settings (tansu reports only those set on the topic) leaves it open: [`Retention::Unknown`] |
//! | NATS JetStream | the stream's `max_age` | that age; `0`: until removed, the oldest message's age read from the stream ([`Retention::UntilRemoved`]) |
//! | Redis Streams | the stream's first entry | until trimmed (`XTRIM`, `MAXLEN`): the oldest entry still in the stream bounds what can come back ([`Retention::UntilRemoved`]) |
//! | RabbitMQ | — | a queue's `x-message-ttl` (argument or policy) cannot be read over AMQP: [`Retention::Unknown`] |
//!
//! A source's dead letters (`NAME.dead-letter`, see [`dead_letter_name`]) are part of its
//! horizon: an operator may replay them into the source, so the horizon is the longer of
//! the source's and its dead-letter place's (an unbounded or unknown one wins). A source
//! without a dead-letter place has its own horizon.
//!
//! [`RedeliveryHorizon::horizon`] is `None` when nothing bounds it (unbounded or
//! unknown): no purge is safe from that source's side. [`check_cutoff`] is the rule
//! `idem purge` applies.
//!
//! A Kafka source whose group keeps its positions in the store (`?positions=store`,
//! [`crate::kafka::Positions`]) is read by [`redelivery_horizon_with`]: when every
//! partition of the topic has a stored position, nothing at or before it is delivered
//! to the group again — a new owner starts there — so the topic's own retention bounds
//! no replay ([`Retention::PositionsStored`], horizon zero); its dead letters still
//! count. A partition without a stored position falls back to the topic's retention.
//! The one way back past a stored position is an operator's offset reset (see
//! docs/brokers.md).
//!
//! For [`Retention::UntilRemoved`] the horizon is the age of the oldest message still
//! held, measured now: it grows while nothing is trimmed. It assumes the broker assigns
//! a message's time when it is stored (JetStream always; Redis for `XADD *` ids, which
//! idem uses).

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::any::{BrokerKind, BrokerUrl};
use crate::{dead_letter_name, BrokerError};

/// How long a source keeps a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retention {
    /// Messages are removed at this age (SQS retention, Kafka `retention.ms`, NATS
    /// `max_age`).
    Limited(Duration),
    /// Messages are kept until consumed, trimmed or deleted; `oldest` is the age of the
    /// oldest message still held (`None`: the source is empty).
    UntilRemoved {
        /// Age of the oldest message the source holds now.
        oldest: Option<Duration>,
    },
    /// Messages are kept for ever and their age cannot be bounded (Kafka
    /// `retention.ms=-1`).
    Unbounded,
    /// The broker does not say (RabbitMQ over AMQP; a Kafka topic whose retention is not
    /// reported), or keeps some messages for ever depending on their keys (a compacted
    /// Kafka topic).
    Unknown,
    /// Every partition's position is kept in the claim store (Kafka `?positions=store`):
    /// nothing is delivered to the group again from before it, whatever the topic keeps.
    /// Horizon zero.
    PositionsStored {
        /// The topic's partitions, each with a stored position.
        partitions: usize,
    },
}

/// The redelivery horizon of one source, and where it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedeliveryHorizon {
    /// The broker.
    pub broker: BrokerKind,
    /// The source name (queue, topic, stream).
    pub source: String,
    /// What the broker said.
    pub retention: Retention,
    /// Where it was read, in words (for `inspect` and refusals).
    pub detail: String,
}

impl RedeliveryHorizon {
    /// How old a message of this source can be when it is redelivered, or `None` when
    /// nothing bounds it.
    pub fn horizon(&self) -> Option<Duration> {
        match self.retention {
            Retention::Limited(d) => Some(d),
            Retention::UntilRemoved { oldest } => Some(oldest.unwrap_or(Duration::ZERO)),
            Retention::PositionsStored { .. } => Some(Duration::ZERO),
            Retention::Unbounded | Retention::Unknown => None,
        }
    }
}

impl fmt::Display for RedeliveryHorizon {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.horizon() {
            Some(d) => write!(
                f,
                "{} {:?}: {} ({})",
                self.broker,
                self.source,
                human(d),
                self.detail
            ),
            None => write!(
                f,
                "{} {:?}: unbounded ({})",
                self.broker, self.source, self.detail
            ),
        }
    }
}

/// A duration as `3d 4h 5m 6s` (zero parts left out; `0s` for zero).
pub fn human(d: Duration) -> String {
    let s = d.as_secs();
    let parts = [
        (s / 86_400, "d"),
        (s / 3600 % 24, "h"),
        (s / 60 % 60, "m"),
        (s % 60, "s"),
    ];
    let text: Vec<String> = parts
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, u)| format!("{n}{u}"))
        .collect();
    if text.is_empty() {
        "0s".to_owned()
    } else {
        text.join(" ")
    }
}

/// Why a purge cutoff is refused by [`check_cutoff`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HorizonError {
    /// A source's horizon is unbounded or unknown: no cutoff is safe.
    #[error("refusing to purge: {0} can still redeliver a message of any age; set a retention on it first")]
    Unbounded(String),
    /// The cutoff is younger than a source's horizon plus the margin.
    #[error("refusing to purge records younger than {required} (the redelivery horizon of {source_text} plus a margin of {margin}): --older-than {older_than} is inside it")]
    InsideHorizon {
        /// The `--older-than` asked for.
        older_than: String,
        /// The horizon plus the margin.
        required: String,
        /// The margin.
        margin: String,
        /// The source whose horizon is the longest.
        source_text: String,
    },
}

/// Checks a purge of records older than `older_than` against `horizons`: refused when
/// any is unbounded, or when `older_than` is shorter than the longest horizon plus
/// `margin`. Returns the longest horizon (zero without sources).
///
/// ```
/// use std::time::Duration;
/// use idem_broker::horizon::check_cutoff;
/// let day = Duration::from_secs(86_400);
/// assert_eq!(check_cutoff(30 * day, &[], day).unwrap(), Duration::ZERO);
/// ```
///
/// # Errors
/// [`HorizonError`] naming the source.
pub fn check_cutoff(
    older_than: Duration,
    horizons: &[RedeliveryHorizon],
    margin: Duration,
) -> Result<Duration, HorizonError> {
    let mut longest: Option<&RedeliveryHorizon> = None;
    for h in horizons {
        let Some(d) = h.horizon() else {
            return Err(HorizonError::Unbounded(h.to_string()));
        };
        if longest
            .and_then(RedeliveryHorizon::horizon)
            .is_none_or(|l| d > l)
        {
            longest = Some(h);
        }
    }
    let Some(h) = longest else {
        return Ok(Duration::ZERO);
    };
    let d = h.horizon().unwrap_or(Duration::ZERO);
    let required = d.saturating_add(margin);
    if older_than < required {
        return Err(HorizonError::InsideHorizon {
            older_than: human(older_than),
            required: human(required),
            margin: human(margin),
            source_text: h.to_string(),
        });
    }
    Ok(d)
}

/// Reads the redelivery horizon of source `name` on the broker at `url`: the longer of
/// the source's and its dead-letter place's (see the module docs). Nothing is created: a
/// missing source is an error, a missing dead-letter place is left out.
///
/// # Errors
/// The broker cannot be reached; the source does not exist
/// ([`BrokerError::InvalidName`]); the broker's answer cannot be read.
pub async fn redelivery_horizon(
    url: &BrokerUrl,
    name: &str,
) -> Result<RedeliveryHorizon, BrokerError> {
    redelivery_horizon_with(url, name, None).await
}

/// [`redelivery_horizon`], with the store that keeps the positions of a Kafka source
/// whose URL says `?positions=store`: when every partition of the topic has a stored
/// position there, the source's own part of the horizon is zero
/// ([`Retention::PositionsStored`]); its dead letters still count. Without a store, or
/// for any other source, the same as [`redelivery_horizon`].
///
/// # Errors
/// As [`redelivery_horizon`]; the store cannot be read.
pub async fn redelivery_horizon_with(
    url: &BrokerUrl,
    name: &str,
    positions: Option<&dyn idem_core::PositionStore>,
) -> Result<RedeliveryHorizon, BrokerError> {
    let stored = match positions {
        #[cfg(feature = "kafka")]
        Some(store) if url.kind() == BrokerKind::Kafka => kafka_positions(url, name, store).await?,
        _ => None,
    };
    let (retention, detail) = match stored {
        Some(r) => r,
        None => retention_of(url, name).await?,
    };
    let dead_letter = dead_letter_name(name);
    let (retention, detail) = if name.ends_with(&dead_letter_name("")) {
        // Already a dead-letter place: nothing is dead-lettered from it.
        (retention, detail)
    } else {
        match retention_of(url, &dead_letter).await {
            Ok(dl) => longer((retention, detail), dl, &dead_letter),
            Err(BrokerError::InvalidName { .. }) => (
                retention,
                format!("{detail}; no dead-letter place {dead_letter:?}"),
            ),
            Err(e) => return Err(e),
        }
    };
    Ok(RedeliveryHorizon {
        broker: url.kind(),
        source: name.to_owned(),
        retention,
        detail,
    })
}

/// The longer of a source's retention and its dead-letter place's, with both details.
fn longer(
    source: (Retention, String),
    dead_letters: (Retention, String),
    dead_letter: &str,
) -> (Retention, String) {
    let bound = |r: &Retention| match *r {
        Retention::Limited(d) => Some(d),
        Retention::UntilRemoved { oldest } => Some(oldest.unwrap_or(Duration::ZERO)),
        Retention::PositionsStored { .. } => Some(Duration::ZERO),
        Retention::Unbounded | Retention::Unknown => None,
    };
    let dead_letters_win = match (bound(&source.0), bound(&dead_letters.0)) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(s), Some(d)) => d > s,
    };
    let (retention, which) = if dead_letters_win {
        (dead_letters.0, "its dead letters keep longer")
    } else {
        (source.0, "the source keeps as long or longer")
    };
    (
        retention,
        format!(
            "{which}: {}; dead letters in {dead_letter:?}: {}",
            source.1, dead_letters.1
        ),
    )
}

/// The retention of one place (source or dead-letter place) on the broker at `url`.
#[allow(unused_variables, unreachable_code)] // with no broker feature
async fn retention_of(url: &BrokerUrl, name: &str) -> Result<(Retention, String), BrokerError> {
    Ok(match url.kind() {
        #[cfg(feature = "sqs")]
        BrokerKind::Sqs => sqs(url, name).await?,
        #[cfg(feature = "nats")]
        BrokerKind::Nats => nats(url, name).await?,
        #[cfg(feature = "redis-streams")]
        BrokerKind::RedisStreams => redis(url, name).await?,
        #[cfg(feature = "kafka")]
        BrokerKind::Kafka => kafka(url, name).await?,
        #[cfg(feature = "rabbitmq")]
        BrokerKind::RabbitMq => rabbitmq(url, name).await?,
        #[allow(unreachable_patterns)]
        other => {
            return Err(BrokerError::Unsupported {
                scheme: other.feature().to_owned(),
                hint: format!("rebuild idem-broker with the {:?} feature", other.feature()),
            })
        }
    })
}

#[allow(dead_code)] // used by the broker features
fn missing(name: &str, what: &str) -> BrokerError {
    BrokerError::invalid_name(name, format!("no such {what}"))
}

#[allow(dead_code)] // used by the broker features
fn age_of_unix_millis(ms: i128) -> Duration {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i128);
    Duration::from_millis(u64::try_from((now - ms).max(0)).unwrap_or(u64::MAX))
}

#[cfg(feature = "sqs")]
async fn sqs(url: &BrokerUrl, name: &str) -> Result<(Retention, String), BrokerError> {
    use aws_sdk_sqs::types::QueueAttributeName;
    crate::sqs::check_name(name)?;
    // The adapter's own client: the URL's endpoint and region, the standard chains.
    let config = crate::sqs::SqsConfig::from_url(url, name)?;
    let client = crate::sqs::client_for(&config).await?;
    let q = crate::sqs::queue_name(name);
    let queue_url = match client.get_queue_url().queue_name(&q).send().await {
        Ok(out) => out.queue_url.ok_or_else(|| missing(name, "SQS queue"))?,
        Err(aws_sdk_sqs::error::SdkError::ServiceError(e)) if e.err().is_queue_does_not_exist() => {
            return Err(missing(name, "SQS queue"))
        }
        Err(
            e @ (aws_sdk_sqs::error::SdkError::DispatchFailure(_)
            | aws_sdk_sqs::error::SdkError::TimeoutError(_)),
        ) => {
            return Err(BrokerError::connect(
                crate::sqs::BROKER,
                aws_sdk_sqs::error::DisplayErrorContext(e).to_string(),
            ))
        }
        Err(e) => return Err(crate::sqs::op_err("GetQueueUrl", e)),
    };
    let out = client
        .get_queue_attributes()
        .queue_url(queue_url)
        .attribute_names(QueueAttributeName::MessageRetentionPeriod)
        .send()
        .await
        .map_err(|e| crate::sqs::op_err("GetQueueAttributes", e))?;
    let secs: u64 = out
        .attributes
        .unwrap_or_default()
        .get(&QueueAttributeName::MessageRetentionPeriod)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            BrokerError::op(
                crate::sqs::BROKER,
                "GetQueueAttributes",
                "no MessageRetentionPeriod in the reply".to_owned(),
            )
        })?;
    Ok((
        Retention::Limited(Duration::from_secs(secs)),
        format!("SQS MessageRetentionPeriod of queue {q:?} = {secs} s"),
    ))
}

#[cfg(feature = "nats")]
async fn nats(url: &BrokerUrl, name: &str) -> Result<(Retention, String), BrokerError> {
    crate::nats::check_name(name)?;
    let c = crate::nats::NatsConfig::from_url(url, name)?;
    let js = crate::nats::connect(&c.url).await?;
    let stream_name = crate::nats::stream_name(name);
    let mut stream = js
        .get_stream(&stream_name)
        .await
        .map_err(|e| match e.kind() {
            async_nats::jetstream::context::GetStreamErrorKind::JetStream(j)
                if j.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND =>
            {
                missing(name, "JetStream stream")
            }
            _ => BrokerError::op(crate::nats::BROKER, "stream info", e),
        })?;
    let info = stream
        .info()
        .await
        .map_err(|e| BrokerError::op(crate::nats::BROKER, "stream info", e))?;
    if !info.config.max_age.is_zero() {
        return Ok((
            Retention::Limited(info.config.max_age),
            format!(
                "JetStream max_age of stream {stream_name:?} = {} s",
                info.config.max_age.as_secs()
            ),
        ));
    }
    let oldest = (info.state.messages > 0).then(|| {
        let ts = info.state.first_timestamp;
        age_of_unix_millis(ts.unix_timestamp_nanos() / 1_000_000)
    });
    Ok(until_removed(
        oldest,
        &format!("JetStream stream {stream_name:?} has no max_age: messages stay until removed"),
        "its oldest message",
    ))
}

#[cfg(feature = "redis-streams")]
async fn redis(url: &BrokerUrl, name: &str) -> Result<(Retention, String), BrokerError> {
    use fred::prelude::*;
    crate::redis_streams::check_name(name)?;
    let c = crate::redis_streams::RedisStreamsConfig::from_url(url, name)?;
    let client = crate::redis_streams::connect(&c.url).await?;
    let broker = crate::redis_streams::BROKER;
    let kind: String = client
        .r#type(name)
        .await
        .map_err(|e| BrokerError::op(broker, "TYPE", e))?;
    if kind != "stream" {
        let _ = client.quit().await;
        return Err(missing(name, "Redis stream"));
    }
    let first: Value = client
        .xrange(name, "-", "+", Some(1))
        .await
        .map_err(|e| BrokerError::op(broker, "XRANGE", e))?;
    let _ = client.quit().await;
    let oldest = first_id_millis(&first).map(|ms| age_of_unix_millis(i128::from(ms)));
    Ok(until_removed(
        oldest,
        "a Redis stream keeps entries until trimmed (XTRIM / MAXLEN): unbounded unless trimmed",
        &format!("the oldest entry still in {name:?}"),
    ))
}

/// The retention of a log that keeps its messages until they are removed, `oldest` the
/// age of the oldest still there (`None`: it is empty), and what it is: `kept` (how it
/// keeps them), then that age, `oldest_is` naming the message.
#[cfg(any(feature = "nats", feature = "redis-streams"))]
fn until_removed(oldest: Option<Duration>, kept: &str, oldest_is: &str) -> (Retention, String) {
    let age = oldest.map_or_else(
        || "it is empty".to_owned(),
        |d| format!("{oldest_is} is {} old", human(d)),
    );
    (Retention::UntilRemoved { oldest }, format!("{kept}; {age}"))
}

/// The milliseconds part of the first entry id (`MS-SEQ`) of an XRANGE reply.
#[cfg(feature = "redis-streams")]
fn first_id_millis(v: &fred::types::Value) -> Option<u64> {
    use fred::types::Value;
    match v {
        Value::Array(items) => items.first().and_then(first_id_millis),
        Value::String(s) => s.split_once('-').and_then(|(ms, _)| ms.parse().ok()),
        Value::Bytes(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.split_once('-'))
            .and_then(|(ms, _)| ms.parse().ok()),
        _ => None,
    }
}

#[cfg(feature = "kafka")]
async fn kafka(url: &BrokerUrl, name: &str) -> Result<(Retention, String), BrokerError> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    crate::kafka::check_name(name)?;
    let c = crate::kafka::KafkaConfig::from_url(url, name)?;
    let broker = crate::kafka::BROKER;
    // The topic must exist (some brokers, tansu among them, describe a missing topic as
    // one without settings).
    let partitions = topic_partitions(&c, name).await?;
    if partitions == 0 {
        return Err(missing(name, "Kafka topic"));
    }
    let admin: AdminClient<DefaultClientContext> = c
        .client_config()
        .create()
        .map_err(|e| BrokerError::connect(broker, e))?;
    let results = admin
        .describe_configs(
            [&ResourceSpecifier::Topic(name)],
            &AdminOptions::new().request_timeout(Some(crate::kafka::REQUEST_TIMEOUT)),
        )
        .await
        .map_err(|e| BrokerError::op(broker, "DescribeConfigs", e))?;
    let resource = results
        .into_iter()
        .next()
        .ok_or_else(|| BrokerError::op(broker, "DescribeConfigs", "no reply".to_owned()))?
        .map_err(|code| match code {
            rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition => {
                missing(name, "Kafka topic")
            }
            other => BrokerError::op(broker, "DescribeConfigs", other),
        })?;
    let setting = |key: &str| -> Option<String> {
        resource
            .get(key)
            .and_then(|e| e.value.as_deref())
            .map(str::to_owned)
    };
    Ok(kafka_retention(
        name,
        setting("cleanup.policy").as_deref(),
        setting("retention.ms").as_deref(),
        setting("segment.ms").as_deref(),
    ))
}

/// The partitions of topic `name` as the cluster reports them, without creating it (0:
/// no such topic).
#[cfg(feature = "kafka")]
async fn topic_partitions(c: &crate::kafka::KafkaConfig, name: &str) -> Result<usize, BrokerError> {
    use rdkafka::consumer::BaseConsumer;
    let (mut meta_config, topic) = (c.client_config(), name.to_owned());
    crate::kafka::blocking(move || {
        let meta: BaseConsumer = meta_config
            .set("allow.auto.create.topics", "false")
            .create()
            .map_err(|e| BrokerError::connect(crate::kafka::BROKER, e))?;
        crate::kafka::partition_count(&meta, &topic)
    })
    .await?
}

/// [`Retention::PositionsStored`] when `url` keeps its group's positions in the store
/// and `store` holds one for every partition of topic `name`; `None` otherwise.
#[cfg(feature = "kafka")]
async fn kafka_positions(
    url: &BrokerUrl,
    name: &str,
    store: &dyn idem_core::PositionStore,
) -> Result<Option<(Retention, String)>, BrokerError> {
    let c = crate::kafka::KafkaConfig::from_url(url, name)?;
    if c.positions == crate::kafka::Positions::Broker {
        return Ok(None);
    }
    let source = c.position_source();
    let stored = store
        .positions(&source)
        .await
        .map_err(|e| BrokerError::op(crate::kafka::BROKER, "read the stored positions", e))?;
    let partitions = topic_partitions(&c, name).await?;
    let covered = |p: usize| {
        stored
            .iter()
            .any(|s| usize::try_from(s.partition) == Ok(p) && s.next.is_some())
    };
    if partitions == 0 || !(0..partitions).all(covered) {
        return Ok(None);
    }
    Ok(Some((
        Retention::PositionsStored { partitions },
        format!("positions of all {partitions} partitions stored as {source:?}"),
    )))
}

/// A Kafka topic's retention from its `cleanup.policy`, `retention.ms` and `segment.ms`
/// as the broker reports them (`None`: not reported).
#[cfg(feature = "kafka")]
fn kafka_retention(
    name: &str,
    cleanup_policy: Option<&str>,
    retention_ms: Option<&str>,
    segment_ms: Option<&str>,
) -> (Retention, String) {
    if let Some(policy) = cleanup_policy.filter(|p| p.split(',').any(|p| p.trim() == "compact")) {
        return (
            Retention::Unknown,
            format!(
                "Kafka cleanup.policy of topic {name:?} = {policy}: compaction keeps each key's last record for ever"
            ),
        );
    }
    let number = |v: Option<&str>| v.and_then(|v| v.trim().parse::<i64>().ok());
    let (Some(retention), Some(segment)) = (number(retention_ms), number(segment_ms)) else {
        return (
            Retention::Unknown,
            format!(
                "the broker reports no {} for topic {name:?} (set them on the topic to bound its horizon)",
                match (number(retention_ms), number(segment_ms)) {
                    (None, None) => "retention.ms and segment.ms",
                    (None, _) => "retention.ms",
                    _ => "segment.ms",
                }
            ),
        );
    };
    let Ok(retention) = u64::try_from(retention) else {
        return (
            Retention::Unbounded,
            format!("Kafka retention.ms of topic {name:?} = {retention}: kept for ever"),
        );
    };
    let segment = u64::try_from(segment).unwrap_or(0);
    (
        Retention::Limited(Duration::from_millis(retention.saturating_add(segment))),
        format!(
            "Kafka retention.ms + segment.ms of topic {name:?} = {retention} + {segment} ms (a segment is deleted once its newest record is past retention.ms, and takes records for up to segment.ms)"
        ),
    )
}

#[cfg(feature = "rabbitmq")]
async fn rabbitmq(url: &BrokerUrl, name: &str) -> Result<(Retention, String), BrokerError> {
    // The queue must exist (a typo must not pass for "unknown"); its TTL cannot be read.
    let connection = crate::rabbitmq::connect(url.client_url()).await?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| BrokerError::op("rabbitmq", "channel.open", e))?;
    let found = channel
        .queue_declare(
            name.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await;
    let _ = connection.close(200, "done".into()).await;
    match found {
        Ok(_) => Ok((
            Retention::Unknown,
            "RabbitMQ keeps a message until it is consumed unless a message TTL applies, and a queue's x-message-ttl (argument or policy) cannot be read over AMQP".to_owned(),
        )),
        Err(e) => {
            use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
            if matches!(e.kind(), lapin::ErrorKind::ProtocolError(p) if *p.kind() == AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND))
            {
                Err(missing(name, "RabbitMQ queue"))
            } else {
                Err(BrokerError::op("rabbitmq", "queue.declare (passive)", e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(retention: Retention) -> RedeliveryHorizon {
        RedeliveryHorizon {
            broker: BrokerKind::Sqs,
            source: "q".into(),
            retention,
            detail: "test".into(),
        }
    }

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn the_longest_horizon_plus_the_margin_bounds_the_cutoff() {
        let hs = [
            h(Retention::Limited(4 * DAY)),
            h(Retention::Limited(14 * DAY)),
        ];
        assert_eq!(check_cutoff(15 * DAY, &hs, DAY), Ok(14 * DAY));
        let e = check_cutoff(15 * DAY - Duration::from_secs(1), &hs, DAY).unwrap_err();
        assert!(matches!(e, HorizonError::InsideHorizon { .. }), "{e}");
        assert!(e.to_string().contains("15d"), "{e}");
        // Below the shorter one too.
        assert!(check_cutoff(3 * DAY, &hs, DAY).is_err());
        assert_eq!(check_cutoff(Duration::ZERO, &[], DAY), Ok(Duration::ZERO));
    }

    #[test]
    fn an_unbounded_or_unknown_source_refuses_every_cutoff() {
        for r in [Retention::Unbounded, Retention::Unknown] {
            let hs = [h(Retention::Limited(DAY)), h(r)];
            let e = check_cutoff(100 * 365 * DAY, &hs, DAY).unwrap_err();
            assert!(matches!(e, HorizonError::Unbounded(_)), "{e}");
        }
        // Kept until removed: the oldest message held bounds it; an empty source is 0.
        let hs = [h(Retention::UntilRemoved {
            oldest: Some(2 * DAY),
        })];
        assert!(check_cutoff(2 * DAY, &hs, DAY).is_err());
        assert_eq!(check_cutoff(3 * DAY, &hs, DAY), Ok(2 * DAY));
        let empty = [h(Retention::UntilRemoved { oldest: None })];
        assert_eq!(check_cutoff(DAY, &empty, DAY), Ok(Duration::ZERO));
    }

    #[cfg(feature = "kafka")]
    #[test]
    fn kafka_keeps_records_for_retention_plus_segment_and_compaction_for_ever() {
        let h = |p: Option<&str>, r: Option<&str>, s: Option<&str>| kafka_retention("t", p, r, s).0;
        let hour = 3_600_000.to_string();
        let day = 86_400_000.to_string();
        assert_eq!(
            h(Some("delete"), Some(&day), Some(&hour)),
            Retention::Limited(DAY + Duration::from_secs(3600))
        );
        assert_eq!(h(None, Some("-1"), Some(&hour)), Retention::Unbounded);
        for p in ["compact", "compact,delete", "delete, compact"] {
            assert_eq!(
                h(Some(p), Some(&day), Some(&hour)),
                Retention::Unknown,
                "{p}"
            );
        }
        // Not reported: nothing bounds it.
        assert_eq!(h(None, Some(&day), None), Retention::Unknown);
        assert_eq!(h(None, None, Some(&hour)), Retention::Unknown);
    }

    #[test]
    fn the_dead_letters_count_when_they_keep_longer() {
        let (r, d) = longer(
            (Retention::Limited(DAY), "s".into()),
            (Retention::Limited(14 * DAY), "d".into()),
            "q.dead-letter",
        );
        assert_eq!(r, Retention::Limited(14 * DAY));
        assert!(d.contains("dead letters keep longer"), "{d}");
        let (r, _) = longer(
            (Retention::Limited(4 * DAY), "s".into()),
            (Retention::UntilRemoved { oldest: None }, "d".into()),
            "q.dead-letter",
        );
        assert_eq!(r, Retention::Limited(4 * DAY));
        for unbounded in [Retention::Unbounded, Retention::Unknown] {
            let (r, _) = longer(
                (Retention::Limited(DAY), "s".into()),
                (unbounded, "d".into()),
                "q.dead-letter",
            );
            assert_eq!(r, unbounded);
            let (r, _) = longer(
                (unbounded, "s".into()),
                (Retention::Limited(DAY), "d".into()),
                "q.dead-letter",
            );
            assert_eq!(r, unbounded);
        }
    }

    #[test]
    fn durations_read_as_days_hours_minutes_seconds() {
        assert_eq!(human(Duration::ZERO), "0s");
        assert_eq!(human(4 * DAY), "4d");
        assert_eq!(
            human(Duration::from_secs(86_400 + 3600 + 61)),
            "1d 1h 1m 1s"
        );
    }
}
