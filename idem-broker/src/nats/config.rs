//! How to reach a JetStream stream.

use std::time::Duration;

/// A JetStream stream and how to consume it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NatsConfig {
    /// The server URL, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// The subject `NAME` (stream [`stream_name`](super::stream_name)`(NAME)`).
    pub name: String,
    /// The durable consumer's name (default `idem`); consumers sharing it share the work.
    pub durable: String,
    /// How long the server waits for an ack before redelivering (default 30 s).
    pub ack_wait: Duration,
    /// How many deliveries are fetched ahead, and the consumer's `max_ack_pending`.
    pub prefetch: usize,
    /// The stream's duplicate window for `Nats-Msg-Id` (default 2 min), used when the
    /// stream is created.
    pub duplicate_window: Duration,
}

impl NatsConfig {
    /// A configuration with the defaults above and a prefetch of 64.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: name.into(),
            durable: "idem".to_owned(),
            ack_wait: Duration::from_secs(30),
            prefetch: 64,
            duplicate_window: Duration::from_secs(120),
        }
    }

    /// Sets the ack wait.
    #[must_use]
    pub fn with_ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Sets the durable consumer's name.
    #[must_use]
    pub fn with_durable(mut self, durable: impl Into<String>) -> Self {
        self.durable = durable.into();
        self
    }

    /// Sets the prefetch (at least 1).
    #[must_use]
    pub fn with_prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }
}
