//! How to reach an SQS queue, and how idem creates one.

use std::time::Duration;

/// How long the dead-letter queue keeps a message: 14 days, the most SQS allows, so that
/// a dead letter is not dropped before someone looks at it.
pub const DEAD_LETTER_RETENTION: Duration = Duration::from_secs(1_209_600);

/// The default `maxReceiveCount` of the source's redrive policy: the core's default
/// `max_attempts` (10), so the gate dead-letters a failing message with its reason on its
/// 10th delivery and SQS moves a message to the dead-letter queue only when it was
/// received more often than that without being settled (consumers crashing on it).
pub const DEFAULT_MAX_RECEIVE_COUNT: u32 = 10;

/// An SQS queue and how to consume it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqsConfig {
    /// The endpoint, e.g. `http://127.0.0.1:5000`; `None` takes the usual AWS
    /// configuration (`AWS_ENDPOINT_URL`, or AWS itself).
    pub endpoint: Option<String>,
    /// The logical name `NAME` (see [`queue_name`](super::queue_name) for the SQS name).
    pub name: String,
    /// How long a received message stays invisible to other consumers before SQS
    /// delivers it again (default 30 s). Sent with every receive; while a delivery is
    /// unsettled (in the consumer's buffer or being worked on) the consumer extends it
    /// with `ChangeMessageVisibility` every third of this time.
    pub visibility_timeout: Duration,
    /// How long one receive waits for messages (long polling; default 1 s, at most 20 s).
    pub wait: Duration,
    /// How many received messages are kept on hand at most (one receive returns up to 10).
    pub prefetch: usize,
    /// The source queue's `MessageRetentionPeriod` when idem creates it (`None`: SQS's
    /// default, 4 days). When set, an existing queue with another retention is a
    /// [`Config`](crate::BrokerError::Config) error.
    pub retention: Option<Duration>,
    /// The `maxReceiveCount` of the redrive policy idem gives a source queue it creates
    /// (to `NAME.dead-letter`); default [`DEFAULT_MAX_RECEIVE_COUNT`]. Set it to the
    /// consumer's `max_attempts`: lower, SQS would move a message before the gate had its
    /// attempts (an existing queue whose policy is lower is a
    /// [`Config`](crate::BrokerError::Config) error).
    pub max_receive_count: u32,
}

impl SqsConfig {
    /// A configuration with the defaults above and a prefetch of 20.
    pub fn new(endpoint: Option<String>, name: impl Into<String>) -> Self {
        Self {
            endpoint,
            name: name.into(),
            visibility_timeout: Duration::from_secs(30),
            wait: Duration::from_secs(1),
            prefetch: 20,
            retention: None,
            max_receive_count: DEFAULT_MAX_RECEIVE_COUNT,
        }
    }

    /// Sets the visibility timeout (whole seconds, at least 1).
    #[must_use]
    pub fn with_visibility_timeout(mut self, d: Duration) -> Self {
        self.visibility_timeout = d.max(Duration::from_secs(1));
        self
    }

    /// Sets the long-poll wait (whole seconds, at most 20).
    #[must_use]
    pub fn with_wait(mut self, d: Duration) -> Self {
        self.wait = d.min(Duration::from_secs(20));
        self
    }

    /// Sets the prefetch (at least 1).
    #[must_use]
    pub fn with_prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// Sets the source queue's retention (whole seconds, 60 s to 14 days as SQS allows).
    #[must_use]
    pub fn with_retention(mut self, d: Duration) -> Self {
        self.retention = Some(d.clamp(Duration::from_secs(60), DEAD_LETTER_RETENTION));
        self
    }

    /// Sets the redrive policy's `maxReceiveCount` (1 to 1000 as SQS allows).
    #[must_use]
    pub fn with_max_receive_count(mut self, n: u32) -> Self {
        self.max_receive_count = n.clamp(1, 1000);
        self
    }
}
