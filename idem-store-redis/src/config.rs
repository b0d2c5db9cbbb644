//! [`RedisConfig`]: where the server is, which keys are ours, and how long things live.

use std::time::Duration;

use crate::error::RedisError;
use crate::tls::{self, TlsFiles};

/// Which Redis client library talks to the server. Each variant exists only with its
/// feature; [`ClientKind::default`] is redis-rs when that feature is on (it is the default
/// feature), `fred` otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClientKind {
    /// The `fred` crate (feature `fred`): standalone servers and Redis Cluster. A batch
    /// claim on one server is one `EVAL` of a Lua loop.
    #[cfg(feature = "fred")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fred")))]
    Fred,
    /// The `redis` crate, a.k.a. redis-rs (feature `redis-rs`, the default): standalone
    /// servers and Redis Cluster. A batch claim is one pipeline of native `SET`s.
    #[cfg(feature = "redis-rs")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis-rs")))]
    RedisRs,
}

impl Default for ClientKind {
    #[cfg(feature = "redis-rs")]
    fn default() -> Self {
        Self::RedisRs
    }

    #[cfg(all(not(feature = "redis-rs"), feature = "fred"))]
    fn default() -> Self {
        Self::Fred
    }
}

/// How to reach Redis and how this crate uses it.
///
/// ```
/// use std::time::Duration;
/// use idem_store_redis::RedisConfig;
///
/// let config = RedisConfig::new("redis://127.0.0.1:6379")
///     .with_key_prefix("grants:")
///     .with_lease(Duration::from_secs(60));
/// assert!(config.validate().is_ok());
/// assert!(RedisConfig::new("redis://127.0.0.1:6379").with_key_prefix("bad {prefix}").validate().is_err());
/// ```
///
/// # URL forms
/// - `redis://[user:password@]host[:port][/db]`: one server;
/// - `redis-cluster://host:port,host:port,...` or fred's own
///   `redis-cluster://host:port?node=host:port&node=host:port`: a Redis Cluster (any
///   subset of its nodes; the client discovers the rest). Both clients support it.
///
/// # TLS
/// A `rediss://` (or `rediss-cluster://`) URL connects with TLS (feature `tls`: rustls,
/// verifying the server's certificate and host name) or not at all: without the feature
/// it is refused, never downgraded to plain TCP. The server is verified against the
/// system's roots (`SSL_CERT_FILE` / `SSL_CERT_DIR` name others), or against these PEM
/// files from the URL's query
/// (`rediss://:password@redis.internal:6380/0?cacertfile=/etc/idem/redis-ca.pem`):
///
/// | parameter | value |
/// |---|---|
/// | `cacertfile` | the CA certificates trusted instead of the system's roots |
/// | `certfile` | a client certificate (chain), with `keyfile`, for `tls-auth-clients yes` |
/// | `keyfile` | the client certificate's private key (PKCS#8, SEC1 or PKCS#1) |
///
/// The fred client is handed a rustls configuration that names the `ring` provider:
/// nothing is installed process-wide, and an application may install its own provider
/// before or after connecting. redis-rs takes no rustls configuration: it builds one from
/// rustls's process-wide default at each TLS connection, so when none is installed, the
/// `ring` provider is installed as that default just before redis-rs first connects over
/// TLS (never for a plain TCP connection). An application that wants another provider, or
/// installs its own after connecting, installs it before the first TLS connection of a
/// redis-rs client, or uses the fred client.
///
/// Keys are `{key_prefix}l:{64 hex}` (leases and their done-marks),
/// `{key_prefix}f:{scope}:{64 hex}` (front-filter marks, scoped to a store's identity or
/// to one filter) and `{key_prefix}fs:{store id}` (the highest identity session seen). The prefix may not contain `{` or `}`,
/// so no hash tag pins all keys to one cluster slot: keys spread over the cluster, and
/// every command touches one key (batches are pipelines, never multi-key commands) so
/// nothing ever crosses a slot.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisConfig {
    /// The server or cluster URL (see above).
    pub url: String,
    /// Prepended to every key: 1 to 64 printable ASCII characters, without spaces, hash-tag
    /// braces `{}` or glob characters `*?[]`. Default `idem:`.
    pub key_prefix: String,
    /// How long a claim's lease lives unless committed, rolled back or extended
    /// (default 30 s). A crashed worker's claim becomes free again after this.
    pub lease: Duration,
    /// How long a done-mark (a committed lease, or a front-filter mark) is kept
    /// (default 7 days). A redelivery later than this is processed again.
    pub retention: Duration,
    /// The most one command (or one pipelined round trip) may take before it fails with
    /// a retryable timeout (default 200 ms: the front filter must never slow the durable
    /// path down by more).
    pub timeout: Duration,
    /// The client library.
    pub client: ClientKind,
    /// How often a front filter on a store's identity
    /// ([`RedisFilter::connect_for_store`](crate::RedisFilter::connect_for_store))
    /// registers a new identity session, which is what notices a store restored or
    /// failed over under a running consumer (default 5 s).
    pub identity_heartbeat: Duration,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self::new("redis://127.0.0.1:6379")
    }
}

