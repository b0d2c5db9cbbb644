//! One entry point over every broker compiled into this build, so a command parses a URL
//! and dispatches once.
//!
//! | scheme | broker | feature |
//! |---|---|---|
//! | `amqp://`, `amqps://` | RabbitMQ | `rabbitmq` |
//! | `nats://`, `tls://` | NATS JetStream | `nats` |
//! | `redis://`, `rediss://` | Redis Streams | `redis-streams` |
//! | `sqs://` | Amazon SQS | `sqs` |
//! | `kafka://` | Kafka | `kafka` |
//!
//! Broker-specific settings ride in the URL's query and are removed before the URL is
//! handed to the client:
//!
//! - RabbitMQ: `queue_type` (`quorum`, the default, or `classic`), `delivery_limit` (a
//!   quorum queue's broker-side redelivery limit, default 20, `0` for none);
//! - NATS: `ack_wait` (a duration such as `30s`), `durable` (the consumer's name, default
//!   `idem`), `max_deliver` (the durable's redelivery limit, default 20, `-1` for none);
//! - Redis Streams: `group` (default `idem`), `consumer` (default: unique per process),
//!   `min_idle` (pending entries of a silent consumer are taken over after it, default
//!   `30s`), `block` (default `1s`), `forget_after` (idle consumers with nothing pending
//!   are removed from the group after it, default `1h`);
//! - SQS: `visibility_timeout` (default `30s`; kept extended while a delivery is
//!   unsettled), `wait` (the long poll, default `1s`), `retention` (of a source queue
//!   created here; default SQS's 4 days), `max_receive_count` (its redrive policy to
//!   `NAME.dead-letter`, default 10, the core's `max_attempts`). The endpoint is
//!   `http://HOST:PORT` when the URL has one (`sqs://127.0.0.1:5000`), else the usual AWS
//!   variables (`sqs://`);
//! - Kafka: `group` (default `idem`), `partitions` (of a topic created here, default 4),
//!   `session_timeout` (default `10s`), `batch_messages` (the producer's record-batch
//!   size; `1` for brokers that cannot fetch from inside a batch), `replication` (of a
//!   topic created here; default `min(3, brokers)`), `assignment` (`cooperative-sticky`,
//!   the default, or an eager `range`/`roundrobin`), `max_poll_interval` (default `5m`),
//!   `queued_kbytes` (librdkafka's prefetch bound, default 4096). The URL's authority is
//!   the bootstrap list (`kafka://host:port[,host:port]`).
//!
//! ```
//! use idem_broker::any::{BrokerKind, BrokerUrl};
//! let url = BrokerUrl::parse("nats://127.0.0.1:4222?ack_wait=5s")?;
//! assert_eq!(url.kind(), BrokerKind::Nats);
//! assert_eq!(url.param("ack_wait"), Some("5s"));
//! assert!(BrokerUrl::parse("ftp://queue").is_err());
//! # Ok::<(), idem_broker::BrokerError>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::Stream;
use idem_core::{
    AckError, AckProof, Acker, Delivery, Headers, OutboxEvent, PublishError, Publisher,
    RejectReason,
};

use crate::{parse_duration, BrokerError};

/// Which broker a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BrokerKind {
    /// `amqp://`: RabbitMQ.
    RabbitMq,
    /// `nats://`: NATS JetStream.
    Nats,
    /// `redis://`: Redis Streams.
    RedisStreams,
    /// `sqs://`: Amazon SQS.
    Sqs,
    /// `kafka://`: Kafka.
    Kafka,
}

impl BrokerKind {
    /// The cargo feature that compiles this broker's adapter.
    pub fn feature(self) -> &'static str {
        match self {
            Self::RabbitMq => "rabbitmq",
            Self::Nats => "nats",
            Self::RedisStreams => "redis-streams",
            Self::Sqs => "sqs",
            Self::Kafka => "kafka",
        }
    }

    /// Whether this build has the adapter.
    pub fn is_enabled(self) -> bool {
        match self {
            Self::RabbitMq => cfg!(feature = "rabbitmq"),
            Self::Nats => cfg!(feature = "nats"),
            Self::RedisStreams => cfg!(feature = "redis-streams"),
            Self::Sqs => cfg!(feature = "sqs"),
            Self::Kafka => cfg!(feature = "kafka"),
        }
    }

    fn params(self) -> &'static [&'static str] {
        match self {
            Self::RabbitMq => &["queue_type", "delivery_limit"],
            Self::Nats => &["ack_wait", "durable", "max_deliver"],
            Self::RedisStreams => &["group", "consumer", "min_idle", "block", "forget_after"],
            Self::Sqs => &[
                "visibility_timeout",
                "wait",
                "retention",
                "max_receive_count",
            ],
            Self::Kafka => &[
                "group",
                "partitions",
                "session_timeout",
                "batch_messages",
                "replication",
                "assignment",
                "max_poll_interval",
                "queued_kbytes",
            ],
        }
    }
}

