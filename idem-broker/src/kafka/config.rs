//! How to reach a Kafka topic, and its URL settings.

use std::time::Duration;

use idem_core::PositionStore;
use rdkafka::config::ClientConfig;

use crate::any::{BrokerKind, BrokerUrl};
use crate::setting::{self, duration_in, number_in};
use crate::BrokerError;

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

/// How the clients talk to the brokers (librdkafka's `security.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SecurityProtocol {
    /// `plaintext`: no TLS, no authentication (the default of `kafka://`).
    #[default]
    Plaintext,
    /// `ssl`: TLS (the default of `kafkas://`), with a client certificate if given.
    Ssl,
    /// `sasl_plaintext`: SASL authentication over plain TCP: the credentials (and, with
    /// `PLAIN`, the password itself) cross the network unencrypted.
    SaslPlaintext,
    /// `sasl_ssl`: SASL authentication over TLS.
    SaslSsl,
}

impl SecurityProtocol {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("plaintext", Self::Plaintext),
        ("ssl", Self::Ssl),
        ("sasl_plaintext", Self::SaslPlaintext),
        ("sasl_ssl", Self::SaslSsl),
    ];

    /// librdkafka's name of the protocol.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plaintext => "plaintext",
            Self::Ssl => "ssl",
            Self::SaslPlaintext => "sasl_plaintext",
            Self::SaslSsl => "sasl_ssl",
        }
    }

    /// Whether the connection is TLS.
    pub fn is_tls(self) -> bool {
        matches!(self, Self::Ssl | Self::SaslSsl)
    }

    /// Whether the client authenticates with SASL.
    pub fn is_sasl(self) -> bool {
        matches!(self, Self::SaslPlaintext | Self::SaslSsl)
    }
}

impl std::str::FromStr for SecurityProtocol {
    type Err = String;

    /// librdkafka's name of the protocol, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        keyword(s, Self::NAMES)
    }
}

/// The SASL mechanism (librdkafka's `sasl.mechanism`). GSSAPI (Kerberos) and
/// OAUTHBEARER are not offered: this build of librdkafka has no Cyrus SASL, and idem
/// has no token source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SaslMechanism {
    /// `PLAIN`: the password itself is sent (use it over TLS only).
    #[default]
    Plain,
    /// `SCRAM-SHA-256`.
    ScramSha256,
    /// `SCRAM-SHA-512`.
    ScramSha512,
}

impl SaslMechanism {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("PLAIN", Self::Plain),
        ("SCRAM-SHA-256", Self::ScramSha256),
        ("SCRAM-SHA-512", Self::ScramSha512),
    ];

    /// librdkafka's name of the mechanism.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Plain => "PLAIN",
            Self::ScramSha256 => "SCRAM-SHA-256",
            Self::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

impl std::str::FromStr for SaslMechanism {
    type Err = String;

    /// librdkafka's name of the mechanism, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        keyword(s, Self::NAMES)
    }
}

/// Whether the client checks that the broker's certificate names the host it dialled
/// (librdkafka's `ssl.endpoint.identification.algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EndpointIdentification {
    /// `https`: the certificate must name the host (librdkafka's default).
    Https,
    /// `none`: any certificate the CA signed is taken, whatever host it names.
    None,
}

impl EndpointIdentification {
    const NAMES: &'static [(&'static str, Self)] = &[("https", Self::Https), ("none", Self::None)];

    /// librdkafka's name of the check.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Https => "https",
            Self::None => "none",
        }
    }
}

impl std::str::FromStr for EndpointIdentification {
    type Err = String;

    /// `https` or `none`, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        keyword(s, Self::NAMES)
    }
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

impl Compression {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("none", Self::None),
        ("gzip", Self::Gzip),
        ("lz4", Self::Lz4),
        ("snappy", Self::Snappy),
        ("zstd", Self::Zstd),
    ];

    /// librdkafka's name of the codec.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Gzip => "gzip",
            Self::Lz4 => "lz4",
            Self::Snappy => "snappy",
            Self::Zstd => "zstd",
        }
    }
}

