//! How to reach a RabbitMQ queue, and its URL settings.

use std::time::Duration;

use crate::any::{BrokerKind, BrokerUrl};
use crate::setting::{duration_in, number_in};
use crate::BrokerError;

/// A RabbitMQ queue and how to consume it.
///
/// [`from_url`](Self::from_url) reads idem's settings from an `amqp://` or `amqps://`
/// URL's query (`amqp://guest:guest@127.0.0.1:5672/%2f?queue_type=classic`):
///
/// | parameter | default | value |
/// |---|---|---|
/// | `queue_type` | `quorum` | `quorum` or `classic`: the [`QueueType`] declared for `NAME` and `NAME.dead-letter` |
/// | `delivery_limit` | `20` ([`DEFAULT_DELIVERY_LIMIT`]) | a quorum queue's `x-delivery-limit`, `1` to `4294967295` (see [`delivery_limit`](Self::delivery_limit): there is no "none"); not with `queue_type=classic` |
/// | `confirm_timeout` | `30s` ([`DEFAULT_CONFIRM_TIMEOUT`]) | how long a publish (a dead letter, a relayed event) waits for the broker's confirm before it is a retryable error: a [duration](crate::parse_duration) of at least 1 ms |
///
/// | `connection_timeout` | `30000` ([`DEFAULT_CONNECTION_TIMEOUT`](super::DEFAULT_CONNECTION_TIMEOUT)) | milliseconds (lapin's unit) that opening a connection may take: TCP, TLS and the AMQP handshake; past it, an error rather than a hang on a server that accepts and never answers |
///
/// The client's own parameters (`heartbeat`, `frame_max`, `channel_max`,
/// `auth_mechanism`) stay in the URL for lapin; any other is an error.
///
/// # TLS
/// An `amqps://` URL connects with TLS (feature `tls`: rustls, verifying the server's
/// certificate and host name) or not at all: without the feature it is refused, never
/// downgraded to plain TCP. The server is verified against the system's roots
/// (`SSL_CERT_FILE` / `SSL_CERT_DIR` name others), plus these PEM files from the URL, as
/// in RabbitMQ's own URI query (`amqps://u:p@host:5671/%2f?cacertfile=/etc/idem/ca.pem`):
///
/// | parameter | value |
/// |---|---|
/// | `cacertfile` | a PEM file of CA certificates trusted besides the system's roots |
/// | `certfile` | a PEM client certificate (chain), with `keyfile`, for client authentication |
/// | `keyfile` | the client certificate's PEM private key (PKCS#8, SEC1 or PKCS#1) |
///
/// They are read when connecting, and only from an `amqps://` URL.
#[derive(Clone, PartialEq, Eq)]
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
    /// A quorum queue's `x-delivery-limit`: past this many counted deliveries the broker
    /// itself dead-letters the message to `NAME.dead-letter` (default 20; URL option
    /// `delivery_limit=N`). Keep it above the core's `max_attempts` (default 10), so the
    /// core dead-letters first, with its reason; the broker's limit is the backstop for a
    /// message that kills the process before the gate can count it. Ignored for classic
    /// queues, which have no delivery count.
    ///
    /// What counts: a failed attempt (`basic.reject`, see [`RabbitAcker`](super::RabbitAcker))
    /// and a consumer lost holding the delivery, on every version; a requeue that is
    /// nobody's failure (`basic.nack`: a deferral past the hold limit) on 3.x and
    /// 4.0–4.2 only. A deferral held by the consumer counts nothing.
    ///
    /// `0` (none) is refused ([`BrokerError::InvalidParam`]): no declaration means "none"
    /// on every version. RabbitMQ 4.x gives a quorum queue declared without
    /// `x-delivery-limit` its default limit of 20, and 4.x's "none", a negative
    /// `x-delivery-limit`, makes 3.x dead-letter (or, without a target, drop) a message at
    /// its first requeue, since 3.x compares the count with the limit as given. Every
    /// quorum queue idem declares therefore has a positive limit and its dead-letter
    /// target: a broker limit reached moves the message to `NAME.dead-letter`, never
    /// drops it. For "practically none", give a large limit (`delivery_limit=1000000`).
    pub delivery_limit: u32,
    /// How long a publish waits for the broker's confirm before it fails with a retryable
    /// [`BrokerError::NotConfirmed`] (default 30 s; URL option `confirm_timeout=30s`).
    /// RabbitMQ blocks a publishing connection while it is low on memory or disk, and a
    /// blocked publish waits without an error: a dead letter not confirmed in time is not
    /// acked, its delivery is requeued after a pause (and may reach `NAME.dead-letter`
    /// twice: at least once, never lost).
    pub confirm_timeout: Duration,
}

