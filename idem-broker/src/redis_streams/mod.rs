//! Redis Streams through fred (feature `redis-streams`).
//!
//! - **Names**: a `NAME` is a stream key with a consumer group (default `idem`), created
//!   with `MKSTREAM` if missing, starting at the stream's first entry. An entry's body is
//!   its [`PAYLOAD_FIELD`] field; every other field is a header.
//! - **Consuming** ([`RedisStreamsConsumer`]): `XREADGROUP … >` for new entries, and
//!   `XAUTOCLAIM` so a live consumer takes over the pending entries of a stopped one once
//!   they have been idle for [`RedisStreamsConfig::min_idle`]. Every entry a consumer
//!   holds (read, buffered or in work) has its idle time reset every third of `min_idle`
//!   (`XCLAIM … JUSTID` by its owner, in a script that skips entries no longer assigned
//!   to it), so `XAUTOCLAIM` never takes a live entry. A delivery's attempt is the
//!   pending entry's delivery count (1 for a new entry; read with `XPENDING` after a
//!   takeover). At connect, consumers of the group with nothing pending and idle past
//!   [`RedisStreamsConfig::forget_after`] are removed (atomically, in a script).
//!   [`RedisStreamsAcker`]:
//!   `ack` → `XACK` (one `XACK` for a whole batch in
//!   [`ack_all`](idem_core::Acker::ack_all)); `nack(delay)` → the entry stays pending and
//!   its idle time is set (`XCLAIM … IDLE`) so it is reclaimed after `delay`;
//!   `dead_letter` → `XADD NAME.dead-letter` with the payload, the original fields and
//!   the reason in the [`DEAD_LETTER_REASON_HEADER`](crate::DEAD_LETTER_REASON_HEADER)
//!   field, then `XACK` (a failed `XADD` leaves the entry pending, taken again after
//!   `min_idle`; one refused for good, `WRONGTYPE` or `NOPERM`, is a
//!   [`BrokerError::Config`] as an [`AckError::config`](idem_core::AckError::config),
//!   and the consumer loop stops). An acker dropped unsettled stops its keep-alive; the
//!   entry is taken over after `min_idle`.
//! - **Publishing** ([`RedisStreamsPublisher`]): `XADD` with the payload, the event id in
//!   the [`EVENT_ID_HEADER`](idem_core::outbox::EVENT_ID_HEADER) field and the event type
//!   (pipelined, then every reply awaited).
//! - **Your own client**: [`RedisStreamsConsumer::from_client`] and
//!   [`RedisStreamsPublisher::from_client`] take a `fred::clients::Client` the
//!   application configured as it likes (TLS, credentials or a credential provider,
//!   cluster or sentinel servers, reconnect policy, tracing). The publisher sends through
//!   that client; the consumer opens two connections of its own with its configuration
//!   (one blocks reading). [`RedisStreamsConsumer::connect`] and
//!   [`RedisStreamsPublisher::connect`] build the client from the URL and call them.
//! - **Counting** ([`pending_count`]): the group's lag (entries not yet delivered) plus
//!   its pending entries list (delivered, not acked).
//! - **URL parameters** (`redis://127.0.0.1:6379/0?min_idle=5s`, read by
//!   [`RedisStreamsConfig::from_url`], whose table gives their defaults and values):
//!   `group` (default `idem`), `consumer` (default unique per process), `min_idle`
//!   (default `30s`), `block` (default `1s`), `forget_after` (default `1h`) and
//!   `command_timeout` (default `10s`). fred reads no query parameters from a `redis://`
//!   URL: any other is an error.
//! - **Timeouts**: every command waits at most [`RedisStreamsConfig::command_timeout`]
//!   for the server's answer, the blocking `XREADGROUP` its block time more; then it
//!   fails with [`BrokerError::Timeout`]. A frozen server
//!   (stopped, swapping, behind a network that drops packets) ends the consumer's stream
//!   with that error (a supervisor reconnects) and fails acks, nacks and dead-letters
//!   with a retryable `AckError` instead of hanging them; an entry whose `XACK` failed
//!   stays pending and is taken over after `min_idle`.
//! - **TLS**: `rediss://` connects with TLS (feature `tls`, rustls) verifying the server
//!   against the system's roots (`SSL_CERT_FILE` / `SSL_CERT_DIR` name others). Without
//!   the feature a `rediss://` URL is refused, never downgraded to plain TCP.
//!
//! Durability is the server's: with `appendonly yes` (and `appendfsync always` for
//! zero loss) an acknowledged `XADD` survives a restart.

mod config;
mod consumer;
mod publisher;

pub use config::{RedisStreamsConfig, DEFAULT_COMMAND_TIMEOUT};
pub use consumer::{RedisStreamsAcker, RedisStreamsConsumer};
pub use publisher::{pending_count, publish_raw, RedisStreamsPublisher};

use std::time::Duration;

use fred::prelude::*;

use crate::BrokerError;

pub(crate) const BROKER: &str = "redis";

/// The stream field that holds an entry's body.
pub const PAYLOAD_FIELD: &str = "payload";

