//! How to reach a Kafka topic.

use std::time::Duration;

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
        }
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