impl fmt::Display for BrokerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::RabbitMq => "RabbitMQ",
            Self::Nats => "NATS JetStream",
            Self::RedisStreams => "Redis Streams",
            Self::Sqs => "SQS",
            Self::Kafka => "Kafka",
        })
    }
}

/// A parsed broker URL: which broker, the URL for its client, and idem's settings from
/// the query (see the module docs).
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrl {
    kind: BrokerKind,
    client_url: String,
    params: BTreeMap<String, String>,
}

impl fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BrokerUrl")
            .field("kind", &self.kind)
            .field("url", &crate::names::redact(&self.client_url))
            .field("params", &self.params)
            .finish()
    }
}

impl fmt::Display for BrokerUrl {
    /// The URL with its password masked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::names::redact(&self.client_url))
    }
}

impl BrokerUrl {
    /// Parses `url`.
    ///
    /// # Errors
    /// [`BrokerError::InvalidUrl`] for a malformed URL, an unknown scheme or a bad
    /// setting; [`BrokerError::Unsupported`] for a broker whose feature is not compiled
    /// in.
    pub fn parse(url: &str) -> Result<Self, BrokerError> {
        let mut parsed = url::Url::parse(url)
            .map_err(|e| BrokerError::InvalidUrl(format!("{}: {e}", crate::names::redact(url))))?;
        let kind = match parsed.scheme() {
            "amqp" | "amqps" => BrokerKind::RabbitMq,
            "nats" | "tls" => BrokerKind::Nats,
            "redis" | "rediss" => BrokerKind::RedisStreams,
            "sqs" => BrokerKind::Sqs,
            "kafka" => BrokerKind::Kafka,
            other => {
                return Err(BrokerError::InvalidUrl(format!(
                    "unknown scheme {other:?}: use amqp://, nats://, redis://, sqs:// or kafka://"
                )))
            }
        };
        if !kind.is_enabled() {
            return Err(BrokerError::Unsupported {
                scheme: parsed.scheme().to_owned(),
                hint: format!("rebuild idem-broker with the {:?} feature", kind.feature()),
            });
        }
        let mut params = BTreeMap::new();
        let mut rest: Vec<(String, String)> = Vec::new();
        for (k, v) in parsed.query_pairs() {
            if kind.params().contains(&k.as_ref()) {
                params.insert(k.into_owned(), v.into_owned());
            } else {
                rest.push((k.into_owned(), v.into_owned()));
            }
        }
        for key in [
            "ack_wait",
            "min_idle",
            "block",
            "forget_after",
            "visibility_timeout",
            "wait",
            "session_timeout",
            "retention",
            "max_poll_interval",
        ] {
            if let Some(v) = params.get(key) {
                parse_duration(v).map_err(|e| BrokerError::InvalidUrl(format!("{key}: {e}")))?;
            }
        }
        if let Some(n) = params.get("max_deliver") {
            n.parse::<i64>().map_err(|_| {
                BrokerError::InvalidUrl(format!("max_deliver {n:?} is not a number"))
            })?;
        }
        if kind == BrokerKind::RabbitMq {
            if let Some(t) = params.get("queue_type") {
                if !matches!(t.as_str(), "quorum" | "classic") {
                    return Err(BrokerError::InvalidUrl(format!(
                        "queue_type {t:?}: use quorum or classic"
                    )));
                }
            }
            if let Some(n) = params.get("delivery_limit") {
                n.parse::<u32>().map_err(|_| {
                    BrokerError::InvalidUrl(format!("delivery_limit {n:?} is not a number"))
                })?;
            }
        }
        if let Some(v) = params.get("max_receive_count") {
            if !v.parse::<u32>().is_ok_and(|n| (1..=1000).contains(&n)) {
                return Err(BrokerError::InvalidUrl(format!(
                    "max_receive_count: {v:?} is not a number from 1 to 1000"
                )));
            }
        }
        // Hand the client exactly what was written unless a setting has to come out
        // (an AMQP URL's trailing "/" or "%2f" names the vhost).
        let client_url = if params.is_empty() {
            url.to_owned()
        } else {
            if rest.is_empty() {
                parsed.set_query(None);
            } else {
                parsed.query_pairs_mut().clear().extend_pairs(rest);
            }
            parsed.to_string()
        };
        Ok(Self {
            kind,
            client_url,
            params,
        })
    }

