//! How to reach a Kafka topic, and its URL settings.

use std::time::Duration;

use idem_core::PositionStore;
use rdkafka::config::ClientConfig;

use crate::any::{BrokerKind, BrokerUrl};
use crate::setting::{self, duration_in, number_in};
use crate::BrokerError;

/// A keyword setting's names, each written once, for `NAMES` (what [`keyword`] reads),
/// `as_str` (librdkafka's name of the `$what`) and `FromStr` (that name, in any case).
macro_rules! keywords {
    ($ty:ident, $what:literal: $($variant:ident => $name:literal),+ $(,)?) => {
        impl $ty {
            const NAMES: &'static [(&'static str, Self)] = &[$(($name, Self::$variant)),+];

            #[doc = concat!("librdkafka's name of the ", $what, ".")]
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                }
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;

            #[doc = concat!("librdkafka's name of the ", $what, ", in any case.")]
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                keyword(s, Self::NAMES)
            }
        }
    };
}

mod security;
#[cfg(test)]
mod tests;
mod url;

pub use security::{EndpointIdentification, KafkaSecurity, SaslMechanism, SecurityProtocol};
use url::security_of_url;

/// How a group's partitions move between members on a rebalance
/// (`partition.assignment.strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Assignment {
    /// `cooperative-sticky`: only the partitions that move are revoked; the others keep
    /// being consumed through the rebalance (the default).
    CooperativeSticky,
    /// `range`: eager; every partition is revoked and reassigned.
    Range,
    /// `roundrobin`: eager.
    RoundRobin,
}

impl std::str::FromStr for Assignment {
    type Err = String;

    /// librdkafka's name of the strategy.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cooperative-sticky" => Ok(Self::CooperativeSticky),
            "range" => Ok(Self::Range),
            "roundrobin" => Ok(Self::RoundRobin),
            other => Err(format!(
                "{other:?} is not cooperative-sticky, range or roundrobin"
            )),
        }
    }
}

impl Assignment {
    /// librdkafka's name of the strategy.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CooperativeSticky => "cooperative-sticky",
            Self::Range => "range",
            Self::RoundRobin => "roundrobin",
        }
    }
}

/// Reads a keyword setting: one of `names` (compared without regard to case), else the
/// reason naming them all.
fn keyword<T: Copy>(s: &str, names: &[(&str, T)]) -> Result<T, String> {
    names
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(s))
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let all: Vec<&str> = names.iter().map(|(n, _)| *n).collect();
            format!("{s:?} is not {}", all.join(", "))
        })
}

/// How the producer compresses its record batches (librdkafka's `compression.type`).
/// The consumer reads every one of them whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Compression {
    /// `none`.
    None,
    /// `gzip`.
    Gzip,
    /// `lz4`.
    Lz4,
    /// `snappy`.
    Snappy,
    /// `zstd`.
    Zstd,
}

keywords!(Compression, "codec":
    None => "none",
    Gzip => "gzip",
    Lz4 => "lz4",
    Snappy => "snappy",
    Zstd => "zstd",
);

