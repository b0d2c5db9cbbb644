//! How to reach a Redis stream.

use std::time::Duration;

/// A Redis stream and how to consume it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisStreamsConfig {
    /// The server URL, e.g. `redis://127.0.0.1:6379`.
    pub url: String,
    /// The stream key `NAME`.
    pub name: String,
    /// The consumer group (default `idem`).
    pub group: String,
    /// This consumer's name in the group (default: unique per process and connect).
    pub consumer: String,
    /// How long an entry stays pending with a silent consumer before another takes it
    /// over with `XAUTOCLAIM` (default 30 s). A live consumer resets the idle time of the
    /// entries it holds every third of it ([`keep_alive_every`](Self::keep_alive_every)).
    pub min_idle: Duration,
    /// How long one `XREADGROUP` blocks waiting for new entries (default 1 s); pending
    /// entries are reclaimed between reads.
    pub block: Duration,
    /// How many entries one read returns at most (`COUNT`).
    pub prefetch: usize,
    /// Consumers of the group with no pending entries and idle at least this long are
    /// removed (`XGROUP DELCONSUMER`) when a consumer connects (default 1 h; URL option
    /// `forget_after`), so each start does not leave a name behind for good.
    pub forget_after: Duration,
}

impl RedisStreamsConfig {
    /// A configuration with the defaults above and a prefetch of 64.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: name.into(),
            group: "idem".to_owned(),
            consumer: unique_consumer_name(),
            min_idle: Duration::from_secs(30),
            block: Duration::from_secs(1),
            prefetch: 64,
            forget_after: Duration::from_secs(3_600),
        }
    }

    /// Sets the group.
    #[must_use]
    pub fn with_group(mut self, group: impl Into<String>) -> Self {
        self.group = group.into();
        self
    }

    /// Sets this consumer's name.
    #[must_use]
    pub fn with_consumer(mut self, consumer: impl Into<String>) -> Self {
        self.consumer = consumer.into();
        self
    }

    /// Sets the idle time after which pending entries are taken over.
    #[must_use]
    pub fn with_min_idle(mut self, min_idle: Duration) -> Self {
        self.min_idle = min_idle;
        self
    }

    /// Sets how long an idle consumer with nothing pending is kept in the group.
    #[must_use]
    pub fn with_forget_after(mut self, forget_after: Duration) -> Self {
        self.forget_after = forget_after;
        self
    }

    /// How often the entries this consumer holds (taken, buffered or in work) have their
    /// idle time reset: a third of `min_idle`, at least 50 ms. Shorter than `min_idle`,
    /// so `XAUTOCLAIM` never takes an entry a live consumer is working on.
    pub fn keep_alive_every(&self) -> Duration {
        (self.min_idle / 3).max(Duration::from_millis(50))
    }

    /// Sets the read block time (at least 1 ms).
    #[must_use]
    pub fn with_block(mut self, block: Duration) -> Self {
        self.block = block.max(Duration::from_millis(1));
        self
    }

    /// Sets the prefetch (at least 1).
    #[must_use]
    pub fn with_prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }
}

fn unique_consumer_name() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "idem-{}-{:08x}-{}",
        std::process::id(),
        nanos,
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}