    /// Which broker.
    pub fn kind(&self) -> BrokerKind {
        self.kind
    }

    /// The URL handed to the client (idem's settings removed). It may hold a password:
    /// print the `BrokerUrl` itself (`Display` masks it).
    pub fn client_url(&self) -> &str {
        &self.client_url
    }

    /// One of idem's settings from the query.
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params.get(key).map(String::as_str)
    }

    #[allow(dead_code)] // used by the broker features
    fn duration(&self, key: &str) -> Option<Duration> {
        self.param(key).and_then(|v| parse_duration(v).ok())
    }

    /// The RabbitMQ configuration for queue `name`.
    #[cfg(feature = "rabbitmq")]
    pub fn rabbitmq(&self, name: &str) -> crate::rabbitmq::RabbitConfig {
        let mut c = crate::rabbitmq::RabbitConfig::new(&self.client_url, name);
        if let Some(t) = self.param("queue_type").and_then(|t| t.parse().ok()) {
            c = c.with_queue_type(t);
        }
        if let Some(n) = self.param("delivery_limit").and_then(|n| n.parse().ok()) {
            c = c.with_delivery_limit(n);
        }
        c
    }

    /// The JetStream configuration for subject `name`.
    #[cfg(feature = "nats")]
    pub fn nats(&self, name: &str) -> crate::nats::NatsConfig {
        let mut c = crate::nats::NatsConfig::new(&self.client_url, name);
        if let Some(d) = self.duration("ack_wait") {
            c = c.with_ack_wait(d);
        }
        if let Some(d) = self.param("durable") {
            c = c.with_durable(d);
        }
        if let Some(n) = self.param("max_deliver").and_then(|n| n.parse().ok()) {
            c = c.with_max_deliver(n);
        }
        c
    }

    /// The Redis Streams configuration for stream `name`.
    #[cfg(feature = "redis-streams")]
    pub fn redis_streams(&self, name: &str) -> crate::redis_streams::RedisStreamsConfig {
        let mut c = crate::redis_streams::RedisStreamsConfig::new(&self.client_url, name);
        if let Some(g) = self.param("group") {
            c = c.with_group(g);
        }
        if let Some(n) = self.param("consumer") {
            c = c.with_consumer(n);
        }
        if let Some(d) = self.duration("min_idle") {
            c = c.with_min_idle(d);
        }
        if let Some(d) = self.duration("block") {
            c = c.with_block(d);
        }
        if let Some(d) = self.duration("forget_after") {
            c = c.with_forget_after(d);
        }
        c
    }

    /// The SQS configuration for queue `name`.
    #[cfg(feature = "sqs")]
    pub fn sqs(&self, name: &str) -> crate::sqs::SqsConfig {
        let mut c = crate::sqs::SqsConfig::new(self.sqs_endpoint(), name);
        if let Some(d) = self.duration("visibility_timeout") {
            c = c.with_visibility_timeout(d);
        }
        if let Some(d) = self.duration("wait") {
            c = c.with_wait(d);
        }
        if let Some(d) = self.duration("retention") {
            c = c.with_retention(d);
        }
        if let Some(n) = self.param("max_receive_count").and_then(|n| n.parse().ok()) {
            c = c.with_max_receive_count(n);
        }
        c
    }

    /// The SQS endpoint of an `sqs://HOST:PORT` URL (`http://HOST:PORT`), or `None` for
    /// the environment's.
    #[cfg(feature = "sqs")]
    pub fn sqs_endpoint(&self) -> Option<String> {
        let u = url::Url::parse(&self.client_url).ok()?;
        let host = u.host_str().filter(|h| !h.is_empty())?;
        Some(match u.port() {
            Some(p) => format!("http://{host}:{p}"),
            None => format!("http://{host}"),
        })
    }

    /// The Kafka configuration for topic `name`.
    ///
    /// # Errors
    /// [`BrokerError::InvalidUrl`] without a broker address or with a bad `partitions`.
    #[cfg(feature = "kafka")]
    pub fn kafka(&self, name: &str) -> Result<crate::kafka::KafkaConfig, BrokerError> {
        let mut c =
            crate::kafka::KafkaConfig::new(crate::kafka::brokers_of_url(&self.client_url)?, name);
        if let Some(g) = self.param("group") {
            c = c.with_group(g);
        }
        if let Some(p) = self.param("partitions") {
            let n: i32 = p.parse().map_err(|_| {
                BrokerError::InvalidUrl(format!("partitions: {p:?} is not a number"))
            })?;
            c = c.with_partitions(n);
        }
        if let Some(d) = self.duration("session_timeout") {
            c = c.with_session_timeout(d);
        }
        if let Some(b) = self.param("batch_messages") {
            let n: usize = b.parse().map_err(|_| {
                BrokerError::InvalidUrl(format!("batch_messages: {b:?} is not a number"))
            })?;
            c = c.with_batch_messages(n);
        }
        if let Some(r) = self.param("replication") {
            let n: i32 = r.parse().map_err(|_| {
                BrokerError::InvalidUrl(format!("replication: {r:?} is not a number"))
            })?;
            c = c.with_replication(n);
        }
        if let Some(a) = self.param("assignment") {
            c = c.with_assignment(a)?;
        }
        if let Some(d) = self.duration("max_poll_interval") {
            c = c.with_max_poll_interval(d);
        }
        if let Some(k) = self.param("queued_kbytes") {
            let n: u32 = k.parse().map_err(|_| {
                BrokerError::InvalidUrl(format!("queued_kbytes: {k:?} is not a number"))
            })?;
            c = c.with_queued_kbytes(n);
        }
        Ok(c)
    }
}

