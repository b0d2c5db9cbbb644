//! How to reach a Kafka topic.

use std::time::Duration;

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
#[derive(Debug, Clone, PartialEq, Eq)]
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

impl KafkaConfig {
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
    /// [`BrokerError::InvalidUrl`](crate::BrokerError::InvalidUrl) for an unknown name.
    pub fn with_assignment(mut self, name: &str) -> Result<Self, crate::BrokerError> {
        self.assignment = match name {
            "cooperative-sticky" => Assignment::CooperativeSticky,
            "range" => Assignment::Range,
            "roundrobin" => Assignment::RoundRobin,
            other => {
                return Err(crate::BrokerError::InvalidUrl(format!(
                    "assignment: {other:?} is not cooperative-sticky, range or roundrobin"
                )))
            }
        };
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