impl std::str::FromStr for Compression {
    type Err = String;

    /// librdkafka's name of the codec, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        keyword(s, Self::NAMES)
    }
}

/// How every client of the adapter (consumer, producers, metadata and admin clients)
/// reaches the brokers: TLS and SASL. The default is plain TCP without authentication.
///
/// `Debug` shows the passwords as `***`.
#[derive(Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct KafkaSecurity {
    /// `security.protocol`.
    pub protocol: SecurityProtocol,
    /// `sasl.mechanism`, used with a SASL protocol.
    pub sasl_mechanism: SaslMechanism,
    /// `sasl.username`.
    pub sasl_username: Option<String>,
    /// `sasl.password`.
    pub sasl_password: Option<String>,
    /// `ssl.ca.location`: a PEM file (or directory) of the CAs the broker's certificate
    /// must chain to; without it, the system's.
    pub ssl_ca_location: Option<String>,
    /// `ssl.certificate.location`: the client's certificate (PEM), for brokers that
    /// require one.
    pub ssl_certificate_location: Option<String>,
    /// `ssl.key.location`: the client certificate's private key (PEM).
    pub ssl_key_location: Option<String>,
    /// `ssl.key.password`: the passphrase of an encrypted `ssl.key.location`.
    pub ssl_key_password: Option<String>,
    /// `ssl.endpoint.identification.algorithm` (`None`: librdkafka's default, `https`).
    pub ssl_endpoint_identification: Option<EndpointIdentification>,
}

impl std::fmt::Debug for KafkaSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mask = |s: &Option<String>| s.as_ref().map(|_| idem_core::redact::MASK);
        f.debug_struct("KafkaSecurity")
            .field("protocol", &self.protocol)
            .field("sasl_mechanism", &self.sasl_mechanism)
            .field("sasl_username", &self.sasl_username)
            .field("sasl_password", &mask(&self.sasl_password))
            .field("ssl_ca_location", &self.ssl_ca_location)
            .field("ssl_certificate_location", &self.ssl_certificate_location)
            .field("ssl_key_location", &self.ssl_key_location)
            .field("ssl_key_password", &mask(&self.ssl_key_password))
            .field(
                "ssl_endpoint_identification",
                &self.ssl_endpoint_identification,
            )
            .finish()
    }
}

impl KafkaSecurity {
    /// TLS with the system's CAs (`security.protocol=ssl`).
    pub fn ssl() -> Self {
        Self {
            protocol: SecurityProtocol::Ssl,
            ..Self::default()
        }
    }

    /// SASL with `mechanism`, `username` and `password`, over TLS when `tls`
    /// (`sasl_ssl`), else over plain TCP (`sasl_plaintext`).
    pub fn sasl(
        tls: bool,
        mechanism: SaslMechanism,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        Self {
            protocol: if tls {
                SecurityProtocol::SaslSsl
            } else {
                SecurityProtocol::SaslPlaintext
            },
            sasl_mechanism: mechanism,
            sasl_username: Some(username.into()),
            sasl_password: Some(password.into()),
            ..Self::default()
        }
    }

    /// Sets `ssl.ca.location`.
    #[must_use]
    pub fn with_ca_location(mut self, path: impl Into<String>) -> Self {
        self.ssl_ca_location = Some(path.into());
        self
    }

    /// Sets the client certificate and its key (`ssl.certificate.location`,
    /// `ssl.key.location`), and the key's passphrase if it has one.
    #[must_use]
    pub fn with_client_certificate(
        mut self,
        certificate: impl Into<String>,
        key: impl Into<String>,
        key_password: Option<String>,
    ) -> Self {
        self.ssl_certificate_location = Some(certificate.into());
        self.ssl_key_location = Some(key.into());
        self.ssl_key_password = key_password;
        self
    }

    /// Sets `ssl.endpoint.identification.algorithm`.
    #[must_use]
    pub fn with_endpoint_identification(mut self, check: EndpointIdentification) -> Self {
        self.ssl_endpoint_identification = Some(check);
        self
    }