impl std::fmt::Debug for RabbitConfig {
    /// The URL with its secrets hidden ([`idem_core::redact_url`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("url", &idem_core::Redacted(&self.url))
            .field("name", &self.name)
            .field("prefetch", &self.prefetch)
            .field("consumer_tag", &self.consumer_tag)
            .field("queue_type", &self.queue_type)
            .field("delivery_limit", &self.delivery_limit)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
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
            other => Err(format!(
                "{other:?} is not a queue type: use quorum or classic"
            )),
        }
    }
}

/// The default quorum `x-delivery-limit`: twice the core's default `max_attempts`.
pub const DEFAULT_DELIVERY_LIMIT: u32 = 20;

/// The default [`RabbitConfig::confirm_timeout`].
pub const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

impl RabbitConfig {
    /// idem's settings in the URL query (the table above).
    pub(crate) const URL_SETTINGS: &'static [&'static str] =
        &["queue_type", "delivery_limit", "confirm_timeout"];
    /// The query parameters lapin reads, left in the URL handed to it.
    pub(crate) const CLIENT_PARAMS: &'static [&'static str] = &[
        "heartbeat",
        "connection_timeout",
        "frame_max",
        "channel_max",
        "auth_mechanism",
        "cacertfile",
        "certfile",
        "keyfile",
    ];

    /// The configuration of queue `name` at `url`, with the URL's settings (the table
    /// above) over the defaults of [`new`](Self::new).
    ///
    /// ```
    /// use idem_broker::any::BrokerUrl;
    /// use idem_broker::rabbitmq::{QueueType, RabbitConfig};
    /// let url = BrokerUrl::parse("amqp://127.0.0.1:5672/%2f?queue_type=classic")?;
    /// let c = RabbitConfig::from_url(&url, "grants")?;
    /// assert_eq!((c.queue_type, c.url.as_str()), (QueueType::Classic, "amqp://127.0.0.1:5672/%2f"));
    /// # Ok::<(), idem_broker::BrokerError>(())
    /// ```
    ///
    /// # Errors
    /// [`BrokerError::InvalidParam`] naming a bad setting; [`BrokerError::InvalidUrl`]
    /// for another broker's URL.
    pub fn from_url(url: &BrokerUrl, name: impl Into<String>) -> Result<Self, BrokerError> {
        url.expect_kind(BrokerKind::RabbitMq)?;
        crate::tls::check_compiled(url.client_url())?;
        split_tls(url.client_url())?;
        let mut c = Self::new(url.client_url(), name);
        if let Some(t) = url.setting("queue_type", str::parse)? {
            c.queue_type = t;
        }
        if let Some(n) = url.setting("delivery_limit", number_in(1..=u32::MAX))? {
            if c.queue_type == QueueType::Classic {
                return Err(BrokerError::InvalidParam {
                    param: "delivery_limit".to_owned(),
                    value: n.to_string(),
                    reason: "a classic queue has no delivery limit (queue_type=classic)".to_owned(),
                });
            }
            c.delivery_limit = n;
        }
        if let Some(d) = url.setting(
            "confirm_timeout",
            duration_in(Duration::from_millis(1)..=Duration::MAX),
        )? {
            c.confirm_timeout = d;
        }
        Ok(c)
    }

    /// A configuration with a prefetch of 64, a quorum queue, a delivery limit of 20 and
    /// a confirm timeout of 30 s.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: name.into(),
            prefetch: 64,
            consumer_tag: String::new(),
            queue_type: QueueType::Quorum,
            delivery_limit: DEFAULT_DELIVERY_LIMIT,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
        }
    }

    /// Whether this configuration can be declared: a quorum queue needs a positive
    /// delivery limit (see [`delivery_limit`](Self::delivery_limit)).
    ///
    /// # Errors
    /// [`BrokerError::InvalidParam`] naming `delivery_limit`.
    pub(crate) fn check(&self) -> Result<(), BrokerError> {
        if self.queue_type == QueueType::Quorum && self.delivery_limit == 0 {
            return Err(BrokerError::InvalidParam {
                param: "delivery_limit".to_owned(),
                value: "0".to_owned(),
                reason: "a quorum queue needs a limit of at least 1: without x-delivery-limit \
                         RabbitMQ 4.x applies its default of 20, and 4.x's \"none\" (-1) \
                         dead-letters a message at its first requeue on 3.x; give a limit \
                         above the gate's max_attempts (a large one for practically none)"
                    .to_owned(),
            });
        }
        Ok(())
    }

    /// Sets the queue type.
    #[must_use]
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Sets the quorum delivery limit (at least 1: `0` is refused when connecting, see
    /// [`delivery_limit`](Self::delivery_limit)).
    #[must_use]
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = limit;
        self
    }

    /// Sets the confirm timeout (at least 1 ms).
    #[must_use]
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout.max(Duration::from_millis(1));
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