/// A Kafka topic and how to consume it.
///
/// [`from_url`](Self::from_url) reads a `kafka://` or `kafkas://` URL: its authority is
/// the bootstrap list (`kafka://host:port[,host:port…]`), optionally after a SASL
/// `user:password@`, and idem's settings ride in its query
/// (`kafka://127.0.0.1:9092?group=billing&partitions=8`); durations are
/// [durations](crate::parse_duration):
///
/// | parameter | default | value |
/// |---|---|---|
/// | `group` | `idem` | the consumer group: not empty |
/// | `partitions` | `4` | partitions of a topic created here, at least 1 |
/// | `replication` | `min(3, brokers)` | the replication factor of a topic created here, `1` to `32767` |
/// | `session_timeout` | `10s` | `1s` to `1h`: a silent member's partitions go to the others after it |
/// | `max_poll_interval` | `5m` | `max.poll.interval.ms`, at least `session_timeout` and at most `24h` |
/// | `assignment` | `cooperative-sticky` | the rebalance strategy ([`Assignment`]): `cooperative-sticky`, `range` or `roundrobin` |
/// | `batch_messages` | librdkafka's | the producer's record-batch size, `1` to `1000000` (`1` for brokers that cannot fetch from inside a batch, such as tansu) |
/// | `queued_kbytes` | `4096` | librdkafka's prefetch bound `queued.max.messages.kbytes`, `1` to `2097151` |
/// | `compression.type` | `none` | the producer's codec ([`Compression`]): `none`, `gzip`, `lz4`, `snappy` or `zstd` (the consumer reads them all) |
/// | `positions` | `broker` | where the group's positions are kept ([`Positions`]): `broker` (committed offsets) or `store` (in each claim's transaction, fenced) |
/// | `positions_gap` | `refuse` | with `positions=store`, a stored position behind the log's start (and the group's offset too: records deleted unprocessed): `refuse` ends the stream naming the partition, `accept` goes on from the log's start |
///
/// How the clients reach the brokers ([`KafkaSecurity`]; librdkafka's names, each handed
/// to the consumer, the producers and the metadata and admin clients alike):
///
/// | parameter | default | value |
/// |---|---|---|
/// | `security.protocol` | `plaintext` on `kafka://`, `ssl` on `kafkas://` (`sasl_ssl` with credentials) | `plaintext`, `ssl`, `sasl_plaintext` or `sasl_ssl` ([`SecurityProtocol`]); `kafkas://` takes only the last two of TLS |
/// | `sasl.mechanism` | `PLAIN` | `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512` ([`SaslMechanism`]), with a SASL protocol |
/// | `sasl.username`, `sasl.password` | the URL's `user:password@` | needed by a SASL protocol, refused by the others |
/// | `ssl.ca.location` | the system's CAs | a PEM file of the CAs that sign the brokers' certificates |
/// | `ssl.certificate.location`, `ssl.key.location` | none | a client certificate and its key (PEM), given together |
/// | `ssl.key.password` | none | the passphrase of an encrypted key |
/// | `ssl.endpoint.identification.algorithm` | `https` | `https` (the certificate must name the host) or `none` |
///
/// The `ssl.` settings need a TLS protocol. Credentials on `kafka://` without a
/// `security.protocol` are refused rather than sent over plain TCP: use `kafkas://`, or
/// say `sasl_plaintext`. Passwords are shown as `***` in `Debug` and in errors.
///
/// rdkafka reads no query parameters: any other is an error.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// The bootstrap servers, `host:port[,host:port…]`.
    pub brokers: String,
    /// The topic `NAME`.
    pub name: String,
    /// The consumer group (default `idem`).
    pub group: String,
    /// Partitions of a topic this adapter creates (default 4).
    pub partitions: i32,
    /// How long the group waits for a silent member before its partitions go to the
    /// others (default 10 s).
    pub session_timeout: Duration,
    /// How long connecting waits for the group to assign partitions (default 30 s).
    pub join_timeout: Duration,
    /// The most messages the producer puts in one record batch (`batch.num.messages`;
    /// `None`: librdkafka's default). `1` works around brokers that cannot fetch from an
    /// offset inside a batch (tansu 0.6 resumes at the next batch, skipping the rest of
    /// the one a committed offset points into).
    pub batch_messages: Option<usize>,
    /// The replication factor of a topic this adapter creates (dead-letter topic too);
    /// `None` (the default): `min(3, brokers in the cluster)`.
    pub replication: Option<i32>,
    /// The rebalance strategy (default [`Assignment::CooperativeSticky`]).
    pub assignment: Assignment,
    /// `max.poll.interval.ms` (default 5 min). The consumer polls librdkafka from a task
    /// of its own, pausing its partitions once `prefetch` deliveries have waited a tenth
    /// of it (at most 1 s), so a slow handler never makes the member miss this interval
    /// and leave the group.
    pub max_poll_interval: Duration,
    /// The most deliveries waiting in the consumer, fetched and not yet taken (also
    /// librdkafka's `queued.min.messages`, floored at 1000); default 100.
    pub prefetch: usize,
    /// librdkafka's `queued.max.messages.kbytes`: the most kilobytes prefetched into
    /// its local queue (default 4096; librdkafka's own default is 64 MiB).
    pub queued_kbytes: u32,
    /// TLS and SASL, for every client of the adapter (default: plain TCP).
    pub security: KafkaSecurity,
    /// The producer's `compression.type` (`None`: librdkafka's default, `none`).
    pub compression: Option<Compression>,
    /// librdkafka properties of the application's own, set on every client's base
    /// configuration ([`with_client_setting`](Self::with_client_setting)): anything the
    /// URL has no setting for (`sasl.oauthbearer.*`, `ssl.engine.*`, `socket.*`,
    /// `statistics.interval.ms`). Values of secret-looking names are hidden in `Debug`.
    pub client_settings: Vec<(String, String)>,
    /// Where the group's positions are kept (`?positions=store` or `broker`, the
    /// default): see [`Positions`].
    pub positions: Positions,
    /// With positions stored: go on from the log's start when a partition's stored
    /// position is behind it and the group's committed offset is too — the offsets
    /// between were deleted by the topic's retention before anyone processed them
    /// (`?positions_gap=accept`; default `refuse`: the stream ends with
    /// [`BrokerError::Config`](crate::BrokerError::Config) naming the partition).
    pub accept_position_gap: bool,
}