/// Deliveries from any compiled-in broker, as a stream of
/// `Result<Delivery<AnyAcker>, BrokerError>`.
pub struct AnyConsumer {
    inner: BoxStream<'static, Result<Delivery<AnyAcker>, BrokerError>>,
    kind: BrokerKind,
}

impl fmt::Debug for AnyConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnyConsumer")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

#[allow(dead_code)] // used by the broker features
fn wrap<S, A>(
    stream: S,
    f: fn(A) -> AnyAcker,
) -> BoxStream<'static, Result<Delivery<AnyAcker>, BrokerError>>
where
    S: Stream<Item = Result<Delivery<A>, BrokerError>> + Send + 'static,
    A: Acker,
{
    use futures::StreamExt;
    stream
        .map(move |r| {
            r.map(|d| Delivery {
                payload: d.payload,
                headers: d.headers,
                attempt: d.attempt,
                acker: f(d.acker),
            })
        })
        .boxed()
}

impl AnyConsumer {
    /// Connects to the broker of `url` and starts consuming `name` (created if missing),
    /// with up to `prefetch` unsettled deliveries on hand (for a consumer running
    /// `concurrency` batches of `batch_size`, `2 × concurrency × batch_size` keeps the
    /// next batches waiting).
    ///
    /// # Errors
    /// The broker cannot be reached; an invalid name.
    #[allow(unused_variables)] // with no broker feature
    pub async fn connect(
        url: &BrokerUrl,
        name: &str,
        prefetch: usize,
    ) -> Result<Self, BrokerError> {
        let inner = match url.kind {
            #[cfg(feature = "rabbitmq")]
            BrokerKind::RabbitMq => wrap(
                crate::rabbitmq::RabbitConsumer::connect(
                    &url.rabbitmq(name).with_prefetch(prefetch),
                )
                .await?,
                AnyAcker::RabbitMq,
            ),
            #[cfg(feature = "nats")]
            BrokerKind::Nats => wrap(
                crate::nats::NatsConsumer::connect(&url.nats(name).with_prefetch(prefetch)).await?,
                AnyAcker::Nats,
            ),
            #[cfg(feature = "redis-streams")]
            BrokerKind::RedisStreams => wrap(
                crate::redis_streams::RedisStreamsConsumer::connect(
                    &url.redis_streams(name).with_prefetch(prefetch),
                )
                .await?,
                AnyAcker::RedisStreams,
            ),
            #[cfg(feature = "sqs")]
            BrokerKind::Sqs => wrap(
                crate::sqs::SqsConsumer::connect(&url.sqs(name).with_prefetch(prefetch)).await?,
                AnyAcker::Sqs,
            ),
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => wrap(
                crate::kafka::KafkaConsumer::connect(&url.kafka(name)?.with_prefetch(prefetch))
                    .await?,
                AnyAcker::Kafka,
            ),
            #[allow(unreachable_patterns)]
            other => return Err(not_compiled(other)),
        };
        Ok(Self {
            inner,
            kind: url.kind,
        })
    }

    /// Which broker.
    pub fn kind(&self) -> BrokerKind {
        self.kind
    }
}

