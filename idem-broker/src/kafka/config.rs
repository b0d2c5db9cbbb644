//! How to reach a Kafka topic, and its URL settings.

use std::time::Duration;

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

/// A Kafka topic and how to consume it.
///
/// [`from_url`](Self::from_url) reads a `kafka://` URL: its authority is the bootstrap
/// list (`kafka://host:port`), and idem's settings ride in its query
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
            .finish_non_exhaustive()
    }
}

impl KafkaConfig {
    /// idem's settings in the URL query (the table above).
    pub(crate) const URL_SETTINGS: &'static [&'static str] = &[
        "group",
        "partitions",
        "replication",
        "session_timeout",
        "max_poll_interval",
        "assignment",
        "batch_messages",
        "queued_kbytes",
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
        }
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
}