impl std::fmt::Debug for RedisConfig {
    /// The URL with its secrets hidden ([`idem_core::redact_url`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &idem_core::Redacted(&self.url))
            .field("key_prefix", &self.key_prefix)
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .field("timeout", &self.timeout)
            .field("client", &self.client)
            .field("identity_heartbeat", &self.identity_heartbeat)
            .finish_non_exhaustive()
    }
}

impl RedisConfig {
    /// The default prefix.
    pub const DEFAULT_PREFIX: &'static str = "idem:";
    /// The default lease.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
    /// The default retention of done-marks.
    pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
    /// The default per-command timeout.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(200);
    /// The default identity heartbeat of a front filter.
    pub const DEFAULT_IDENTITY_HEARTBEAT: Duration = Duration::from_secs(5);

    /// A configuration for `url` with every default.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            key_prefix: Self::DEFAULT_PREFIX.to_owned(),
            lease: Self::DEFAULT_LEASE,
            retention: Self::DEFAULT_RETENTION,
            timeout: Self::DEFAULT_TIMEOUT,
            client: ClientKind::default(),
            identity_heartbeat: Self::DEFAULT_IDENTITY_HEARTBEAT,
        }
    }

    /// Sets [`identity_heartbeat`](RedisConfig::identity_heartbeat).
    #[must_use]
    pub fn with_identity_heartbeat(mut self, every: Duration) -> Self {
        self.identity_heartbeat = every;
        self
    }

    /// Sets the key prefix.
    #[must_use]
    pub fn with_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Sets the lease.
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the retention of done-marks.
    #[must_use]
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the per-command timeout.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the client library.
    #[must_use]
    pub fn with_client(mut self, client: ClientKind) -> Self {
        self.client = client;
        self
    }

    /// Whether the URL names a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        let scheme = self.url.split("://").next().unwrap_or("");
        scheme.ends_with("-cluster")
    }

    /// Checks the prefix, the durations and the URL's form.
    ///
    /// # Errors
    /// [`RedisError::Config`] naming the problem.
    pub fn validate(&self) -> Result<(), RedisError> {
        self.validate_settings()?;
        tls::check_compiled(&self.url)?;
        self.normalized_url().map(|_| ())
    }

    /// [`validate`](Self::validate) without the URL: for a client the application built
    /// itself, whose own configuration says where and how to connect.
    pub(crate) fn validate_settings(&self) -> Result<(), RedisError> {
        validate_prefix(&self.key_prefix)?;
        for (name, d) in [
            ("lease", self.lease),
            ("retention", self.retention),
            ("timeout", self.timeout),
            ("identity_heartbeat", self.identity_heartbeat),
        ] {
            if d.as_millis() == 0 {
                return Err(RedisError::Config(format!("{name} must be at least 1 ms")));
            }
            if d.as_millis() > i64::MAX as u128 {
                return Err(RedisError::Config(format!("{name} is too long")));
            }
        }
        Ok(())
    }

    /// The URL in the form the client libraries parse: a comma-separated cluster node
    /// list becomes fred's `?node=` form.
    pub(crate) fn normalized_url(&self) -> Result<String, RedisError> {
        let Some((scheme, rest)) = self.url.split_once("://") else {
            return Err(RedisError::Config(
                "the Redis URL needs a scheme (redis://, rediss://, redis-cluster://)".into(),
            ));
        };
        let url = if self.is_cluster() && rest.contains(',') {
            let (hosts, query) = match rest.split_once('?') {
                Some((h, q)) => (h, Some(q)),
                None => (rest, None),
            };
            let hosts = hosts.trim_end_matches('/');
            let mut nodes = hosts.split(',').map(str::trim).filter(|s| !s.is_empty());
            let first = nodes.next().unwrap_or("");
            let mut params: Vec<String> = nodes.map(|n| format!("node={n}")).collect();
            if let Some(q) = query {
                params.push(q.to_owned());
            }
            if params.is_empty() {
                format!("{scheme}://{first}")
            } else {
                format!("{scheme}://{first}?{}", params.join("&"))
            }
        } else {
            self.url.clone()
        };
        let (url, _) = split_tls(&url)?;
        url::Url::parse(&url)
            .map_err(|e| RedisError::Config(format!("the Redis URL does not parse: {e}")))?;
        Ok(url)
    }

    /// The TLS files named in the URL's query (see [`RedisConfig`]'s docs).
    pub(crate) fn tls_files(&self) -> Result<TlsFiles, RedisError> {
        split_tls(&self.url).map(|(_, files)| files)
    }

    /// A cluster URL's nodes as one `redis://` (or `rediss://`) URL each, with the
    /// credentials of the cluster URL, for redis-rs's cluster client. Accepts both forms:
    /// `redis-cluster://[user:pass@]a:1,b:2` and `redis-cluster://[user:pass@]a:1?node=b:2`.
    #[cfg_attr(not(feature = "redis-rs"), allow(dead_code))]
    pub(crate) fn cluster_nodes(&self) -> Result<Vec<String>, RedisError> {
        let url = url::Url::parse(&self.normalized_url()?)
            .map_err(|e| RedisError::Config(format!("the Redis URL does not parse: {e}")))?;
        let scheme = match url.scheme() {
            "redis-cluster" => "redis",
            "rediss-cluster" => "rediss",
            other => {
                return Err(RedisError::Config(format!(
                    "a cluster URL needs the redis-cluster:// or rediss-cluster:// scheme, not {other}://"
                )))
            }
        };
        let auth = match (url.username(), url.password()) {
            ("", None) => String::new(),
            (user, None) => format!("{user}@"),
            (user, Some(pass)) => format!("{user}:{pass}@"),
        };
        let first = match (url.host_str(), url.port()) {
            (Some(h), Some(p)) => format!("{h}:{p}"),
            (Some(h), None) => format!("{h}:6379"),
            (None, _) => return Err(RedisError::Config("a cluster URL needs a host".into())),
        };
        let mut nodes = vec![format!("{scheme}://{auth}{first}")];
        for (k, v) in url.query_pairs() {
            match k.as_ref() {
                "node" => nodes.push(format!("{scheme}://{auth}{v}")),
                other => {
                    return Err(RedisError::Config(format!(
                        "the redis-rs cluster client takes no URL parameter {other:?}"
                    )))
                }
            }
        }
        Ok(nodes)
    }

    pub(crate) fn lease_ms(&self) -> i64 {
        millis(self.lease)
    }

    pub(crate) fn retention_ms(&self) -> i64 {
        millis(self.retention)
    }

    pub(crate) fn heartbeat_ms(&self) -> i64 {
        millis(self.identity_heartbeat)
    }
}