#[allow(dead_code)]
fn not_compiled(kind: BrokerKind) -> BrokerError {
    BrokerError::Unsupported {
        scheme: kind.to_string(),
        hint: format!("rebuild idem-broker with the {:?} feature", kind.feature()),
    }
}

impl Stream for AnyConsumer {
    type Item = Result<Delivery<AnyAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// The acker of an [`AnyConsumer`]'s deliveries: the broker's own, behind one type.
#[derive(Debug)]
#[non_exhaustive]
pub enum AnyAcker {
    /// See [`crate::rabbitmq::RabbitAcker`].
    #[cfg(feature = "rabbitmq")]
    RabbitMq(crate::rabbitmq::RabbitAcker),
    /// See [`crate::nats::NatsAcker`].
    #[cfg(feature = "nats")]
    Nats(crate::nats::NatsAcker),
    /// See [`crate::redis_streams::RedisStreamsAcker`].
    #[cfg(feature = "redis-streams")]
    RedisStreams(crate::redis_streams::RedisStreamsAcker),
    /// See [`crate::sqs::SqsAcker`].
    #[cfg(feature = "sqs")]
    Sqs(crate::sqs::SqsAcker),
    /// See [`crate::kafka::KafkaAcker`].
    #[cfg(feature = "kafka")]
    Kafka(crate::kafka::KafkaAcker),
}

impl AnyAcker {
    #[allow(dead_code)]
    fn slot(&self) -> usize {
        match *self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(_) => 0,
            #[cfg(feature = "nats")]
            Self::Nats(_) => 1,
            #[cfg(feature = "redis-streams")]
            Self::RedisStreams(_) => 2,
            #[cfg(feature = "sqs")]
            Self::Sqs(_) => 3,
            #[cfg(feature = "kafka")]
            Self::Kafka(_) => 4,
        }
    }
}

/// Acks `items` (all of one variant, unwrapped by `take`) with that broker's batch form.
#[allow(dead_code)]
async fn ack_group<A: Acker>(
    items: Vec<(AnyAcker, AckProof)>,
    take: fn(AnyAcker) -> Option<A>,
) -> Vec<Result<(), AckError>> {
    let mut inner = Vec::with_capacity(items.len());
    for (a, p) in items {
        match take(a) {
            Some(a) => inner.push((a, p)),
            None => {
                return vec![Err(AckError::new(
                    "mixed brokers in one ack batch",
                    false,
                    None,
                ))]
            }
        }
    }
    A::ack_all(inner).await
}

#[async_trait]
impl Acker for AnyAcker {
    async fn ack(self, proof: AckProof) -> Result<(), AckError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(a) => a.ack(proof).await,
            #[cfg(feature = "nats")]
            Self::Nats(a) => a.ack(proof).await,
            #[cfg(feature = "redis-streams")]
            Self::RedisStreams(a) => a.ack(proof).await,
            #[cfg(feature = "sqs")]
            Self::Sqs(a) => a.ack(proof).await,
            #[cfg(feature = "kafka")]
            Self::Kafka(a) => a.ack(proof).await,
        }
    }

    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(a) => a.nack(delay).await,
            #[cfg(feature = "nats")]
            Self::Nats(a) => a.nack(delay).await,
            #[cfg(feature = "redis-streams")]
            Self::RedisStreams(a) => a.nack(delay).await,
            #[cfg(feature = "sqs")]
            Self::Sqs(a) => a.nack(delay).await,
            #[cfg(feature = "kafka")]
            Self::Kafka(a) => a.nack(delay).await,
        }
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(a) => a.dead_letter(payload, headers, reason).await,
            #[cfg(feature = "nats")]
            Self::Nats(a) => a.dead_letter(payload, headers, reason).await,
            #[cfg(feature = "redis-streams")]
            Self::RedisStreams(a) => a.dead_letter(payload, headers, reason).await,
            #[cfg(feature = "sqs")]
            Self::Sqs(a) => a.dead_letter(payload, headers, reason).await,
            #[cfg(feature = "kafka")]
            Self::Kafka(a) => a.dead_letter(payload, headers, reason).await,
        }
    }

    /// Groups the batch by broker and uses each broker's batch ack, keeping the order of
    /// the results.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        let n = items.len();
        let mut groups: [Vec<(usize, Self, AckProof)>; 5] = Default::default();
        for (i, (a, p)) in items.into_iter().enumerate() {
            groups[a.slot()].push((i, a, p));
        }
        let mut out: Vec<Option<Result<(), AckError>>> = (0..n).map(|_| None).collect();
        for (slot, group) in groups.into_iter().enumerate() {
            if group.is_empty() {
                continue;
            }
            let (idx, batch): (Vec<usize>, Vec<(Self, AckProof)>) =
                group.into_iter().map(|(i, a, p)| (i, (a, p))).unzip();
            let results = match slot {
                #[cfg(feature = "rabbitmq")]
                0 => {
                    ack_group(batch, |a| match a {
                        Self::RabbitMq(a) => Some(a),
                        #[allow(unreachable_patterns)]
                        _ => None,
                    })
                    .await
                }
                #[cfg(feature = "nats")]
                1 => {
                    ack_group(batch, |a| match a {
                        Self::Nats(a) => Some(a),
                        #[allow(unreachable_patterns)]
                        _ => None,
                    })
                    .await
                }
                #[cfg(feature = "redis-streams")]
                2 => {
                    ack_group(batch, |a| match a {
                        Self::RedisStreams(a) => Some(a),
                        #[allow(unreachable_patterns)]
                        _ => None,
                    })
                    .await
                }
                #[cfg(feature = "sqs")]
                3 => {
                    ack_group(batch, |a| match a {
                        Self::Sqs(a) => Some(a),
                        #[allow(unreachable_patterns)]
                        _ => None,
                    })
                    .await
                }
                #[cfg(feature = "kafka")]
                4 => {
                    ack_group(batch, |a| match a {
                        Self::Kafka(a) => Some(a),
                        #[allow(unreachable_patterns)]
                        _ => None,
                    })
                    .await
                }
                _ => {
                    drop(batch);
                    Vec::new()
                }
            };
            for (i, r) in idx.into_iter().zip(results) {
                out[i] = Some(r);
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(AckError::new("ack result missing", false, None))))
            .collect()
    }
}