/// Where a consumer's positions in its partitions are kept.
///
/// - [`Positions::Broker`] (the default): the group's committed offsets, committed after
///   the database commit; a new owner of a partition reads again everything since the
///   last of them (each a duplicate the gate skips).
/// - [`Positions::Store`]: in the claim store, in each claim's transaction
///   ([`idem_core::position`]): a new owner starts exactly after what the store holds,
///   and a member that lost a partition cannot commit for it any more (fenced). The
///   group's offsets are still committed, for lag monitoring. `?positions=store` asks
///   for it; the store itself is given with
///   [`with_position_store`](KafkaConfig::with_position_store) (`idem consume` gives its
///   `--store`), and connecting without one is an error.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Positions {
    /// In the group's committed offsets.
    #[default]
    Broker,
    /// In the claim store; `None` until a store is given.
    Store(Option<PositionHandle>),
}

/// A shared [`PositionStore`]: equal to another handle of the same store.
#[derive(Clone)]
pub struct PositionHandle(pub std::sync::Arc<dyn PositionStore>);

impl PartialEq for PositionHandle {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for PositionHandle {}

impl std::fmt::Debug for PositionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PositionHandle").field(&self.0).finish()
    }
}

impl std::str::FromStr for Positions {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "broker" => Ok(Self::Broker),
            "store" => Ok(Self::Store(None)),
            _ => Err("`broker` or `store`".to_owned()),
        }
    }
}