pub(crate) fn check_name(name: &str) -> Result<(), BrokerError> {
    if name.is_empty() {
        return Err(BrokerError::invalid_name(name, "empty"));
    }
    Ok(())
}

/// A fred error as a [`BrokerError`]: [`BrokerError::Timeout`] when the command went
/// unanswered for `after`, otherwise an operation error.
pub(crate) fn redis_err(action: &'static str, after: Duration, e: Error) -> BrokerError {
    if matches!(e.kind(), ErrorKind::Timeout) {
        BrokerError::Timeout {
            broker: BROKER,
            action,
            after,
        }
    } else {
        BrokerError::op(BROKER, action, e)
    }
}

/// Connects to `url` as [`client_for`] configures it, with [`DEFAULT_COMMAND_TIMEOUT`].
pub(crate) async fn connect(url: &str) -> Result<Client, BrokerError> {
    let client = client_for(url, DEFAULT_COMMAND_TIMEOUT)?;
    init(&client).await?;
    Ok(client)
}

/// A client for `url`, not connected yet (what the URL constructors hand to
/// `from_client`): with TLS for `rediss://`, refused without the `tls` feature (fred
/// itself would connect in plain TCP); a 5 s connection timeout, reconnection with
/// backoff, and every command timed out after `command_timeout` unless it sets its own
/// timeout.
pub(crate) fn client_for(url: &str, command_timeout: Duration) -> Result<Client, BrokerError> {
    crate::tls::check_compiled(url)?;
    Builder::from_config(config_of(url)?)
        .with_connection_config(|c| {
            c.connection_timeout = Duration::from_secs(5);
        })
        .with_performance_config(|p| {
            p.default_command_timeout = command_timeout;
        })
        .set_policy(ReconnectPolicy::new_exponential(0, 50, 2_000, 2))
        .build()
        .map_err(|e| BrokerError::InvalidUrl(e.to_string()))
}

/// fred's configuration of `url`.
///
/// For a TLS scheme (`rediss`, `rediss-cluster`, `valkeys`, …) fred's `Config::from_url`
/// would build its own rustls configuration with `rustls::ClientConfig::builder()`, which
/// takes rustls's process-wide default provider and, with one provider compiled in,
/// installs it. So the URL is read with the scheme's plain-TCP twin (`redis`,
/// `redis-cluster`, `valkey`, …: fred reads the same server, credentials and database from
/// it, the scheme choosing only the deployment and whether to use TLS), and the TLS
/// connector is idem's (`fred_tls_config`).
fn config_of(url: &str) -> Result<Config, BrokerError> {
    let invalid = |e: Error| BrokerError::InvalidUrl(e.to_string());
    match crate::tls::plain_twin(url) {
        #[cfg(feature = "tls")]
        Some(plain) => {
            let mut config = Config::from_url(&plain).map_err(invalid)?;
            config.tls = Some(fred_tls_config()?.into());
            Ok(config)
        }
        // Refused by `check_compiled` before.
        #[cfg(not(feature = "tls"))]
        Some(_) => Err(crate::tls::not_compiled("rediss")),
        None => Config::from_url(url).map_err(invalid),
    }
}

/// The rustls configuration of a `rediss://` client: the `ring` provider named in it
/// ([`crate::tls::client_config`]), the system's roots (`SSL_CERT_FILE` / `SSL_CERT_DIR`
/// name others; an error loading them is an error, as in fred's own configuration), no
/// client certificate.
#[cfg(feature = "tls")]
fn fred_tls_config() -> Result<rustls::ClientConfig, BrokerError> {
    let invalid = |e: String| BrokerError::InvalidUrl(format!("TLS: {e}"));
    let system = crate::tls::system_roots();
    if let Some(e) = system.errors.first() {
        return Err(invalid(format!("the system's root certificates: {e}")));
    }
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(system.certs);
    crate::tls::client_config(roots, None).map_err(|e| invalid(e.to_string()))
}

/// A new client with `template`'s configuration (server, TLS, credentials, connection
/// settings, reconnect policy) and `command_timeout` for every command, connected.
pub(crate) async fn connect_like(
    template: &Client,
    command_timeout: Duration,
) -> Result<Client, BrokerError> {
    let client = template.clone_new();
    let mut perf = client.perf_config();
    perf.default_command_timeout = command_timeout;
    client.update_perf_config(perf);
    init(&client).await?;
    Ok(client)
}

/// Connects `client` (fred's `init`).
async fn init(client: &Client) -> Result<(), BrokerError> {
    client
        .init()
        .await
        .map(drop)
        .map_err(|e| BrokerError::connect(BROKER, e))
}

/// Creates the group at the stream's start (and the stream), unless it exists.
pub(crate) async fn ensure_group(
    client: &Client,
    name: &str,
    group: &str,
) -> Result<(), BrokerError> {
    let r: Result<Value, Error> = client.xgroup_create(name, group, "0", true).await;
    match r {
        Ok(_) => Ok(()),
        // The server's error code for "group exists".
        Err(e) if e.details().starts_with("BUSYGROUP") => Ok(()),
        Err(e) => Err(BrokerError::op(BROKER, "XGROUP CREATE", e)),
    }
}