    /// Puts these settings into a librdkafka configuration, under librdkafka's names.
    /// The SASL settings go in only with a SASL protocol, the `ssl.` ones only with TLS.
    pub fn apply(&self, c: &mut ClientConfig) {
        c.set("security.protocol", self.protocol.as_str());
        if self.protocol.is_sasl() {
            c.set("sasl.mechanism", self.sasl_mechanism.as_str());
            for (key, value) in [
                ("sasl.username", &self.sasl_username),
                ("sasl.password", &self.sasl_password),
            ] {
                if let Some(v) = value {
                    c.set(key, v);
                }
            }
        }
        if self.protocol.is_tls() {
            for (key, value) in [
                ("ssl.ca.location", &self.ssl_ca_location),
                ("ssl.certificate.location", &self.ssl_certificate_location),
                ("ssl.key.location", &self.ssl_key_location),
                ("ssl.key.password", &self.ssl_key_password),
            ] {
                if let Some(v) = value {
                    c.set(key, v);
                }
            }
            if let Some(e) = self.ssl_endpoint_identification {
                c.set("ssl.endpoint.identification.algorithm", e.as_str());
            }
        }
    }
}

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
                    humantime::format_duration(c.session_timeout)
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

/// A refused setting; a secret's value is never kept, so neither `Display` nor `Debug`
/// of the error can show it.
fn refuse(param: &str, value: &str, reason: impl Into<String>) -> BrokerError {
    BrokerError::InvalidParam {
        param: param.to_owned(),
        value: if idem_core::redact::is_secret_param(param) {
            idem_core::redact::MASK.to_owned()
        } else {
            value.to_owned()
        },
        reason: reason.into(),
    }
}

/// A setting that must not be empty.
fn not_empty(s: &str) -> Result<String, String> {
    if s.is_empty() {
        Err("must not be empty".to_owned())
    } else {
        Ok(s.to_owned())
    }
}

/// `%XX` escapes decoded (a userinfo's user and password).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| char::from(c).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The user and password of a URL's `user:password@` (decoded; an empty one is none).
fn userinfo(url: &str) -> (Option<String>, Option<String>) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let Some((info, _)) = authority.rsplit_once('@') else {
        return (None, None);
    };
    let (user, password) = match info.split_once(':') {
        Some((u, p)) => (u, Some(p)),
        None => (info, None),
    };
    let some = |s: &str| Some(percent_decode(s)).filter(|s| !s.is_empty());
    (some(user), password.and_then(some))
}

