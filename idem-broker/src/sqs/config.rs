//! How to reach an SQS queue.

use std::time::Duration;

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
    /// delivers it again (default 30 s). Sent with every receive.
    pub visibility_timeout: Duration,
    /// How long one receive waits for messages (long polling; default 1 s, at most 20 s).
    pub wait: Duration,
    /// How many received messages are kept on hand at most (one receive returns up to 10).
    pub prefetch: usize,
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
}