impl std::fmt::Debug for KafkaConfig {
    /// The bootstrap list with any secret hidden ([`idem_core::redact_url`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConfig")
            .field("brokers", &idem_core::Redacted(&self.brokers))
            .field("name", &self.name)
            .field("group", &self.group)
            .field("partitions", &self.partitions)
            .field("session_timeout", &self.session_timeout)
            .field("join_timeout", &self.join_timeout)
            .field("batch_messages", &self.batch_messages)
            .field("replication", &self.replication)
            .field("assignment", &self.assignment)
            .field("max_poll_interval", &self.max_poll_interval)
            .field("prefetch", &self.prefetch)
            .field("queued_kbytes", &self.queued_kbytes)
            .field("security", &self.security)
            .field("compression", &self.compression)
            .field("positions", &self.positions)
            .field("accept_position_gap", &self.accept_position_gap)
            .field(
                "client_settings",
                &self
                    .client_settings
                    .iter()
                    .map(|(k, v)| {
                        let shown = if idem_core::redact::is_secret_param(k) {
                            idem_core::redact::MASK
                        } else {
                            v.as_str()
                        };
                        (k.as_str(), shown)
                    })
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl KafkaConfig {
    /// idem's settings in the URL query (the table above).
    pub(crate) const URL_SETTINGS: &'static [&'static str] = &[
        "group",
        "positions",
        "positions_gap",
        "partitions",
        "replication",
        "session_timeout",
        "max_poll_interval",
        "assignment",
        "batch_messages",
        "queued_kbytes",
        "compression.type",
        "security.protocol",
        "sasl.mechanism",
        "sasl.username",
        "sasl.password",
        "ssl.ca.location",
        "ssl.certificate.location",
        "ssl.key.location",
        "ssl.key.password",
        "ssl.endpoint.identification.algorithm",
    ];

    /// The configuration of topic `name` at `url`, with the URL's bootstrap list and
    /// settings (the table above) over the defaults of [`new`](Self::new).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_broker::any::BrokerUrl;
    /// use idem_broker::kafka::KafkaConfig;
    /// let url = BrokerUrl::parse("kafka://127.0.0.1:9092?group=g&session_timeout=6s")?;
    /// let c = KafkaConfig::from_url(&url, "grants")?;
    /// assert_eq!((c.brokers.as_str(), c.group.as_str()), ("127.0.0.1:9092", "g"));
    /// assert_eq!(c.session_timeout, Duration::from_secs(6));
    /// # Ok::<(), idem_broker::BrokerError>(())
    /// ```
    ///
    /// # Errors
    /// [`BrokerError::InvalidParam`] naming a bad setting; [`BrokerError::InvalidUrl`]
    /// without a broker address, or for another broker's URL.
    pub fn from_url(url: &BrokerUrl, name: impl Into<String>) -> Result<Self, BrokerError> {
        url.expect_kind(BrokerKind::Kafka)?;
        let mut c = Self::new(super::brokers_of_url(url.client_url())?, name);
        let secs = Duration::from_secs;
        if let Some(g) = url.setting("group", setting::name)? {
            c.group = g;
        }
        if let Some(n) = url.setting("partitions", number_in(1..=i32::MAX))? {
            c.partitions = n;
        }
        if let Some(n) = url.setting("replication", number_in(1..=i32::from(i16::MAX)))? {
            c.replication = Some(n);
        }
        if let Some(d) = url.setting("session_timeout", duration_in(secs(1)..=secs(3_600)))? {
            c.session_timeout = d;
        }
        if let Some(d) = url.setting("max_poll_interval", duration_in(secs(1)..=secs(86_400)))? {
            c.max_poll_interval = d;
        }
        if c.max_poll_interval < c.session_timeout {
            return Err(BrokerError::InvalidParam {
                param: "max_poll_interval".to_owned(),
                value: url
                    .param("max_poll_interval")
                    .unwrap_or("5m (its default)")
                    .to_owned(),
                reason: format!(
                    "must be at least session_timeout ({})",
                    crate::show_duration(c.session_timeout)
                ),
            });
        }
        if let Some(a) = url.setting("assignment", str::parse)? {
            c.assignment = a;
        }
        if let Some(n) = url.setting("batch_messages", number_in(1..=1_000_000))? {
            c.batch_messages = Some(n);
        }
        if let Some(n) = url.setting("queued_kbytes", number_in(1..=2_097_151))? {
            c.queued_kbytes = n;
        }
        c.compression = url.setting("compression.type", str::parse)?;
        if let Some(p) = url.setting("positions", str::parse)? {
            c.positions = p;
        }
        if let Some(a) = url.setting("positions_gap", |v| match v {
            "refuse" => Ok(false),
            "accept" => Ok(true),
            _ => Err("`refuse` or `accept`".to_owned()),
        })? {
            c.accept_position_gap = a;
        }
        c.security = security_of_url(url)?;
        Ok(c)
    }

    /// A configuration with the defaults above.
    pub fn new(brokers: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            name: name.into(),
            group: "idem".to_owned(),
            partitions: 4,
            session_timeout: Duration::from_secs(10),
            join_timeout: Duration::from_secs(30),
            batch_messages: None,
            replication: None,
            assignment: Assignment::CooperativeSticky,
            max_poll_interval: Duration::from_secs(300),
            prefetch: 100,
            queued_kbytes: 4096,
            security: KafkaSecurity::default(),
            compression: None,
            client_settings: Vec::new(),
            positions: Positions::Broker,
            accept_position_gap: false,
        }
    }

