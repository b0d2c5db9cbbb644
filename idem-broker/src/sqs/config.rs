//! How to reach an SQS queue, how idem creates one, and its URL settings.

use std::time::Duration;

use crate::any::{BrokerKind, BrokerUrl};
use crate::setting::{duration_in, number_in, whole_seconds_in};
use crate::BrokerError;

/// The longest visibility timeout SQS allows: 12 hours.
const MAX_VISIBILITY_TIMEOUT: Duration = Duration::from_secs(43_200);

/// How long the dead-letter queue keeps a message: 14 days, the most SQS allows, so that
/// a dead letter is not dropped before someone looks at it.
pub const DEAD_LETTER_RETENTION: Duration = Duration::from_secs(1_209_600);

/// The default `maxReceiveCount` of the source's redrive policy: twice the core's default
/// `max_attempts` (10). The gate dead-letters a failing message with its reason on its
/// 10th delivery, and one that kills its consumer unrun after its 10th run; the other 10
/// receives are the margin for a message held beside such a killer (received into the
/// same process), which loses one receive per run of the killer without running. SQS
/// moves a message to the dead-letter queue only when it was received more often than
/// that without being settled.
pub const DEFAULT_MAX_RECEIVE_COUNT: u32 = 20;

/// The default of [`SqsConfig::min_receive_count`]: the core's default `max_attempts`
/// (10). An existing queue (made by you, or by your infrastructure's tooling) that moves a
/// message to the dead-letter queue after fewer receives would have SQS dead-letter
/// messages before the gate had its attempts.
pub const DEFAULT_MIN_RECEIVE_COUNT: u32 = 10;

/// The default of [`SqsConfig::connect_timeout`]: 5 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The default of [`SqsConfig::request_timeout`]: 10 s.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest [`SqsConfig::connect_timeout`] and [`SqsConfig::request_timeout`]: 5 min.
const MAX_TIMEOUT: Duration = Duration::from_secs(300);

