//! How to reach a JetStream stream, and its URL settings.

use std::time::Duration;

use crate::any::{BrokerKind, BrokerUrl};
use crate::setting::duration_in;
use crate::BrokerError;

/// The default `max_deliver`: twice the core's default `max_attempts`.
pub const DEFAULT_MAX_DELIVER: i64 = 20;

/// A JetStream stream and how to consume it.
///
/// [`from_url`](Self::from_url) reads idem's settings from a `nats://` or `tls://` URL's
/// query (`nats://127.0.0.1:4222?ack_wait=5s`):
///
/// | parameter | default | value |
/// |---|---|---|
/// | `ack_wait` | `30s` | how long the server waits for an ack before redelivering: a [duration](crate::parse_duration) of at least 1 ms |
/// | `durable` | `idem` | the durable consumer's name: not empty, no whitespace, `.`, `*`, `>`, `/`, `\` or control characters |
/// | `max_deliver` | `20` ([`DEFAULT_MAX_DELIVER`]) | the durable's redelivery limit: at least 1, or `-1` for none |
///
/// and the connection's, read when it connects (a path may be percent-encoded):
///
/// | parameter | value |
/// |---|---|
/// | `creds` | a credentials file (a user JWT and its nkey seed, as `nsc` writes it) |
/// | `nkey` | a file holding a user nkey seed (a line starting `SU`) |
/// | `cacertfile` | a PEM file of CA certificates trusted instead of the system's roots; TLS is then required |
/// | `certfile` + `keyfile` | a client certificate and its key (PEM); TLS is then required |
///
/// A token (`nats://TOKEN@host`) or a user and password (`nats://USER:PASS@host`) go in
/// the URL itself. Any other parameter is an error.
#[derive(Clone, PartialEq, Eq)]
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
    /// How many received deliveries may wait for the gate: the consumer pulls only the
    /// room left. A durable created here gets a `max_ack_pending` of twice this, at
    /// least 1,000 (it bounds every unsettled delivery of the durable, in all processes).
    pub prefetch: usize,
    /// The durable consumer's `max_deliver` (default 20, `-1` for unlimited; URL option
    /// `max_deliver=N`): past it the server stops redelivering a message (it publishes a
    /// `MAX_DELIVERIES` advisory, which the consumer logs and counts, and the message
    /// stays in the stream, unacked). Only deliveries a process lost count towards it (a
    /// crash, a lost connection): nacks with a delay and deferrals are held by the
    /// consumer and cost no delivery. Keep it above the core's `max_attempts` (default
    /// 10) so the core dead-letters first, with its reason; the server's limit only stops
    /// a message that kills the process before the gate can count it from looping
    /// forever.
    pub max_deliver: i64,
    /// The stream's duplicate window for `Nats-Msg-Id` (default 2 min), used when the
    /// stream is created.
    pub duplicate_window: Duration,
}

impl std::fmt::Debug for NatsConfig {
    /// The URL with its secrets hidden ([`idem_core::redact_url`]: a user alone on a
    /// `nats://` URL is a token).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &idem_core::Redacted(&self.url))
            .field("name", &self.name)
            .field("durable", &self.durable)
            .field("ack_wait", &self.ack_wait)
            .field("prefetch", &self.prefetch)
            .field("max_deliver", &self.max_deliver)
            .field("duplicate_window", &self.duplicate_window)
            .finish()
    }
}