    /// Sets how the clients reach the brokers (TLS, SASL).
    #[must_use]
    pub fn with_security(mut self, security: KafkaSecurity) -> Self {
        self.security = security;
        self
    }

    /// Keeps the group's positions in `store`, in each claim's transaction
    /// ([`Positions::Store`]); the store must be the one the gate claims in.
    #[must_use]
    pub fn with_position_store(mut self, store: std::sync::Arc<dyn PositionStore>) -> Self {
        self.positions = Positions::Store(Some(PositionHandle(store)));
        self
    }

    /// The source name positions are kept under: `kafka/GROUP/TOPIC`.
    pub fn position_source(&self) -> String {
        format!("kafka/{}/{}", self.group, self.name)
    }

    /// Sets the producer's `compression.type`.
    #[must_use]
    pub fn with_compression(mut self, compression: Compression) -> Self {
        self.compression = Some(compression);
        self
    }

    /// Sets librdkafka property `key` to `value` on every client of the adapter (the
    /// consumer, the producers, the metadata and admin clients), over the base that
    /// [`client_config`](Self::client_config) builds (the client id, timeouts, TLS and
    /// SASL). The properties that exactly-once rests on are still set by idem after it,
    /// whatever is given here: the consumer's `group.id`, `enable.auto.commit=false`,
    /// `enable.auto.offset.store=false`, and the producers' `enable.idempotence` and
    /// `acks=all`.
    ///
    /// ```
    /// use idem_broker::kafka::KafkaConfig;
    /// let c = KafkaConfig::new("h:9092", "grants")
    ///     .with_client_setting("statistics.interval.ms", "60000")
    ///     .with_client_setting("client.id", "grants-consumer")
    ///     .with_client_setting("enable.auto.commit", "true");
    /// assert_eq!(c.client_config().get("client.id"), Some("grants-consumer"));
    /// assert_eq!(c.producer_config().get("statistics.interval.ms"), Some("60000"));
    /// // Never before the commit of its effect: idem's setting stays.
    /// assert_eq!(c.consumer_config().get("enable.auto.commit"), Some("false"));
    /// ```
    #[must_use]
    pub fn with_client_setting(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.client_settings.push((key.into(), value.into()));
        self
    }