/// An SQS queue and how to consume it.
///
/// [`from_url`](Self::from_url) reads an `sqs://` URL: its authority is the endpoint,
/// reached over TLS (`sqs://sqs.eu-west-1.amazonaws.com` and a VPC or FIPS endpoint's
/// name are `https://…`), except a loopback address (`sqs://127.0.0.1:5000` is
/// `http://127.0.0.1:5000`, such as moto on the same machine); `tls=false` asks for
/// plaintext by name (a local stand-in such as `sqs://localstack:4566?tls=false`), and
/// `tls=true` for TLS to a loopback address. `sqs://` takes the AWS configuration
/// (`AWS_ENDPOINT_URL`, or AWS itself). idem's settings ride in the URL's query
/// (`sqs://127.0.0.1:5000?visibility_timeout=10s`). Each duration is a
/// [duration](crate::parse_duration); those SQS itself counts are whole seconds:
///
/// | parameter | default | value |
/// |---|---|---|
/// | `tls` | `true`, except for a loopback address (`127.0.0.0/8`, `::1`) | `true` or `false`: whether the endpoint in the URL is reached over TLS (`https://`) |
/// | `region` | the AWS configuration's (`AWS_REGION`, the profile's, the instance's) | an AWS region such as `eu-west-1` |
/// | `visibility_timeout` | `30s` | `1s` to `12h`; kept extended while a delivery is unsettled |
/// | `wait` | `1s` | the long poll, `0s` to `20s` |
/// | `retention` | SQS's 4 days | `60s` to `14d` (`1209600`): the `MessageRetentionPeriod` of a source queue created here |
/// | `max_receive_count` | `20` ([`DEFAULT_MAX_RECEIVE_COUNT`]) | `1` to `1000`: the redrive policy's `maxReceiveCount` to `NAME.dead-letter` of a source queue created here (twice the core's `max_attempts`), and the lowest accepted on an existing queue (without it: 10, [`DEFAULT_MIN_RECEIVE_COUNT`]) |
/// | `connect_timeout` | `5s` ([`DEFAULT_CONNECT_TIMEOUT`]) | `1ms` to `5m`: the longest wait for a connection to the endpoint |
/// | `request_timeout` | `10s` ([`DEFAULT_REQUEST_TIMEOUT`]) | `1ms` to `5m`: the longest wait for an answer to one attempt of a request, beyond the long poll (`wait`) for `ReceiveMessage` |
///
/// Any other query parameter, a path, a user or a password is an error (credentials
/// come from the AWS configuration; see [the module docs](super) for how the endpoint
/// decides).
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqsConfig {
    /// The endpoint, e.g. `http://127.0.0.1:5000`; `None` takes the usual AWS
    /// configuration (`AWS_ENDPOINT_URL`, or AWS itself).
    pub endpoint: Option<String>,
    /// The logical name `NAME` (see [`queue_name`](super::queue_name) for the SQS name).
    pub name: String,
    /// The AWS region (URL option `region=`); `None` takes the AWS configuration's
    /// (`AWS_REGION`, the profile's `region`, the instance's).
    pub region: Option<String>,
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
    /// (to `NAME.dead-letter`); default [`DEFAULT_MAX_RECEIVE_COUNT`]. Give it twice the
    /// consumer's `max_attempts`: at `max_attempts` or lower, SQS would move a message
    /// before the gate had its attempts, or move one that sat beside a message killing
    /// its consumer without running it.
    pub max_receive_count: u32,
    /// The lowest `maxReceiveCount` accepted on an existing source queue (default
    /// [`DEFAULT_MIN_RECEIVE_COUNT`]; [`with_max_receive_count`](Self::with_max_receive_count)
    /// and the URL's `max_receive_count` set it to the count they ask for). Lower is a
    /// [`Config`](crate::BrokerError::Config) error; from it up to
    /// [`max_receive_count`](Self::max_receive_count) the queue is used, with a warning.
    pub min_receive_count: u32,
    /// How long connecting to the endpoint may take (default 5 s).
    pub connect_timeout: Duration,
    /// How long one attempt of a request may go unanswered (default 10 s); a
    /// `ReceiveMessage` attempt gets its long poll ([`wait`](Self::wait)) on top. The SDK
    /// tries a request up to three times; when each attempt timed out, the operation
    /// fails with [`BrokerError::Timeout`](crate::BrokerError::Timeout): an endpoint that
    /// accepts connections and never answers ends the consumer's stream, and fails an
    /// ack, instead of hanging them.
    pub request_timeout: Duration,
}

impl std::fmt::Debug for SqsConfig {
    /// The endpoint with any secret hidden ([`idem_core::redact_url`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsConfig")
            .field(
                "endpoint",
                &self.endpoint.as_deref().map(idem_core::Redacted),
            )
            .field("name", &self.name)
            .field("region", &self.region)
            .field("visibility_timeout", &self.visibility_timeout)
            .field("wait", &self.wait)
            .field("prefetch", &self.prefetch)
            .field("retention", &self.retention)
            .field("max_receive_count", &self.max_receive_count)
            .field("min_receive_count", &self.min_receive_count)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .finish_non_exhaustive()
    }
}