/// A publisher to any compiled-in broker (for the relay and `idem publish`).
#[derive(Debug)]
#[non_exhaustive]
pub enum AnyPublisher {
    /// See [`crate::rabbitmq::RabbitPublisher`].
    #[cfg(feature = "rabbitmq")]
    RabbitMq(crate::rabbitmq::RabbitPublisher),
    /// See [`crate::nats::NatsPublisher`].
    #[cfg(feature = "nats")]
    Nats(crate::nats::NatsPublisher),
    /// See [`crate::redis_streams::RedisStreamsPublisher`].
    #[cfg(feature = "redis-streams")]
    RedisStreams(crate::redis_streams::RedisStreamsPublisher),
    /// See [`crate::sqs::SqsPublisher`].
    #[cfg(feature = "sqs")]
    Sqs(crate::sqs::SqsPublisher),
    /// See [`crate::kafka::KafkaPublisher`].
    #[cfg(feature = "kafka")]
    Kafka(crate::kafka::KafkaPublisher),
}

impl AnyPublisher {
    /// Connects to the broker of `url` for publishing to `name` (created if missing).
    ///
    /// # Errors
    /// The broker cannot be reached; an invalid name.
    #[allow(unused_variables)] // with no broker feature
    pub async fn connect(url: &BrokerUrl, name: &str) -> Result<Self, BrokerError> {
        match url.kind {
            #[cfg(feature = "rabbitmq")]
            BrokerKind::RabbitMq => Ok(Self::RabbitMq(
                crate::rabbitmq::RabbitPublisher::connect_with(&url.rabbitmq(name)).await?,
            )),
            #[cfg(feature = "nats")]
            BrokerKind::Nats => Ok(Self::Nats(
                crate::nats::NatsPublisher::connect(&url.client_url, name).await?,
            )),
            #[cfg(feature = "redis-streams")]
            BrokerKind::RedisStreams => Ok(Self::RedisStreams(
                crate::redis_streams::RedisStreamsPublisher::connect(&url.client_url, name).await?,
            )),
            #[cfg(feature = "sqs")]
            BrokerKind::Sqs => Ok(Self::Sqs(
                crate::sqs::SqsPublisher::connect_config(&url.sqs(name)).await?,
            )),
            #[cfg(feature = "kafka")]
            BrokerKind::Kafka => Ok(Self::Kafka(
                crate::kafka::KafkaPublisher::connect_config(&url.kafka(name)?).await?,
            )),
            #[allow(unreachable_patterns)]
            other => Err(not_compiled(other)),
        }
    }

    /// Publishes each body as it is, durably, in order, waiting for the broker's
    /// confirmation. Equal bodies stay separate messages.
    ///
    /// # Errors
    /// A failed or unconfirmed publish; bodies before it may have been published.
    #[allow(unused_variables)] // with no broker feature
    pub async fn publish_raw(&self, bodies: &[Vec<u8>]) -> Result<(), BrokerError> {
        self.publish_raw_with_headers(bodies, &[]).await
    }

