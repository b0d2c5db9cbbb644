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
    /// The kind of queue declared for `NAME` and `NAME.dead-letter` (default
    /// [`QueueType::Quorum`]; URL option `queue_type=classic|quorum`).
    pub queue_type: QueueType,
    /// A quorum queue's `x-delivery-limit`: past this many redeliveries the broker itself
    /// dead-letters the message to `NAME.dead-letter` (default 20; `0` for none; URL option
    /// `delivery_limit=N`). Keep it above the core's `max_attempts` (default 10), so the
    /// core normally dead-letters first, with its reason; the broker's limit is the
    /// backstop for a message that kills the process before the gate can count it.
    /// Ignored for classic queues, which have no delivery count.
    pub delivery_limit: u32,
}

/// The kind of RabbitMQ queue idem declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// A replicated quorum queue (`x-queue-type: quorum`): Raft-replicated, keeps a
    /// delivery count (`x-delivery-count`, the delivery's attempt) and a delivery limit.
    #[default]
    Quorum,
    /// A durable classic queue: no delivery count (the consumer counts attempts).
    Classic,
}

impl QueueType {
    /// The `x-queue-type` argument.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Quorum => "quorum",
            Self::Classic => "classic",
        }
    }
}

impl std::str::FromStr for QueueType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "quorum" => Ok(Self::Quorum),
            "classic" => Ok(Self::Classic),
            other => Err(format!("queue_type {other:?}: use quorum or classic")),
        }
    }
}

/// The default quorum `x-delivery-limit`: twice the core's default `max_attempts`.
pub const DEFAULT_DELIVERY_LIMIT: u32 = 20;

impl RabbitConfig {
    /// A configuration with a prefetch of 64, a quorum queue and a delivery limit of 20.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: name.into(),
            prefetch: 64,
            consumer_tag: String::new(),
            queue_type: QueueType::Quorum,
            delivery_limit: DEFAULT_DELIVERY_LIMIT,
        }
    }

    /// Sets the queue type.
    #[must_use]
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Sets the quorum delivery limit (`0`: none).
    #[must_use]
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = limit;
        self
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