    /// The librdkafka configuration every client of the adapter starts from: the
    /// bootstrap list, [`security`](Self::security), the client id and timeouts, the
    /// debug contexts of [`DEBUG_ENV`](super::DEBUG_ENV), and last the
    /// [`client_settings`](Self::client_settings). Metadata and admin clients use it as
    /// it is.
    ///
    /// ```
    /// use idem_broker::any::BrokerUrl;
    /// use idem_broker::kafka::KafkaConfig;
    /// let url = BrokerUrl::parse("kafkas://u:p@h:9093?sasl.mechanism=SCRAM-SHA-512")?;
    /// let c = KafkaConfig::from_url(&url, "grants")?.client_config();
    /// assert_eq!(c.get("bootstrap.servers"), Some("h:9093"));
    /// assert_eq!(c.get("security.protocol"), Some("sasl_ssl"));
    /// assert_eq!(c.get("sasl.mechanism"), Some("SCRAM-SHA-512"));
    /// assert_eq!(c.get("sasl.username"), Some("u"));
    /// # Ok::<(), idem_broker::BrokerError>(())
    /// ```
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("client.id", "idem")
            .set("socket.timeout.ms", "10000")
            .set("log_level", "3");
        self.security.apply(&mut c);
        if let Some(d) = super::debug_contexts() {
            c.set("debug", d)
                .set("log_level", "7")
                .set_log_level(rdkafka::config::RDKafkaLogLevel::Debug);
        }
        for (k, v) in &self.client_settings {
            c.set(k, v);
        }
        c
    }

    /// The producers' configuration (the relay's publisher and the consumer's
    /// dead-letter producer): [`client_config`](Self::client_config) with the
    /// idempotent producer (`enable.idempotence`, `acks=all`),
    /// [`batch_messages`](Self::batch_messages) and [`compression`](Self::compression).
    pub fn producer_config(&self) -> ClientConfig {
        let mut c = self.client_config();
        if let Some(n) = self.batch_messages {
            c.set("batch.num.messages", n.max(1).to_string());
        }
        if let Some(z) = self.compression {
            c.set("compression.type", z.as_str());
        }
        c.set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "2")
            .set("message.timeout.ms", "30000");
        c
    }

    /// The group consumer's configuration: [`client_config`](Self::client_config) with
    /// the group, manual commits and the settings above.
    pub fn consumer_config(&self) -> ClientConfig {
        let session = self.session_timeout.as_millis().max(1_000);
        let poll_interval = self.max_poll_interval.as_millis().max(session);
        let mut c = self.client_config();
        c.set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false")
            .set("fetch.wait.max.ms", "500")
            .set("session.timeout.ms", session.to_string())
            .set("heartbeat.interval.ms", (session / 4).max(250).to_string())
            .set("max.poll.interval.ms", poll_interval.to_string())
            .set("partition.assignment.strategy", self.assignment.as_str())
            .set("queued.min.messages", self.prefetch.max(1000).to_string())
            .set("queued.max.messages.kbytes", self.queued_kbytes.to_string());
        c
    }

    /// Sets the replication factor of created topics (at least 1).
    #[must_use]
    pub fn with_replication(mut self, n: i32) -> Self {
        self.replication = Some(n.max(1));
        self
    }

    /// Sets the rebalance strategy by its librdkafka name.
    ///
    /// # Errors
    /// [`BrokerError::InvalidParam`] (parameter `assignment`) for an unknown name.
    pub fn with_assignment(mut self, name: &str) -> Result<Self, BrokerError> {
        self.assignment = name.parse().map_err(|reason| BrokerError::InvalidParam {
            param: "assignment".to_owned(),
            value: name.to_owned(),
            reason,
        })?;
        Ok(self)
    }

    /// Sets `max.poll.interval.ms` (at least the session timeout, as librdkafka requires).
    #[must_use]
    pub fn with_max_poll_interval(mut self, d: Duration) -> Self {
        self.max_poll_interval = d.max(self.session_timeout);
        self
    }

    /// Sets the prefetch (at least 1).
    #[must_use]
    pub fn with_prefetch(mut self, n: usize) -> Self {
        self.prefetch = n.max(1);
        self
    }

    /// Sets `queued.max.messages.kbytes` (at least 1).
    #[must_use]
    pub fn with_queued_kbytes(mut self, n: u32) -> Self {
        self.queued_kbytes = n.max(1);
        self
    }

    /// Sets the group.
    #[must_use]
    pub fn with_group(mut self, group: impl Into<String>) -> Self {
        self.group = group.into();
        self
    }

    /// Sets the partitions of a created topic (at least 1).
    #[must_use]
    pub fn with_partitions(mut self, partitions: i32) -> Self {
        self.partitions = partitions.max(1);
        self
    }

    /// Sets the session timeout (at least 1 s).
    #[must_use]
    pub fn with_session_timeout(mut self, d: Duration) -> Self {
        self.session_timeout = d.max(Duration::from_secs(1));
        self
    }

    /// Sets the producer's record-batch size in messages (at least 1).
    #[must_use]
    pub fn with_batch_messages(mut self, n: usize) -> Self {
        self.batch_messages = Some(n.max(1));
        self
    }

    /// Sets how long connecting waits for an assignment.
    #[must_use]
    pub fn with_join_timeout(mut self, d: Duration) -> Self {
        self.join_timeout = d;
        self
    }
}