    /// As [`publish_raw`](Self::publish_raw), each message with `headers` (AMQP
    /// headers, NATS headers, Redis stream fields, SQS string attributes, Kafka
    /// headers), for example a W3C `traceparent`.
    ///
    /// # Errors
    /// As [`publish_raw`](Self::publish_raw).
    #[allow(unused_variables)] // with no broker feature
    pub async fn publish_raw_with_headers(
        &self,
        bodies: &[Vec<u8>],
        headers: &[(String, String)],
    ) -> Result<(), BrokerError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(p) => p.publish_raw_with_headers(bodies, headers).await,
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.publish_raw_with_headers(bodies, headers).await,
            #[cfg(feature = "redis-streams")]
            Self::RedisStreams(p) => p.publish_raw_with_headers(bodies, headers).await,
            #[cfg(feature = "sqs")]
            Self::Sqs(p) => p.publish_raw_with_headers(bodies, headers).await,
            #[cfg(feature = "kafka")]
            Self::Kafka(p) => p.publish_raw_with_headers(bodies, headers).await,
        }
    }
}

#[async_trait]
impl Publisher for AnyPublisher {
    #[allow(unused_variables)] // with no broker feature
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        match self {
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(p) => p.publish(events).await,
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.publish(events).await,
            #[cfg(feature = "redis-streams")]
            Self::RedisStreams(p) => p.publish(events).await,
            #[cfg(feature = "sqs")]
            Self::Sqs(p) => p.publish(events).await,
            #[cfg(feature = "kafka")]
            Self::Kafka(p) => p.publish(events).await,
        }
    }
}

/// Publishes each body to `name` as it is (see [`AnyPublisher::publish_raw`]).
///
/// # Errors
/// As [`AnyPublisher::connect`] and [`AnyPublisher::publish_raw`].
pub async fn publish_raw(
    url: &BrokerUrl,
    name: &str,
    bodies: &[Vec<u8>],
) -> Result<(), BrokerError> {
    AnyPublisher::connect(url, name)
        .await?
        .publish_raw(bodies)
        .await
}