impl NatsConfig {
    /// idem's settings in the URL query (the table above).
    pub(crate) const URL_SETTINGS: &'static [&'static str] =
        &["ack_wait", "durable", "max_deliver"];
    /// The connection's settings in the URL query, read by the adapter when it connects
    /// (async-nats reads none from a URL): credentials and TLS files.
    pub(crate) const CLIENT_PARAMS: &'static [&'static str] =
        &["creds", "nkey", "cacertfile", "certfile", "keyfile"];

    /// The configuration of subject `name` at `url`, with the URL's settings (the table
    /// above) over the defaults of [`new`](Self::new).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_broker::any::BrokerUrl;
    /// use idem_broker::nats::NatsConfig;
    /// let url = BrokerUrl::parse("nats://127.0.0.1:4222?ack_wait=5s&max_deliver=-1")?;
    /// let c = NatsConfig::from_url(&url, "grants")?;
    /// assert_eq!((c.ack_wait, c.max_deliver), (Duration::from_secs(5), -1));
    /// assert_eq!(c.url, "nats://127.0.0.1:4222");
    /// # Ok::<(), idem_broker::BrokerError>(())
    /// ```
    ///
    /// # Errors
    /// [`BrokerError::InvalidParam`] naming a bad setting; [`BrokerError::InvalidUrl`]
    /// for another broker's URL.
    pub fn from_url(url: &BrokerUrl, name: impl Into<String>) -> Result<Self, BrokerError> {
        url.expect_kind(BrokerKind::Nats)?;
        super::split_connect(url.client_url())?;
        let mut c = Self::new(url.client_url(), name);
        if let Some(d) = url.setting(
            "ack_wait",
            duration_in(Duration::from_millis(1)..=Duration::MAX),
        )? {
            c.ack_wait = d;
        }
        if let Some(d) = url.setting("durable", durable_name)? {
            c.durable = d;
        }
        if let Some(n) = url.setting("max_deliver", |s| match s.trim().parse::<i64>() {
            Ok(n) if n == -1 || n >= 1 => Ok(n),
            _ => Err("must be a whole number of at least 1, or -1 for none".to_owned()),
        })? {
            c.max_deliver = n;
        }
        Ok(c)
    }

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

/// A JetStream durable consumer name, as the server takes it.
fn durable_name(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("must not be empty".to_owned());
    }
    match s
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
    {
        Some(c) => Err(format!(
            "a durable name cannot contain {c:?} (no whitespace, '.', '*', '>', '/', '\\')"
        )),
        None => Ok(s.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(query: &str) -> Result<NatsConfig, BrokerError> {
        NatsConfig::from_url(&BrokerUrl::parse(&format!("nats://h:4222{query}"))?, "s")
    }

    #[test]
    fn debug_hides_the_token_and_the_password() {
        for url in [
            "nats://s3cr3t-token@h:4222",
            "nats://user:s3cr3t-token@h:4222",
        ] {
            let shown = format!("{:?}", NatsConfig::new(url, "s"));
            assert!(!shown.contains("s3cr3t-token"), "{shown}");
            assert!(shown.contains("h:4222"), "{shown}");
        }
    }

    #[test]
    fn defaults_and_every_setting() {
        let d = read("").unwrap();
        assert_eq!(d.url, "nats://h:4222");
        assert_eq!(d.name, "s");
        assert_eq!(d.ack_wait, Duration::from_secs(30));
        assert_eq!(d.durable, "idem");
        assert_eq!(d.max_deliver, DEFAULT_MAX_DELIVER);
        let c = read("?ack_wait=2s&durable=d-1_x&max_deliver=5").unwrap();
        assert_eq!(c.url, "nats://h:4222");
        assert_eq!(c.ack_wait, Duration::from_secs(2));
        assert_eq!(c.durable, "d-1_x");
        assert_eq!(c.max_deliver, 5);
        assert_eq!(
            read("?ack_wait=1500ms").unwrap().ack_wait,
            Duration::from_millis(1_500)
        );
        assert_eq!(
            read("?ack_wait=45").unwrap().ack_wait,
            Duration::from_secs(45)
        );
        assert_eq!(read("?max_deliver=-1").unwrap().max_deliver, -1);
    }

    #[test]
    fn bad_values_name_their_parameter() {
        for (query, param, reason) in [
            ("?ack_wait=soon", "ack_wait", "invalid duration"),
            ("?ack_wait=0s", "ack_wait", "at least 1ms"),
            ("?ack_wait=", "ack_wait", "empty"),
            ("?durable=", "durable", "not be empty"),
            ("?durable=a.b", "durable", "'.'"),
            ("?durable=a%20b", "durable", "' '"),
            ("?durable=a*", "durable", "'*'"),
            ("?max_deliver=0", "max_deliver", "-1 for none"),
            ("?max_deliver=-2", "max_deliver", "-1 for none"),
            ("?max_deliver=many", "max_deliver", "-1 for none"),
            ("?ack_wait=1s&ack_wait=2s", "ack_wait", "more than once"),
            ("?group=g", "group", "unknown parameter"),
        ] {
            crate::setting::assert_refused(read(query), query, param, reason);
        }
    }
}