/// `url` without its TLS parameters, and them.
fn split_tls(url: &str) -> Result<(String, TlsFiles), RedisError> {
    let Some((head, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), TlsFiles::default()));
    };
    let mut files = TlsFiles::default();
    let mut rest = Vec::new();
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let Some(slot) = files.slot(k) else {
            rest.push(pair);
            continue;
        };
        let value = url::form_urlencoded::parse(format!("v={v}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default();
        if slot.replace(value).is_some() {
            return Err(RedisError::Config(format!("{k} is given more than once")));
        }
    }
    if !files.is_empty() && !tls::scheme_asks_for_tls(url) {
        return Err(RedisError::Config(format!(
            "{} need a rediss:// URL",
            TlsFiles::PARAMS.join(", ")
        )));
    }
    if files.cert.is_some() != files.key.is_some() {
        return Err(RedisError::Config(
            "a client certificate needs both certfile and keyfile".into(),
        ));
    }
    let url = if rest.is_empty() {
        head.to_owned()
    } else {
        format!("{head}?{}", rest.join("&"))
    };
    Ok((url, files))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

fn validate_prefix(prefix: &str) -> Result<(), RedisError> {
    if prefix.is_empty() || prefix.len() > 64 {
        return Err(RedisError::Config(
            "the key prefix must be 1 to 64 characters".into(),
        ));
    }
    if let Some(c) = prefix
        .chars()
        .find(|c| !c.is_ascii_graphic() || matches!(c, '{' | '}' | '*' | '?' | '[' | ']'))
    {
        return Err(RedisError::Config(format!(
            "the key prefix may not contain {c:?} (printable ASCII only, no spaces, no hash-tag braces, no glob characters)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_validated() {
        let ok = |p: &str| RedisConfig::default().with_key_prefix(p).validate().is_ok();
        assert!(ok("idem:"));
        assert!(ok("a"));
        assert!(!ok(""));
        assert!(!ok("has space"));
        assert!(!ok("tag{x}"));
        assert!(!ok("glob*"));
        assert!(!ok("é"));
        assert!(!ok(&"x".repeat(65)));
    }

    #[test]
    fn durations_are_validated() {
        assert!(RedisConfig::default()
            .with_lease(Duration::ZERO)
            .validate()
            .is_err());
        assert!(RedisConfig::default()
            .with_timeout(Duration::from_micros(10))
            .validate()
            .is_err());
    }

    #[test]
    fn cluster_urls_are_recognised_and_normalised() {
        let c = RedisConfig::new("redis-cluster://127.0.0.1:7101,127.0.0.1:7102,127.0.0.1:7103");
        assert!(c.is_cluster());
        assert_eq!(
            c.normalized_url().unwrap(),
            "redis-cluster://127.0.0.1:7101?node=127.0.0.1:7102&node=127.0.0.1:7103"
        );
        assert_eq!(
            c.cluster_nodes().unwrap(),
            [
                "redis://127.0.0.1:7101",
                "redis://127.0.0.1:7102",
                "redis://127.0.0.1:7103"
            ]
        );
        let fred_form = RedisConfig::new("redis-cluster://u:p@10.0.0.1:7101?node=10.0.0.2:7102");
        assert_eq!(
            fred_form.cluster_nodes().unwrap(),
            ["redis://u:p@10.0.0.1:7101", "redis://u:p@10.0.0.2:7102"]
        );
        let single = RedisConfig::new("redis://127.0.0.1:6379");
        assert!(!single.is_cluster());
        assert_eq!(single.normalized_url().unwrap(), "redis://127.0.0.1:6379");
        assert!(RedisConfig::new("127.0.0.1:6379").validate().is_err());
    }
}
