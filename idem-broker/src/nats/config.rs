//! How to reach a JetStream stream.

use std::time::Duration;

/// The default `max_deliver`: twice the core's default `max_attempts`.
pub const DEFAULT_MAX_DELIVER: i64 = 20;

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
    /// The durable consumer's `max_deliver` (default 20, `-1` for unlimited; URL option
    /// `max_deliver=N`): past it the server stops redelivering a message (it publishes a
    /// `MAX_DELIVERIES` advisory and the message stays in the stream, unacked). Keep it
    /// above the core's `max_attempts` (default 10) so the core dead-letters first, with
    /// its reason; the server's limit only stops a message that kills the process before
    /// the gate can count it from looping forever.
    pub max_deliver: i64,
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
            max_deliver: DEFAULT_MAX_DELIVER,
            duplicate_window: Duration::from_secs(120),
        }
    }

    /// Sets the ack wait.
    #[must_use]
    pub fn with_ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Sets `max_deliver` (`-1`: unlimited).
    #[must_use]
    pub fn with_max_deliver(mut self, max_deliver: i64) -> Self {
        self.max_deliver = if max_deliver <= 0 { -1 } else { max_deliver };
        self
    }

    /// How often a delivery taken and not yet settled is kept alive (`+WPI`): a third of
    /// the ack wait, at least 50 ms.
    pub fn keep_alive_every(&self) -> Duration {
        (self.ack_wait / 3).max(Duration::from_millis(50))
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