impl SqsConfig {
    /// idem's settings in the URL query (the table above).
    pub(crate) const URL_SETTINGS: &'static [&'static str] = &[
        "tls",
        "region",
        "visibility_timeout",
        "wait",
        "retention",
        "max_receive_count",
        "connect_timeout",
        "request_timeout",
    ];

    /// The configuration of queue `name` at `url`, with the URL's endpoint and settings
    /// (the table above) over the defaults of [`new`](Self::new).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_broker::any::BrokerUrl;
    /// use idem_broker::sqs::SqsConfig;
    /// let url = BrokerUrl::parse("sqs://127.0.0.1:5000?visibility_timeout=10s&wait=0")?;
    /// let c = SqsConfig::from_url(&url, "grants")?;
    /// assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:5000"));
    /// assert_eq!((c.visibility_timeout, c.wait), (Duration::from_secs(10), Duration::ZERO));
    /// assert_eq!(SqsConfig::from_url(&BrokerUrl::parse("sqs://")?, "grants")?.endpoint, None);
    /// # Ok::<(), idem_broker::BrokerError>(())
    /// ```
    ///
    /// # Errors
    /// [`BrokerError::InvalidParam`] naming a bad setting; [`BrokerError::InvalidUrl`]
    /// for a path or credentials in the URL, or another broker's URL.
    pub fn from_url(url: &BrokerUrl, name: impl Into<String>) -> Result<Self, BrokerError> {
        url.expect_kind(BrokerKind::Sqs)?;
        let mut c = Self::new(endpoint_of(url)?, name);
        if let Some(r) = url.setting("region", region_name)? {
            c.region = Some(r);
        }
        let secs = Duration::from_secs;
        if let Some(d) = url.setting(
            "visibility_timeout",
            whole_seconds_in(secs(1)..=MAX_VISIBILITY_TIMEOUT),
        )? {
            c.visibility_timeout = d;
        }
        if let Some(d) = url.setting("wait", whole_seconds_in(secs(0)..=secs(20)))? {
            c.wait = d;
        }
        if let Some(d) = url.setting(
            "retention",
            whole_seconds_in(secs(60)..=DEAD_LETTER_RETENTION),
        )? {
            c.retention = Some(d);
        }
        if let Some(n) = url.setting("max_receive_count", number_in(1..=1000))? {
            c = c.with_max_receive_count(n);
        }
        let timeout = || duration_in(Duration::from_millis(1)..=MAX_TIMEOUT);
        if let Some(d) = url.setting("connect_timeout", timeout())? {
            c.connect_timeout = d;
        }
        if let Some(d) = url.setting("request_timeout", timeout())? {
            c.request_timeout = d;
        }
        Ok(c)
    }

    /// A configuration with the defaults above and a prefetch of 20.
    pub fn new(endpoint: Option<String>, name: impl Into<String>) -> Self {
        Self {
            endpoint,
            name: name.into(),
            region: None,
            visibility_timeout: Duration::from_secs(30),
            wait: Duration::from_secs(1),
            prefetch: 20,
            retention: None,
            max_receive_count: DEFAULT_MAX_RECEIVE_COUNT,
            min_receive_count: DEFAULT_MIN_RECEIVE_COUNT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// Sets the AWS region (over the AWS configuration's).
    #[must_use]
    pub fn with_region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
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

    /// Sets the redrive policy's `maxReceiveCount` (1 to 1000 as SQS allows), and the
    /// lowest one accepted on an existing queue to the same: a count asked for is held.
    #[must_use]
    pub fn with_max_receive_count(mut self, n: u32) -> Self {
        self.max_receive_count = n.clamp(1, 1000);
        self.min_receive_count = self.max_receive_count;
        self
    }

    /// Sets the connect timeout (1 ms to 5 min).
    #[must_use]
    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d.clamp(Duration::from_millis(1), MAX_TIMEOUT);
        self
    }

    /// Sets the request timeout (1 ms to 5 min).
    #[must_use]
    pub fn with_request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout = d.clamp(Duration::from_millis(1), MAX_TIMEOUT);
        self
    }

    /// How long one `ReceiveMessage` attempt may take: the long poll plus the request
    /// timeout.
    pub(crate) fn receive_timeout(&self) -> Duration {
        self.wait.min(Duration::from_secs(20)) + self.request_timeout
    }
}

/// An AWS region name as the URL gives it: lower-case letters, digits and `-`.
fn region_name(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("must not be empty".to_owned());
    }
    let ok = s.len() <= 64
        && s.starts_with(|c: char| c.is_ascii_lowercase())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if ok {
        Ok(s.to_owned())
    } else {
        Err(
            "must be an AWS region name such as eu-west-1 (lower-case letters, digits, '-')"
                .to_owned(),
        )
    }
}