/// The TLS and SASL settings of a `kafka://` or `kafkas://` URL (the second table of
/// [`KafkaConfig`]), checked against each other.
fn security_of_url(url: &BrokerUrl) -> Result<KafkaSecurity, BrokerError> {
    let client = url.client_url();
    let tls_scheme = client
        .get(.."kafkas://".len())
        .is_some_and(|s| s.eq_ignore_ascii_case("kafkas://"));
    let given: Option<SecurityProtocol> = url.setting("security.protocol", str::parse)?;
    let mechanism: Option<SaslMechanism> = url.setting("sasl.mechanism", str::parse)?;
    let (info_user, info_password) = userinfo(client);
    let mut username = url.setting("sasl.username", not_empty)?;
    let mut password = url.setting("sasl.password", not_empty)?;
    for (param, from_info, from_query) in [
        ("sasl.username", info_user, &mut username),
        ("sasl.password", info_password, &mut password),
    ] {
        if let Some(v) = from_info {
            if let Some(q) = from_query {
                return Err(refuse(
                    param,
                    q,
                    "given twice: in the URL's user:password@ and as a parameter",
                ));
            }
            *from_query = Some(v);
        }
    }
    let mut s = KafkaSecurity {
        sasl_mechanism: mechanism.unwrap_or_default(),
        sasl_username: username,
        sasl_password: password,
        ssl_ca_location: url.setting("ssl.ca.location", not_empty)?,
        ssl_certificate_location: url.setting("ssl.certificate.location", not_empty)?,
        ssl_key_location: url.setting("ssl.key.location", not_empty)?,
        ssl_key_password: url.setting("ssl.key.password", not_empty)?,
        ssl_endpoint_identification: url
            .setting("ssl.endpoint.identification.algorithm", str::parse)?,
        ..KafkaSecurity::default()
    };
    // The first SASL and the first TLS setting given, by name and value as shown.
    let sasl_given = [
        ("sasl.mechanism", mechanism.map(SaslMechanism::as_str)),
        ("sasl.username", s.sasl_username.as_deref()),
        ("sasl.password", s.sasl_password.as_deref()),
    ]
    .into_iter()
    .find_map(|(k, v)| v.map(|v| (k, v)));
    let endpoint = s
        .ssl_endpoint_identification
        .map(EndpointIdentification::as_str);
    let ssl_given = [
        ("ssl.ca.location", s.ssl_ca_location.as_deref()),
        (
            "ssl.certificate.location",
            s.ssl_certificate_location.as_deref(),
        ),
        ("ssl.key.location", s.ssl_key_location.as_deref()),
        ("ssl.key.password", s.ssl_key_password.as_deref()),
        ("ssl.endpoint.identification.algorithm", endpoint),
    ]
    .into_iter()
    .find_map(|(k, v)| v.map(|v| (k, v)));
    s.protocol = match given {
        Some(p) if tls_scheme && !p.is_tls() => {
            return Err(refuse(
                "security.protocol",
                p.as_str(),
                "kafkas:// is TLS: ssl or sasl_ssl (or a kafka:// URL)",
            ))
        }
        Some(p) => p,
        None if tls_scheme && sasl_given.is_some() => SecurityProtocol::SaslSsl,
        None if tls_scheme => SecurityProtocol::Ssl,
        None if sasl_given.is_some() => {
            return Err(refuse(
                "security.protocol",
                "plaintext (the default of kafka://)",
                "SASL credentials are given: use kafkas:// or security.protocol=sasl_ssl, \
                 or security.protocol=sasl_plaintext to send them over plain TCP",
            ))
        }
        None => SecurityProtocol::Plaintext,
    };
    let p = s.protocol.as_str();
    if let Some((k, v)) = sasl_given.filter(|_| !s.protocol.is_sasl()) {
        return Err(refuse(
            k,
            v,
            format!("needs security.protocol sasl_plaintext or sasl_ssl, not {p}"),
        ));
    }
    if let Some((k, v)) = ssl_given.filter(|_| !s.protocol.is_tls()) {
        return Err(refuse(
            k,
            v,
            format!("needs security.protocol ssl or sasl_ssl (or kafkas://), not {p}"),
        ));
    }
    if s.protocol.is_sasl() {
        let m = s.sasl_mechanism.as_str();
        if s.sasl_username.is_none() {
            return Err(refuse(
                "sasl.username",
                "",
                format!("{p} with {m} needs a user: sasl.username, or user:password@ in the URL"),
            ));
        }
        if s.sasl_password.is_none() {
            return Err(refuse(
                "sasl.password",
                "",
                format!(
                    "{p} with {m} needs a password: sasl.password, or user:password@ in the URL"
                ),
            ));
        }
    }
    match (&s.ssl_certificate_location, &s.ssl_key_location) {
        (Some(c), None) => {
            return Err(refuse(
                "ssl.certificate.location",
                c,
                "a client certificate needs its key: ssl.key.location",
            ))
        }
        (None, Some(k)) => {
            return Err(refuse(
                "ssl.key.location",
                k,
                "a client key needs its certificate: ssl.certificate.location",
            ))
        }
        _ => {}
    }
    if s.ssl_key_password.is_some() && s.ssl_key_location.is_none() {
        return Err(refuse(
            "ssl.key.password",
            "",
            "a key passphrase needs the key: ssl.key.location",
        ));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(query: &str) -> Result<KafkaConfig, BrokerError> {
        KafkaConfig::from_url(&BrokerUrl::parse(&format!("kafka://h:9092{query}"))?, "t")
    }

    #[test]
    fn defaults_and_every_setting() {
        let d = read("").unwrap();
        assert_eq!((d.brokers.as_str(), d.name.as_str()), ("h:9092", "t"));
        assert_eq!(d.group, "idem");
        assert_eq!(d.partitions, 4);
        assert_eq!(d.replication, None);
        assert_eq!(d.session_timeout, Duration::from_secs(10));
        assert_eq!(d.max_poll_interval, Duration::from_secs(300));
        assert_eq!(d.assignment, Assignment::CooperativeSticky);
        assert_eq!(d.batch_messages, None);
        assert_eq!(d.queued_kbytes, 4096);
        let c = read(
            "?group=g&partitions=2&replication=3&session_timeout=6s&max_poll_interval=1m\
             &assignment=range&batch_messages=1&queued_kbytes=512",
        )
        .unwrap();
        assert_eq!(c.group, "g");
        assert_eq!(c.partitions, 2);
        assert_eq!(c.replication, Some(3));
        assert_eq!(c.session_timeout, Duration::from_secs(6));
        assert_eq!(c.max_poll_interval, Duration::from_secs(60));
        assert_eq!(c.assignment, Assignment::Range);
        assert_eq!(c.batch_messages, Some(1));
        assert_eq!(c.queued_kbytes, 512);
        assert_eq!(
            read("?assignment=roundrobin").unwrap().assignment,
            Assignment::RoundRobin
        );
        assert_eq!(
            read("?assignment=cooperative-sticky").unwrap().assignment,
            Assignment::CooperativeSticky
        );
    }

    #[test]
    fn bad_values_name_their_parameter() {
        for (query, param, reason) in [
            ("?group=", "group", "not be empty"),
            ("?partitions=many", "partitions", "whole number from 1"),
            ("?partitions=0", "partitions", "whole number from 1"),
            ("?replication=0", "replication", "from 1 to 32767"),
            ("?session_timeout=500ms", "session_timeout", "from 1s to 1h"),
            (
                "?session_timeout=soon",
                "session_timeout",
                "invalid duration",
            ),
            ("?max_poll_interval=2d", "max_poll_interval", "to 1day"),
            (
                "?max_poll_interval=5s",
                "max_poll_interval",
                "at least session_timeout (10s)",
            ),
            (
                "?session_timeout=30m",
                "max_poll_interval",
                "at least session_timeout (30m)",
            ),
            (
                "?assignment=sticky",
                "assignment",
                "cooperative-sticky, range or roundrobin",
            ),
            ("?batch_messages=0", "batch_messages", "from 1 to 1000000"),
            ("?queued_kbytes=0", "queued_kbytes", "from 1 to 2097151"),
            ("?group=a&group=b", "group", "more than once"),
            ("?acks=all", "acks", "unknown parameter"),
        ] {
            crate::setting::assert_refused(read(query), query, param, reason);
        }
        assert!(matches!(
            BrokerUrl::parse("kafka://"),
            Err(BrokerError::InvalidUrl(_))
        ));
        assert!(matches!(
            KafkaConfig::new("h:9092", "t").with_assignment("sticky"),
            Err(BrokerError::InvalidParam { .. })
        ));
    }

    /// The configuration of `url` for topic `t`.
    fn of(url: &str) -> Result<KafkaConfig, BrokerError> {
        KafkaConfig::from_url(&BrokerUrl::parse(url)?, "t")
    }

    /// Every client the adapter makes: metadata/admin, producer, consumer.
    fn every_client(c: &KafkaConfig) -> [(&'static str, ClientConfig); 3] {
        [
            ("client", c.client_config()),
            ("producer", c.producer_config()),
            ("consumer", c.consumer_config()),
        ]
    }

    #[test]
    fn every_security_setting_reaches_every_client_as_asked() {
        let c = of("kafka://b1:9093,b2:9093?security.protocol=sasl_ssl\
                    &sasl.mechanism=SCRAM-SHA-256&sasl.username=idem&sasl.password=s%26cret\
                    &ssl.ca.location=/etc/idem/ca.pem&ssl.certificate.location=/etc/idem/c.pem\
                    &ssl.key.location=/etc/idem/c.key&ssl.key.password=k3y\
                    &ssl.endpoint.identification.algorithm=none&group=g")
        .unwrap();
        assert_eq!(c.brokers, "b1:9093,b2:9093");
        for (what, cc) in every_client(&c) {
            for (key, value) in [
                ("bootstrap.servers", "b1:9093,b2:9093"),
                ("security.protocol", "sasl_ssl"),
                ("sasl.mechanism", "SCRAM-SHA-256"),
                ("sasl.username", "idem"),
                ("sasl.password", "s&cret"),
                ("ssl.ca.location", "/etc/idem/ca.pem"),
                ("ssl.certificate.location", "/etc/idem/c.pem"),
                ("ssl.key.location", "/etc/idem/c.key"),
                ("ssl.key.password", "k3y"),
                ("ssl.endpoint.identification.algorithm", "none"),
            ] {
                assert_eq!(cc.get(key), Some(value), "{what}: {key}");
            }
        }
        // the consumer keeps its own settings; the producer its own
        assert_eq!(c.consumer_config().get("group.id"), Some("g"));
        assert_eq!(c.producer_config().get("acks"), Some("all"));
        assert_eq!(c.producer_config().get("compression.type"), None);
        // the librdkafka clients take every one of them (nothing connects here)
        let producer: Result<rdkafka::producer::BaseProducer, _> =
            of("kafka://127.0.0.1:1?security.protocol=sasl_plaintext\
             &sasl.mechanism=SCRAM-SHA-512&sasl.username=u&sasl.password=p")
            .unwrap()
            .producer_config()
            .create();
        assert!(producer.is_ok(), "{:?}", producer.err());
    }

    #[test]
    fn plain_tcp_unless_asked_and_kafkas_is_tls() {
        let plain = of("kafka://h:9092").unwrap();
        assert_eq!(plain.security, KafkaSecurity::default());
        for (_, cc) in every_client(&plain) {
            assert_eq!(cc.get("security.protocol"), Some("plaintext"));
            assert_eq!(cc.get("sasl.mechanism"), None);
            assert_eq!(cc.get("ssl.ca.location"), None);
        }
        let tls = of("kafkas://h:9093,h2:9093?ssl.ca.location=/ca.pem").unwrap();
        assert_eq!(tls.brokers, "h:9093,h2:9093");
        assert_eq!(tls.security.protocol, SecurityProtocol::Ssl);
        assert_eq!(tls.client_config().get("ssl.ca.location"), Some("/ca.pem"));
        // credentials in the userinfo (percent-decoded), SASL over TLS, PLAIN by default
        let sasl = of("kafkas://alice:p%40ss%3Aw0rd@h1:9093,h2:9093?group=g").unwrap();
        assert_eq!(sasl.brokers, "h1:9093,h2:9093");
        assert_eq!(sasl.security.protocol, SecurityProtocol::SaslSsl);
        assert_eq!(sasl.security.sasl_mechanism, SaslMechanism::Plain);
        let cc = sasl.client_config();
        assert_eq!(cc.get("sasl.username"), Some("alice"));
        assert_eq!(cc.get("sasl.password"), Some("p@ss:w0rd"));
        assert_eq!(cc.get("sasl.mechanism"), Some("PLAIN"));
        // SASL over plain TCP only when said so; names in any case
        let clear = of("kafka://u:p@h:9092?security.protocol=SASL_PLAINTEXT\
                        &sasl.mechanism=scram-sha-512")
        .unwrap();
        assert_eq!(clear.security.protocol, SecurityProtocol::SaslPlaintext);
        assert_eq!(
            clear.client_config().get("sasl.mechanism"),
            Some("SCRAM-SHA-512")
        );
        // TLS on kafka:// when said so
        let ssl = of("kafka://h:9093?security.protocol=ssl").unwrap();
        assert_eq!(ssl.client_config().get("security.protocol"), Some("ssl"));
        assert_eq!(
            KafkaSecurity::sasl(true, SaslMechanism::ScramSha256, "u", "p")
                .with_ca_location("/ca.pem")
                .protocol,
            SecurityProtocol::SaslSsl
        );
    }

    #[test]
    fn compression_reaches_the_producers_only() {
        for z in ["none", "gzip", "lz4", "snappy", "zstd", "ZSTD"] {
            let c = of(&format!("kafka://h:9092?compression.type={z}")).unwrap();
            let want = z.to_ascii_lowercase();
            assert_eq!(c.producer_config().get("compression.type"), Some(&*want));
            assert_eq!(c.consumer_config().get("compression.type"), None);
            let made: Result<rdkafka::producer::BaseProducer, _> = c.producer_config().create();
            assert!(made.is_ok(), "{z}: {:?}", made.err());
        }
        let c = KafkaConfig::new("h:9092", "t").with_compression(Compression::Zstd);
        assert_eq!(c.producer_config().get("compression.type"), Some("zstd"));
    }

    #[test]
    fn bad_or_contradictory_security_is_refused_by_name() {
        for (query, param, reason) in [
            (
                "kafka://h?security.protocol=tls",
                "security.protocol",
                "plaintext, ssl, sasl_plaintext, sasl_ssl",
            ),
            (
                "kafka://h?security.protocol=sasl_ssl&sasl.mechanism=GSSAPI&sasl.username=u&sasl.password=p",
                "sasl.mechanism",
                "PLAIN, SCRAM-SHA-256, SCRAM-SHA-512",
            ),
            (
                "kafkas://h?ssl.endpoint.identification.algorithm=strict",
                "ssl.endpoint.identification.algorithm",
                "https, none",
            ),
            (
                "kafka://h?compression.type=brotli",
                "compression.type",
                "none, gzip, lz4, snappy, zstd",
            ),
            (
                "kafkas://h?security.protocol=plaintext",
                "security.protocol",
                "kafkas:// is TLS",
            ),
            (
                "kafkas://h?security.protocol=sasl_plaintext",
                "security.protocol",
                "kafkas:// is TLS",
            ),
            // credentials never go over plain TCP unless said so
            ("kafka://u:p@h", "security.protocol", "sasl_plaintext to send them"),
            ("kafka://h?sasl.username=u&sasl.password=p", "security.protocol", "kafkas://"),
            (
                "kafka://h?security.protocol=ssl&sasl.mechanism=PLAIN",
                "sasl.mechanism",
                "needs security.protocol sasl_plaintext or sasl_ssl, not ssl",
            ),
            (
                "kafkas://h?security.protocol=ssl&sasl.password=p",
                "sasl.password",
                "not ssl",
            ),
            (
                "kafka://h?ssl.ca.location=/ca.pem",
                "ssl.ca.location",
                "needs security.protocol ssl or sasl_ssl (or kafkas://), not plaintext",
            ),
            (
                "kafka://u:p@h?security.protocol=sasl_plaintext&ssl.key.password=k",
                "ssl.key.password",
                "not sasl_plaintext",
            ),
            ("kafka://h?security.protocol=sasl_ssl", "sasl.username", "needs a user"),
            (
                "kafkas://u@h?sasl.mechanism=SCRAM-SHA-256",
                "sasl.password",
                "sasl_ssl with SCRAM-SHA-256 needs a password",
            ),
            (
                "kafkas://u:p@h?sasl.username=v",
                "sasl.username",
                "given twice",
            ),
            (
                "kafkas://u:p@h?sasl.password=q",
                "sasl.password",
                "given twice",
            ),
            ("kafkas://h?sasl.username=&sasl.password=p", "sasl.username", "not be empty"),
            (
                "kafkas://h?ssl.certificate.location=/c.pem",
                "ssl.certificate.location",
                "needs its key",
            ),
            (
                "kafkas://h?ssl.key.location=/c.key",
                "ssl.key.location",
                "needs its certificate",
            ),
            (
                "kafkas://h?ssl.key.password=k",
                "ssl.key.password",
                "needs the key",
            ),
            ("kafka://h?ssl.cipher.suites=x", "ssl.cipher.suites", "unknown parameter"),
            ("kafka://h?sasl.jaas.config=x", "sasl.jaas.config", "unknown parameter"),
        ] {
            crate::setting::assert_refused(of(query), query, param, reason);
        }
    }

    #[test]
    fn secrets_never_show() {
        let secrets = ["hunter2", "k3ypass", "s3cret"];
        let hidden = |what: &str, text: &str| {
            for s in secrets {
                assert!(!text.contains(s), "{what} shows {s}: {text}");
            }
        };
        let url = "kafkas://alice:s3cret@h1:9093,h2:9093?sasl.mechanism=SCRAM-SHA-512\
                   &ssl.certificate.location=/c.pem&ssl.key.location=/c.key\
                   &ssl.key.password=k3ypass&group=g";
        let parsed = BrokerUrl::parse(url).unwrap();
        hidden("BrokerUrl Display", &parsed.to_string());
        hidden("BrokerUrl Debug", &format!("{parsed:?}"));
        let c = KafkaConfig::from_url(&parsed, "t").unwrap();
        let debug = format!("{c:?}");
        hidden("KafkaConfig Debug", &debug);
        assert!(debug.contains("sasl_password: Some(\"***\")"), "{debug}");
        assert!(debug.contains("ssl_key_password: Some(\"***\")"), "{debug}");
        assert!(debug.contains("alice"), "{debug}");
        let query = BrokerUrl::parse(
            "kafka://h:9092?security.protocol=sasl_plaintext&sasl.username=u\
             &sasl.password=hunter2",
        )
        .unwrap();
        hidden("BrokerUrl Debug", &format!("{query:?}"));
        hidden(
            "KafkaConfig Debug",
            &format!("{:?}", KafkaConfig::from_url(&query, "t").unwrap()),
        );
        // refusals: Display and Debug of the error, whichever rule refused it
        for bad in [
            "kafka://h?sasl.password=hunter2",
            "kafka://h?security.protocol=ssl&sasl.password=hunter2",
            "kafkas://u:s3cret@h?sasl.password=hunter2",
            "kafka://h?sasl.password=hunter2&sasl.password=hunter2",
            "kafka://h?ssl.key.password=k3ypass",
            "kafkas://h?ssl.key.password=k3ypass",
            "kafka://u:s3cret@h?acks=all",
            "kafka://u:s3cret@h?security.protocol=bogus",
            "kafka://u:s3cret@h1:9092,h2:bad",
        ] {
            let e = BrokerUrl::parse(bad)
                .and_then(|u| KafkaConfig::from_url(&u, "t"))
                .unwrap_err();
            hidden(bad, &e.to_string());
            hidden(bad, &format!("{e:?}"));
        }
        // librdkafka's own refusal (an unreadable key) names no passphrase
        let c = KafkaConfig::new("127.0.0.1:1", "t").with_security(
            KafkaSecurity::ssl().with_client_certificate(
                "/nonexistent/c.pem",
                "/nonexistent/c.key",
                Some("k3ypass".to_owned()),
            ),
        );
        hidden("KafkaSecurity Debug", &format!("{:?}", c.security));
        let made: Result<rdkafka::producer::BaseProducer, _> = c.producer_config().create();
        let Err(made) = made else {
            panic!("a client with an unreadable key")
        };
        let e = BrokerError::connect(super::super::BROKER, made);
        let mut chain = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            chain += &format!(": {s}");
            source = s.source();
        }
        assert!(chain.contains("ssl."), "{chain}");
        hidden("librdkafka's error", &chain);
        hidden("librdkafka's error", &format!("{e:?}"));
    }
}
