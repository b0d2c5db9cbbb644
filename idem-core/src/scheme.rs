//! URL schemes read the same way by every crate that connects: here, the plain-TCP twin
//! of a Redis TLS scheme (`idem-store-redis` and `idem-broker`'s Redis Streams both read a
//! TLS URL through it, with a TLS connector of their own).

/// For a Redis URL whose scheme asks for TLS (`rediss`, `rediss-cluster`,
/// `valkeys-sentinel`, …), the same URL with the scheme's plain-TCP twin (`redis`,
/// `redis-cluster`, `valkey-sentinel`, …); `None` for any other. The scheme is compared
/// case-insensitively and the twin is lowercase; the rest of the URL is kept as it is.
///
/// ```
/// use idem_core::scheme::plain_twin;
/// assert_eq!(plain_twin("rediss://h:6380/0").as_deref(), Some("redis://h:6380/0"));
/// assert_eq!(
///     plain_twin("VALKEYS-sentinel://h/m").as_deref(),
///     Some("valkey-sentinel://h/m")
/// );
/// assert_eq!(plain_twin("redis://h"), None);
/// ```
pub fn plain_twin(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    let twin = ["rediss", "valkeys"].into_iter().find_map(|tls| {
        let suffix = scheme.strip_prefix(tls)?;
        Some(format!("{}{suffix}", &tls[..tls.len() - 1]))
    })?;
    Some(format!("{twin}://{rest}"))
}