/// The endpoint of an `sqs://HOST[:PORT]` URL (`https://HOST[:PORT]`, or `http://` for a
/// loopback address or with `tls=false`), or `None` for the environment's (`sqs://`).
fn endpoint_of(url: &BrokerUrl) -> Result<Option<String>, BrokerError> {
    let tls = url.setting("tls", |v| match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err("must be true or false".to_owned()),
    })?;
    let u = url::Url::parse(url.client_url())
        .map_err(|e| BrokerError::InvalidUrl(format!("{url}: {e}")))?;
    if !u.username().is_empty() || u.password().is_some() {
        return Err(BrokerError::InvalidUrl(format!(
            "{url}: sqs:// takes no credentials (they come from the AWS variables)"
        )));
    }
    if !matches!(u.path(), "" | "/") {
        return Err(BrokerError::InvalidUrl(format!(
            "{url}: sqs:// takes no path (the queue is the NAME given with it)"
        )));
    }
    // `sqs` is no special scheme to the URL parser: its host comes back as text.
    let loopback_address = u
        .host_str()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
        .and_then(|h| h.parse::<std::net::IpAddr>().ok())
        .is_some_and(|ip| ip.is_loopback());
    let scheme = if tls.unwrap_or(!loopback_address) {
        "https"
    } else {
        "http"
    };
    let endpoint = u
        .host_str()
        .filter(|h| !h.is_empty())
        .map(|host| match u.port() {
            Some(p) => format!("{scheme}://{host}:{p}"),
            None => format!("{scheme}://{host}"),
        });
    if endpoint.is_none() && tls.is_some() {
        return Err(BrokerError::InvalidParam {
            param: "tls".to_owned(),
            value: url.param("tls").unwrap_or_default().to_owned(),
            reason: "applies to an endpoint named in the URL (sqs://HOST?tls=…); the AWS \
                     configuration's endpoint carries its own scheme"
                .to_owned(),
        });
    }
    Ok(endpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(url: &str) -> Result<SqsConfig, BrokerError> {
        SqsConfig::from_url(&BrokerUrl::parse(url)?, "q")
    }

    /// A named endpoint is reached over TLS (a VPC or FIPS endpoint got every signature,
    /// session token and message body in clear); a loopback address in plaintext; `tls`
    /// says otherwise either way.
    #[test]
    fn a_named_endpoint_is_tls_and_a_loopback_address_plaintext() {
        let endpoint = |u: &str| read(u).unwrap().endpoint;
        let cases = [
            (
                "sqs://vpce-1.sqs.eu-west-1.vpce.amazonaws.com",
                "https://vpce-1.sqs.eu-west-1.vpce.amazonaws.com",
            ),
            (
                "sqs://sqs-fips.us-east-1.amazonaws.com:443",
                "https://sqs-fips.us-east-1.amazonaws.com:443",
            ),
            ("sqs://localhost:4566", "https://localhost:4566"),
            ("sqs://10.0.0.7:9324", "https://10.0.0.7:9324"),
            ("sqs://127.0.0.1:5000", "http://127.0.0.1:5000"),
            ("sqs://127.8.9.1:5000", "http://127.8.9.1:5000"),
            ("sqs://[::1]:5000", "http://[::1]:5000"),
            ("sqs://localstack:4566?tls=false", "http://localstack:4566"),
            ("sqs://127.0.0.1:5443?tls=true", "https://127.0.0.1:5443"),
        ];
        for (url, want) in cases {
            assert_eq!(endpoint(url).as_deref(), Some(want), "{url}");
        }
        for bad in ["sqs://h?tls=yes", "sqs://h?tls=", "sqs://?tls=false"] {
            assert!(
                matches!(read(bad), Err(BrokerError::InvalidParam { ref param, .. }) if param == "tls"),
                "{bad}"
            );
        }
    }

    #[test]
    fn endpoint_defaults_and_every_setting() {
        let d = read("sqs://127.0.0.1:5000").unwrap();
        assert_eq!(d.endpoint.as_deref(), Some("http://127.0.0.1:5000"));
        assert_eq!(d.name, "q");
        assert_eq!(d.region, None);
        assert_eq!(d.visibility_timeout, Duration::from_secs(30));
        assert_eq!(d.wait, Duration::from_secs(1));
        assert_eq!(d.retention, None);
        assert_eq!(d.max_receive_count, DEFAULT_MAX_RECEIVE_COUNT);
        assert_eq!(d.min_receive_count, DEFAULT_MIN_RECEIVE_COUNT);
        assert_eq!(d.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(d.request_timeout, DEFAULT_REQUEST_TIMEOUT);
        assert_eq!(d.receive_timeout(), Duration::from_secs(11));
        assert_eq!(read("sqs://").unwrap().endpoint, None);
        assert_eq!(
            read("sqs://localstack").unwrap().endpoint.as_deref(),
            Some("https://localstack")
        );
        let c = read("sqs://h:1?visibility_timeout=2m&wait=0s&retention=48h&max_receive_count=3")
            .unwrap();
        assert_eq!(c.endpoint.as_deref(), Some("https://h:1"));
        assert_eq!(c.visibility_timeout, Duration::from_secs(120));
        assert_eq!(c.wait, Duration::ZERO);
        assert_eq!(c.retention, Some(Duration::from_secs(48 * 3_600)));
        assert_eq!(c.max_receive_count, 3);
        assert_eq!(c.min_receive_count, 3, "a count asked for is held");
        assert_eq!(
            read("sqs://?region=eu-west-1").unwrap().region.as_deref(),
            Some("eu-west-1")
        );
        let t = read("sqs://h:1?connect_timeout=250ms&request_timeout=2s&wait=20s").unwrap();
        assert_eq!(t.connect_timeout, Duration::from_millis(250));
        assert_eq!(t.request_timeout, Duration::from_secs(2));
        assert_eq!(t.receive_timeout(), Duration::from_secs(22));
        let edges = read("sqs://?visibility_timeout=12h&wait=20&retention=14d").unwrap();
        assert_eq!(edges.visibility_timeout, MAX_VISIBILITY_TIMEOUT);
        assert_eq!(edges.wait, Duration::from_secs(20));
        assert_eq!(edges.retention, Some(DEAD_LETTER_RETENTION));
    }

    #[test]
    fn bad_values_name_their_parameter() {
        for (query, param, reason) in [
            (
                "visibility_timeout=soon",
                "visibility_timeout",
                "invalid duration",
            ),
            (
                "visibility_timeout=0",
                "visibility_timeout",
                "from 1s to 12h",
            ),
            (
                "visibility_timeout=13h",
                "visibility_timeout",
                "from 1s to 12h",
            ),
            (
                "visibility_timeout=1500ms",
                "visibility_timeout",
                "whole number of seconds",
            ),
            ("wait=21s", "wait", "from 0s to 20s"),
            ("wait=soon", "wait", "invalid duration"),
            ("retention=59s", "retention", "from 1m to 14d"),
            ("retention=15d", "retention", "from 1m to 14d"),
            ("max_receive_count=0", "max_receive_count", "from 1 to 1000"),
            (
                "max_receive_count=1001",
                "max_receive_count",
                "from 1 to 1000",
            ),
            (
                "max_receive_count=ten",
                "max_receive_count",
                "from 1 to 1000",
            ),
            ("connect_timeout=0s", "connect_timeout", "from 1ms to 5m"),
            ("connect_timeout=6m", "connect_timeout", "from 1ms to 5m"),
            (
                "request_timeout=soon",
                "request_timeout",
                "invalid duration",
            ),
            ("request_timeout=0", "request_timeout", "from 1ms to 5m"),
            ("wait=1&wait=2", "wait", "more than once"),
            ("region=", "region", "empty"),
            ("region=EU-WEST-1", "region", "AWS region name"),
            ("region=eu_west_1", "region", "AWS region name"),
            ("region=a&region=b", "region", "more than once"),
            ("queue=q", "queue", "unknown parameter"),
        ] {
            crate::setting::assert_refused(
                read(&format!("sqs://h:1?{query}")),
                query,
                param,
                reason,
            );
        }
        for url in ["sqs://key:secret@h:1", "sqs://h:1/queue"] {
            match read(url) {
                Err(BrokerError::InvalidUrl(m)) => assert!(!m.contains("secret"), "{m}"),
                other => panic!("{url}: {other:?}"),
            }
        }
    }
}