/// The TLS files of an AMQP URL, as written (before they are read).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct TlsFiles {
    /// `cacertfile`: extra trusted CA certificates.
    pub(crate) ca: Option<String>,
    /// `certfile`: the client certificate.
    pub(crate) cert: Option<String>,
    /// `keyfile`: the client certificate's key.
    pub(crate) key: Option<String>,
}

/// `url` without its TLS parameters (see [`RabbitConfig`]'s docs), and them.
///
/// # Errors
/// [`BrokerError::InvalidParam`] for one given twice, on an `amqp://` URL, or a
/// `certfile` without its `keyfile` (or the reverse).
pub(crate) fn split_tls(url: &str) -> Result<(String, TlsFiles), BrokerError> {
    let invalid = |param: &str, value: &str, reason: &str| BrokerError::InvalidParam {
        param: param.to_owned(),
        value: value.to_owned(),
        reason: reason.to_owned(),
    };
    let (url, [ca, cert, key]) =
        crate::setting::take_params(url, ["cacertfile", "certfile", "keyfile"])?;
    let files = TlsFiles { ca, cert, key };
    let tls_asked = files != TlsFiles::default();
    if tls_asked && crate::tls::scheme_asks_for_tls(&url).is_none() {
        let (param, value) = [
            ("cacertfile", &files.ca),
            ("certfile", &files.cert),
            ("keyfile", &files.key),
        ]
        .into_iter()
        .find_map(|(p, v)| v.as_deref().map(|v| (p, v)))
        .unwrap_or_default();
        return Err(invalid(param, value, "a TLS file needs an amqps:// URL"));
    }
    match (&files.cert, &files.key) {
        (Some(c), None) => return Err(invalid("certfile", c, "needs keyfile, its private key")),
        (None, Some(k)) => return Err(invalid("keyfile", k, "needs certfile, its certificate")),
        _ => {}
    }
    Ok((url, files))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_files_are_taken_out_of_the_url() {
        let (url, files) =
            split_tls("amqps://h:5671/%2f?heartbeat=5&cacertfile=%2Fetc%2Fca.pem&certfile=c.pem&keyfile=k.pem")
                .unwrap();
        assert_eq!(url, "amqps://h:5671/%2f?heartbeat=5");
        assert_eq!(files.ca.as_deref(), Some("/etc/ca.pem"));
        assert_eq!(
            (files.cert.as_deref(), files.key.as_deref()),
            (Some("c.pem"), Some("k.pem"))
        );
        assert_eq!(split_tls("amqps://h/%2f").unwrap().0, "amqps://h/%2f");
        assert_eq!(
            split_tls("amqps://h/%2f?cacertfile=a").unwrap().0,
            "amqps://h/%2f"
        );
        for (url, param, reason) in [
            ("amqp://h/%2f?cacertfile=a", "cacertfile", "amqps://"),
            ("amqps://h/%2f?certfile=a", "certfile", "keyfile"),
            ("amqps://h/%2f?keyfile=a", "keyfile", "certfile"),
            (
                "amqps://h/%2f?cacertfile=a&cacertfile=b",
                "cacertfile",
                "more than once",
            ),
        ] {
            crate::setting::assert_refused(split_tls(url), url, param, reason);
        }
    }

    fn read(query: &str) -> Result<RabbitConfig, BrokerError> {
        RabbitConfig::from_url(
            &BrokerUrl::parse(&format!("amqp://h:5672/%2f{query}"))?,
            "q",
        )
    }

    #[test]
    fn defaults_and_every_setting() {
        let d = read("").unwrap();
        assert_eq!(d.url, "amqp://h:5672/%2f");
        assert_eq!(d.name, "q");
        assert_eq!((d.queue_type, d.delivery_limit), (QueueType::Quorum, 20));
        assert_eq!(d.confirm_timeout, Duration::from_secs(30));
        d.check().expect("the defaults are declarable");
        let c = read("?queue_type=quorum&delivery_limit=1&confirm_timeout=2s").unwrap();
        assert_eq!((c.queue_type, c.delivery_limit), (QueueType::Quorum, 1));
        assert_eq!(c.confirm_timeout, Duration::from_secs(2));
        assert_eq!(c.url, "amqp://h:5672/%2f");
        let c = read("?delivery_limit=7").unwrap();
        assert_eq!(c.delivery_limit, 7);
        let c = read("?queue_type=classic").unwrap();
        assert_eq!(c.queue_type, QueueType::Classic);
        // lapin's own parameters stay in its URL
        let c = read("?heartbeat=10&queue_type=classic").unwrap();
        assert_eq!(c.url, "amqp://h:5672/%2f?heartbeat=10");
    }

    /// A quorum delivery limit of 0 is refused however it is set; a classic queue has
    /// none to check.
    #[test]
    fn a_quorum_delivery_limit_of_zero_is_refused() {
        let c = RabbitConfig::new("amqp://h/%2f", "q").with_delivery_limit(0);
        crate::setting::assert_refused(
            c.check(),
            "with_delivery_limit(0)",
            "delivery_limit",
            "4.x",
        );
        RabbitConfig::new("amqp://h/%2f", "q")
            .with_queue_type(QueueType::Classic)
            .with_delivery_limit(0)
            .check()
            .expect("a classic queue declares no limit");
    }

    #[test]
    fn bad_values_name_their_parameter() {
        for (query, param, reason) in [
            ("?queue_type=stream", "queue_type", "quorum or classic"),
            ("?queue_type=", "queue_type", "quorum or classic"),
            ("?delivery_limit=many", "delivery_limit", "whole number"),
            ("?delivery_limit=-1", "delivery_limit", "whole number"),
            // No "none": 4.x would apply its default of 20 (see `delivery_limit`).
            ("?delivery_limit=0", "delivery_limit", "from 1"),
            ("?confirm_timeout=0s", "confirm_timeout", "at least 1ms"),
            ("?confirm_timeout=soon", "confirm_timeout", "duration"),
            (
                "?delivery_limit=4294967296",
                "delivery_limit",
                "whole number",
            ),
            (
                "?queue_type=classic&delivery_limit=5",
                "delivery_limit",
                "classic queue",
            ),
            ("?delivery_limt=5", "delivery_limt", "unknown parameter"),
        ] {
            crate::setting::assert_refused(read(query), query, param, reason);
        }
    }
}
