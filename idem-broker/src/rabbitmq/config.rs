//! How to reach a RabbitMQ queue.

/// A RabbitMQ queue and how to consume it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RabbitConfig {
    /// The AMQP URL, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub url: String,
    /// The queue `NAME` (dead letters go to `NAME.dead-letter`).
    pub name: String,
    /// `basic.qos` prefetch: how many unacked deliveries the broker sends ahead.
    pub prefetch: u16,
    /// The consumer tag (empty: the broker picks one).
    pub consumer_tag: String,
}

impl RabbitConfig {
    /// A configuration with a prefetch of 64.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: name.into(),
            prefetch: 64,
            consumer_tag: String::new(),
        }
    }

    /// Sets the prefetch (at least 1).
    #[must_use]
    pub fn with_prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = u16::try_from(prefetch.max(1)).unwrap_or(u16::MAX);
        self
    }

    /// The prefetch for a consumer running `concurrency` batches of up to `batch_size`:
    /// two full rounds, so the next batches are already on hand while one commits.
    ///
    /// ```
    /// use idem_broker::rabbitmq::RabbitConfig;
    /// assert_eq!(RabbitConfig::prefetch_for(1, 1), 2);
    /// assert_eq!(RabbitConfig::prefetch_for(4, 100), 800);
    /// ```
    pub fn prefetch_for(concurrency: usize, batch_size: usize) -> usize {
        concurrency
            .max(1)
            .saturating_mul(batch_size.max(1))
            .saturating_mul(2)
            .min(usize::from(u16::MAX))
    }
}
