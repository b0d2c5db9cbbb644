//! How to reach a Redis stream, and its URL settings.

use std::time::Duration;

use crate::any::{BrokerKind, BrokerUrl};
use crate::setting::{self, duration_in};
use crate::BrokerError;

/// The default of [`RedisStreamsConfig::command_timeout`]: 10 s.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// A Redis stream and how to consume it.
///
/// [`from_url`](Self::from_url) reads idem's settings from a `redis://` or `rediss://`
/// URL's query (`redis://127.0.0.1:6379/0?min_idle=5s`); each duration is a
/// [duration](crate::parse_duration) of at least 1 ms:
///
/// | parameter | default | value |
/// |---|---|---|
/// | `group` | `idem` | the consumer group: not empty |
/// | `consumer` | unique per process and connect | this consumer's name in the group: not empty |
/// | `min_idle` | `30s` | pending entries of a silent consumer are taken over after this |
/// | `block` | `1s` | how long one `XREADGROUP` blocks waiting for new entries |
/// | `forget_after` | `1h` | idle consumers with nothing pending are removed from the group after this |
/// | `command_timeout` | `10s` ([`DEFAULT_COMMAND_TIMEOUT`]) | the longest wait for the server's answer to a command, beyond its block time for `XREADGROUP` |
///
/// fred reads no query parameters from a `redis://` URL: any other is an error.
#[derive(Clone, PartialEq, Eq)]
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
    /// How long a command may go unanswered (default 10 s); the blocking `XREADGROUP`
    /// gets its [`block`](Self::block) time on top. A command that times out fails with
    /// [`BrokerError::Timeout`](crate::BrokerError::Timeout): a frozen or unreachable
    /// server ends the consumer's stream and fails acks instead of hanging them.
    pub command_timeout: Duration,
}

impl std::fmt::Debug for RedisStreamsConfig {
    /// The URL with its secrets hidden ([`idem_core::redact_url`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamsConfig")
            .field("url", &idem_core::Redacted(&self.url))
            .field("name", &self.name)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("min_idle", &self.min_idle)
            .field("block", &self.block)
            .field("prefetch", &self.prefetch)
            .field("forget_after", &self.forget_after)
            .field("command_timeout", &self.command_timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStreamsConfig {
    /// idem's settings in the URL query (the table above).
    pub(crate) const URL_SETTINGS: &'static [&'static str] = &[
        "group",
        "consumer",
        "min_idle",
        "block",
        "forget_after",
        "command_timeout",
    ];

    /// The configuration of stream `name` at `url`, with the URL's settings (the table
    /// above) over the defaults of [`new`](Self::new).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_broker::any::BrokerUrl;
    /// use idem_broker::redis_streams::RedisStreamsConfig;
    /// let url = BrokerUrl::parse("redis://127.0.0.1:6379/0?min_idle=500ms&group=g")?;
    /// let c = RedisStreamsConfig::from_url(&url, "grants")?;
    /// assert_eq!((c.group.as_str(), c.min_idle), ("g", Duration::from_millis(500)));
    /// assert_eq!(c.url, "redis://127.0.0.1:6379/0");
    /// # Ok::<(), idem_broker::BrokerError>(())
    /// ```
    ///
    /// # Errors
    /// [`BrokerError::InvalidParam`] naming a bad setting; [`BrokerError::InvalidUrl`]
    /// for another broker's URL.
    pub fn from_url(url: &BrokerUrl, name: impl Into<String>) -> Result<Self, BrokerError> {
        url.expect_kind(BrokerKind::RedisStreams)?;
        crate::tls::check_compiled(url.client_url())?;
        let positive = || duration_in(Duration::from_millis(1)..=Duration::MAX);
        let mut c = Self::new(url.client_url(), name);
        if let Some(g) = url.setting("group", setting::name)? {
            c.group = g;
        }
        if let Some(n) = url.setting("consumer", setting::name)? {
            c.consumer = n;
        }
        if let Some(d) = url.setting("min_idle", positive())? {
            c.min_idle = d;
        }
        if let Some(d) = url.setting("block", positive())? {
            c.block = d;
        }
        if let Some(d) = url.setting("forget_after", positive())? {
            c.forget_after = d;
        }
        if let Some(d) = url.setting("command_timeout", positive())? {
            c.command_timeout = d;
        }
        Ok(c)
    }

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
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
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

    /// Sets the command timeout (at least 1 ms).
    #[must_use]
    pub fn with_command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout.max(Duration::from_millis(1));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn read(query: &str) -> Result<RedisStreamsConfig, BrokerError> {
        RedisStreamsConfig::from_url(&BrokerUrl::parse(&format!("redis://h:6379/0{query}"))?, "s")
    }

    #[test]
    fn defaults_and_every_setting() {
        let d = read("").unwrap();
        assert_eq!(d.url, "redis://h:6379/0");
        assert_eq!(d.name, "s");
        assert_eq!(d.group, "idem");
        assert!(d.consumer.starts_with("idem-"), "{}", d.consumer);
        assert_eq!(d.min_idle, Duration::from_secs(30));
        assert_eq!(d.block, Duration::from_secs(1));
        assert_eq!(d.forget_after, Duration::from_secs(3_600));
        assert_eq!(d.command_timeout, DEFAULT_COMMAND_TIMEOUT);
        let c = read(
            "?group=g&consumer=c1&min_idle=500ms&block=200ms&forget_after=2h&command_timeout=3s",
        )
        .unwrap();
        assert_eq!(c.url, "redis://h:6379/0");
        assert_eq!((c.group.as_str(), c.consumer.as_str()), ("g", "c1"));
        assert_eq!(c.min_idle, Duration::from_millis(500));
        assert_eq!(c.block, Duration::from_millis(200));
        assert_eq!(c.forget_after, Duration::from_secs(7_200));
        assert_eq!(c.command_timeout, Duration::from_secs(3));
        assert_eq!(
            read("?min_idle=5").unwrap().min_idle,
            Duration::from_secs(5)
        );
    }

    #[test]
    fn bad_values_name_their_parameter() {
        for (query, param, reason) in [
            ("?group=", "group", "not be empty"),
            ("?consumer=", "consumer", "not be empty"),
            ("?consumer=%20c", "consumer", "whitespace"),
            ("?min_idle=soon", "min_idle", "invalid duration"),
            ("?min_idle=0", "min_idle", "at least 1ms"),
            ("?block=0ms", "block", "at least 1ms"),
            ("?block=500us", "block", "at least 1ms"),
            ("?forget_after=-1h", "forget_after", "negative"),
            ("?forget_after=0s", "forget_after", "at least 1ms"),
            ("?command_timeout=0", "command_timeout", "at least 1ms"),
            (
                "?command_timeout=soon",
                "command_timeout",
                "invalid duration",
            ),
            ("?group=a&group=b", "group", "more than once"),
            ("?durable=d", "durable", "unknown parameter"),
        ] {
            crate::setting::assert_refused(read(query), query, param, reason);
        }
    }
}