/// What is left to settle in `name`, for tests and scripts:
///
/// - RabbitMQ: ready messages (unacked ones count again once their channel closes);
/// - NATS: the durable consumer's pending plus ack-pending messages;
/// - Redis Streams: the group's lag plus its pending entries;
/// - SQS: visible, in-flight and delayed messages (approximate, as SQS reports them);
/// - Kafka: the group's lag (high watermark minus committed offset) over all partitions.
///
/// # Errors
/// The broker cannot be reached.
#[allow(unused_variables)] // with no broker feature
pub async fn pending_count(url: &BrokerUrl, name: &str) -> Result<u64, BrokerError> {
    match url.kind {
        #[cfg(feature = "rabbitmq")]
        BrokerKind::RabbitMq => crate::rabbitmq::pending_count(&url.client_url, name).await,
        #[cfg(feature = "nats")]
        BrokerKind::Nats => {
            let c = url.nats(name);
            crate::nats::pending_count(&c.url, name, &c.durable).await
        }
        #[cfg(feature = "redis-streams")]
        BrokerKind::RedisStreams => {
            let c = url.redis_streams(name);
            crate::redis_streams::pending_count(&c.url, name, &c.group).await
        }
        #[cfg(feature = "sqs")]
        BrokerKind::Sqs => crate::sqs::pending_count(url.sqs_endpoint().as_deref(), name).await,
        #[cfg(feature = "kafka")]
        BrokerKind::Kafka => {
            let c = url.kafka(name)?;
            crate::kafka::pending_count(&c.brokers, name, &c.group).await
        }
        #[allow(unreachable_patterns)]
        other => Err(not_compiled(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brokers_not_compiled_in_say_so() {
        for (u, on) in [
            ("sqs://q", cfg!(feature = "sqs")),
            ("kafka://127.0.0.1:9092", cfg!(feature = "kafka")),
        ] {
            match BrokerUrl::parse(u) {
                Ok(_) => assert!(on, "{u} parsed without its feature"),
                Err(e) => {
                    assert!(!on, "{u}: {e}");
                    assert!(matches!(e, BrokerError::Unsupported { .. }), "{e}");
                    assert!(e.to_string().contains("not supported in this build"), "{e}");
                }
            }
        }
        assert!(matches!(
            BrokerUrl::parse("ftp://x"),
            Err(BrokerError::InvalidUrl(_))
        ));
        assert!(matches!(
            BrokerUrl::parse("not a url"),
            Err(BrokerError::InvalidUrl(_))
        ));
    }

    #[cfg(feature = "redis-streams")]
    #[test]
    fn redis_settings_leave_the_client_url() {
        let u = BrokerUrl::parse("redis://127.0.0.1:6379/0?min_idle=500ms&group=g").unwrap();
        assert_eq!(u.kind(), BrokerKind::RedisStreams);
        assert_eq!(u.client_url(), "redis://127.0.0.1:6379/0");
        let c = u.redis_streams("s");
        assert_eq!(c.group, "g");
        assert_eq!(c.min_idle, Duration::from_millis(500));
        assert!(BrokerUrl::parse("redis://127.0.0.1?min_idle=soon").is_err());
    }

    #[cfg(feature = "nats")]
    #[test]
    fn nats_settings() {
        let u = BrokerUrl::parse("nats://127.0.0.1:4222?ack_wait=2s&durable=d").unwrap();
        assert_eq!(u.client_url(), "nats://127.0.0.1:4222");
        let c = u.nats("grants");
        assert_eq!(c.ack_wait, Duration::from_secs(2));
        assert_eq!(c.durable, "d");
    }

    #[cfg(feature = "rabbitmq")]
    #[test]
    fn amqp_urls_pass_through_and_passwords_are_masked() {
        let u = BrokerUrl::parse("amqp://guest:secret@127.0.0.1:5672/%2f").unwrap();
        assert_eq!(u.kind(), BrokerKind::RabbitMq);
        assert_eq!(u.client_url(), "amqp://guest:secret@127.0.0.1:5672/%2f");
        assert!(!u.to_string().contains("secret"));
        assert!(!format!("{u:?}").contains("secret"));
        let bare = BrokerUrl::parse("amqp://127.0.0.1:5672").unwrap();
        assert_eq!(bare.client_url(), "amqp://127.0.0.1:5672");
    }

    #[cfg(feature = "rabbitmq")]
    #[test]
    fn rabbitmq_settings() {
        use crate::rabbitmq::QueueType;
        let d = BrokerUrl::parse("amqp://127.0.0.1:5672/%2f")
            .unwrap()
            .rabbitmq("q");
        assert_eq!((d.queue_type, d.delivery_limit), (QueueType::Quorum, 20));
        let u = BrokerUrl::parse("amqp://127.0.0.1:5672/%2f?queue_type=classic&delivery_limit=0")
            .unwrap();
        assert_eq!(u.client_url(), "amqp://127.0.0.1:5672/%2f");
        let c = u.rabbitmq("q");
        assert_eq!((c.queue_type, c.delivery_limit), (QueueType::Classic, 0));
        assert!(BrokerUrl::parse("amqp://127.0.0.1?queue_type=stream").is_err());
        assert!(BrokerUrl::parse("amqp://127.0.0.1?delivery_limit=many").is_err());
    }

    #[cfg(feature = "sqs")]
    #[test]
    fn sqs_settings_and_endpoint() {
        let u = BrokerUrl::parse("sqs://127.0.0.1:5000?visibility_timeout=2s&wait=0s").unwrap();
        assert_eq!(u.kind(), BrokerKind::Sqs);
        assert_eq!(u.sqs_endpoint().as_deref(), Some("http://127.0.0.1:5000"));
        let c = u.sqs("grants");
        assert_eq!(c.visibility_timeout, Duration::from_secs(2));
        assert_eq!(c.wait, Duration::ZERO);
        assert_eq!(BrokerUrl::parse("sqs://").unwrap().sqs_endpoint(), None);
        assert!(BrokerUrl::parse("sqs://?wait=soon").is_err());
    }

    #[cfg(feature = "kafka")]
    #[test]
    fn kafka_settings() {
        let u = BrokerUrl::parse("kafka://127.0.0.1:9092?group=g&partitions=2&session_timeout=6s")
            .unwrap();
        assert_eq!(u.kind(), BrokerKind::Kafka);
        let c = u.kafka("t").unwrap();
        assert_eq!(c.brokers, "127.0.0.1:9092");
        assert_eq!(c.group, "g");
        assert_eq!(c.partitions, 2);
        assert_eq!(c.session_timeout, Duration::from_secs(6));
        let bad = BrokerUrl::parse("kafka://127.0.0.1:9092?partitions=many").unwrap();
        assert!(bad.kafka("t").is_err());
    }
}
