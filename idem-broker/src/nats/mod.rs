//! NATS JetStream through async-nats (feature `nats`).
//!
//! - **Names**: a `NAME` is a JetStream stream on subject `NAME`, file storage, created if
//!   missing. JetStream stream names cannot contain `.`, so the stream is named after the
//!   subject with `.` replaced by `_` ([`stream_name`]): the dead letters of `grants` are
//!   on subject `grants.dead-letter`, in the stream `grants_dead-letter`.
//! - **Consuming** ([`NatsConsumer`]): a durable pull consumer (default name `idem`,
//!   explicit acks, [`NatsConfig::ack_wait`] and [`NatsConfig::max_deliver`], default 20,
//!   above the core's `max_attempts`). An existing durable is read, never rewritten: a
//!   different ack policy, ack wait or `max_deliver` is a [`BrokerError::Config`].
//!   [`NatsAcker`] confirms every settlement (the ack is a request; the server's reply is
//!   awaited): `ack` → a double ack; `dead_letter` → a confirmed publish to
//!   `NAME.dead-letter` with the reason in the
//!   [`DEAD_LETTER_REASON_HEADER`](crate::DEAD_LETTER_REASON_HEADER) header, then `+TERM`
//!   (no more redeliveries; a failed publish hands the delivery back after 5 s, as a nack;
//!   one the dead-letter stream refuses for good, over its `max_msg_size`, is a
//!   [`BrokerError::Config`] as an [`AckError::config`](idem_core::AckError::config): the
//!   delivery is left unsettled, and the consumer loop stops).
//!   Missed heartbeats (a server that stays down) end the stream with an error, so a
//!   supervisor reconnects and its timeout applies.
//! - **The prefetch** ([`NatsConfig::prefetch`]; `idem consume` asks 2 × concurrency ×
//!   batch size): how many received deliveries may wait for the gate. The consumer pulls
//!   only as many as it has room for (a new pull request once half is free) and reads
//!   each one as it arrives. The durable's `max_ack_pending` (set when it is created:
//!   twice the prefetch, at least 1,000, shared by every process of the durable) bounds
//!   all unsettled deliveries, held ones included.
//! - **What counts a delivery**: the server counts one each time it sends a message —
//!   the first time, and each redelivery. From the moment a delivery is received until
//!   it is settled — waiting in the prefetch, in the gate's hands, or held after a nack —
//!   the consumer sends `+WPI` (progress) for it every third of the ack wait, so the
//!   server redelivers only what this process lost: a crash, a lost connection, an acker
//!   dropped unsettled. A nack with a delay (a transient failure, a store outage) and a
//!   deferral ([`NatsAcker::defer`]: a key held by another transaction) are held by the
//!   consumer and handed back into its own stream after the delay: they cost no server
//!   delivery, so no wait of the gate — a key held for minutes, a store down for ten —
//!   ends a message at `max_deliver`. Only a nack without a delay is a `-NAK`, which the
//!   server counts. A delivery's attempt is the server's delivery count plus the nacks
//!   this process handed back (the same number a `-NAK` for each would have made); a
//!   deferral adds nothing. After a restart the attempt is the server's count again
//!   (handed-back nacks are forgotten: a few more attempts, never fewer).
//! - **The server's limit** (`max_deliver`): a backstop for a message that kills the
//!   process (the gate never sees it fail) — past it the server delivers the message no
//!   more, and it stays in the stream, unacked, not dead-lettered. Each such message is
//!   announced by the server's `MAX_DELIVERIES` advisory, which the consumer logs (a
//!   warning with the stream sequence) and counts ([`NatsConsumer::max_deliveries`]).
//! - **Publishing** ([`NatsPublisher`]): each outbox event with its id both as
//!   `Nats-Msg-Id` (the stream's duplicate window drops a republish) and in the
//!   [`EVENT_ID_HEADER`](idem_core::outbox::EVENT_ID_HEADER) header; `publish` waits for
//!   every JetStream publish ack.
//! - **Your own client**: [`NatsConsumer::from_client`] and [`NatsPublisher::from_client`]
//!   take an `async_nats::Client` the application connected as it likes (credentials,
//!   TLS, name, event callbacks); [`NatsConsumer::connect`] and
//!   [`NatsPublisher::connect`] connect to the URL and call them.
//! - **Counting** ([`pending_count`]): the durable consumer's pending (not yet delivered)
//!   plus ack-pending (delivered, not acked) messages; the stream's messages when the
//!   durable does not exist yet (it is not created here).
//! - **URL parameters** (`nats://127.0.0.1:4222?ack_wait=5s`, read by
//!   [`NatsConfig::from_url`], whose table gives their defaults and values): `ack_wait`
//!   (default `30s`), `durable` (default `idem`) and `max_deliver` (default 20, `-1` for
//!   none). async-nats reads no query parameters: any other is an error.

mod config;
mod consumer;
mod publisher;

pub use config::{NatsConfig, DEFAULT_MAX_DELIVER};
pub use consumer::{NatsAcker, NatsConsumer};
pub use publisher::{pending_count, publish_raw, NatsPublisher};

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::BrokerError;

pub(crate) const BROKER: &str = "nats";

/// The JetStream stream that holds subject `name`: `name` with `.` replaced by `_`.
///
/// ```
/// assert_eq!(idem_broker::nats::stream_name("grants.dead-letter"), "grants_dead-letter");
/// ```
pub fn stream_name(name: &str) -> String {
    name.replace('.', "_")
}

pub(crate) fn check_name(name: &str) -> Result<(), BrokerError> {
    let bad = |reason: &str| BrokerError::invalid_name(name, reason);
    if name.is_empty() {
        return Err(bad("empty"));
    }
    if name
        .chars()
        .any(|c| c.is_whitespace() || matches!(c, '*' | '>' | '/' | '\\'))
    {
        return Err(bad(
            "a JetStream subject and stream name cannot contain whitespace, '*', '>', '/' or '\\'",
        ));
    }
    if name.starts_with('.') || name.ends_with('.') || name.contains("..") {
        return Err(bad("empty subject token"));
    }
    Ok(())
}

/// The connection's files named in a NATS URL ([`NatsConfig`]'s second table), as
/// written.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct ConnectFiles {
    creds: Option<String>,
    nkey: Option<String>,
    ca: Option<String>,
    cert: Option<String>,
    key: Option<String>,
}

fn invalid(param: &str, value: &str, reason: impl Into<String>) -> BrokerError {
    BrokerError::InvalidParam {
        param: param.to_owned(),
        value: value.to_owned(),
        reason: reason.into(),
    }
}

/// `url` without the connection's parameters, and them.
///
/// # Errors
/// [`BrokerError::InvalidParam`] for one given twice, `creds` with `nkey` (two
/// identities), or a `certfile` without its `keyfile` (or the reverse).
pub(crate) fn split_connect(url: &str) -> Result<(String, ConnectFiles), BrokerError> {
    let (url, [creds, nkey, ca, cert, key]) =
        crate::setting::take_params(url, ["creds", "nkey", "cacertfile", "certfile", "keyfile"])?;
    if let (Some(_), Some(n)) = (&creds, &nkey) {
        return Err(invalid(
            "nkey",
            n,
            "creds already names the identity: give one of them",
        ));
    }
    match (&cert, &key) {
        (Some(c), None) => return Err(invalid("certfile", c, "needs keyfile, its private key")),
        (None, Some(k)) => return Err(invalid("keyfile", k, "needs certfile, its certificate")),
        _ => {}
    }
    Ok((
        url,
        ConnectFiles {
            creds,
            nkey,
            ca,
            cert,
            key,
        },
    ))
}

/// The credentials in `url`'s user part, percent-decoded: a user and a password, or a
/// user alone, which NATS takes as a token. async-nats parses them out of the URL and
/// then ignores them (0.51 sends the options' credentials only), so they are read here.
fn url_credentials(url: &str) -> Option<(String, Option<String>)> {
    let parsed = url::Url::parse(url).ok()?;
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let user = decode(parsed.username());
    if user.is_empty() {
        return None;
    }
    Some((user, parsed.password().map(decode)))
}

/// async-nats's options for `url`'s credentials and `files`, each file read now: a
/// missing or malformed one is the caller's mistake, named, not a connection failure.
async fn connect_options(
    url: &str,
    files: &ConnectFiles,
) -> Result<async_nats::ConnectOptions, BrokerError> {
    let mut options = async_nats::ConnectOptions::new();
    match url_credentials(url) {
        Some((user, Some(password))) => options = options.user_and_password(user, password),
        Some((token, None)) => options = options.token(token),
        None => {}
    }
    if let Some(path) = &files.creds {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| invalid("creds", path, format!("not a credentials file: {e}")))?;
    }
    if let Some(path) = &files.nkey {
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid("nkey", path, format!("cannot read the file: {e}")))?;
        let seed = text
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with("SU"))
            .ok_or_else(|| invalid("nkey", path, "holds no user nkey seed (a line starting SU)"))?;
        options = options.nkey(seed.to_owned());
    }
    options = options.tls_client_config(tls_config(files)?);
    if files.ca.is_some() || files.cert.is_some() {
        options = options.require_tls(true);
    }
    Ok(options)
}

/// The TLS configuration async-nats is handed, used whenever the connection turns to TLS
/// (`tls://`, a server that requires TLS, TLS files in the URL), each file read now:
/// rustls with the `ring` provider named in it ([`crate::tls::client_config`]), so
/// async-nats builds none from rustls's process default. The roots are the URL's
/// `cacertfile`, else the system's (`SSL_CERT_FILE` / `SSL_CERT_DIR` name others); a
/// client certificate from `certfile` and `keyfile`.
///
/// An error loading the system's roots is left to async-nats, which loads them too
/// whenever it is handed a configuration and fails a TLS connection on such an error (a
/// plain one never needs them).
fn tls_config(files: &ConnectFiles) -> Result<rustls::ClientConfig, BrokerError> {
    use crate::tls::{pem_certificates, pem_private_key};
    let read = |param: &str, path: &str| {
        std::fs::read(path).map_err(|e| invalid(param, path, format!("cannot read the file: {e}")))
    };
    let mut roots = rustls::RootCertStore::empty();
    match &files.ca {
        Some(ca) => {
            let certs = pem_certificates(&read("cacertfile", ca)?)
                .map_err(|r| invalid("cacertfile", ca, r))?;
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| invalid("cacertfile", ca, format!("not a CA certificate: {e}")))?;
            }
        }
        None => {
            roots.add_parsable_certificates(crate::tls::system_roots().certs);
        }
    }
    let identity = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => Some((
            pem_certificates(&read("certfile", cert)?).map_err(|r| invalid("certfile", cert, r))?,
            pem_private_key(&read("keyfile", key)?).map_err(|r| invalid("keyfile", key, r))?,
        )),
        _ => None,
    };
    crate::tls::client_config(roots, identity).map_err(|e| match &files.cert {
        Some(cert) => invalid("certfile", cert, format!("with keyfile: {e}")),
        None => BrokerError::connect(BROKER, e),
    })
}

/// Connects to `url` (what the URL constructors hand to `from_client`), with the
/// credentials and TLS files its query names.
pub(crate) async fn connect_client(url: &str) -> Result<async_nats::Client, BrokerError> {
    let (url, files) = split_connect(url)?;
    connect_options(&url, &files)
        .await?
        .connect(url.as_str())
        .await
        .map_err(|e| BrokerError::connect(BROKER, e))
}

/// Connects to `url`, for JetStream.
pub(crate) async fn connect(url: &str) -> Result<jetstream::Context, BrokerError> {
    Ok(jetstream::new(connect_client(url).await?))
}

/// JetStream through `client`, with the stream of subject `config.name` (created if
/// missing, with `config.duplicate_window`); the name is checked first.
pub(crate) async fn open_stream(
    client: async_nats::Client,
    config: &NatsConfig,
) -> Result<(jetstream::Context, stream::Stream), BrokerError> {
    check_name(&config.name)?;
    let js = jetstream::new(client);
    let stream = ensure_stream(&js, &config.name, config.duplicate_window).await?;
    Ok((js, stream))
}

/// Gets or creates the file-backed stream for subject `name`.
pub(crate) async fn ensure_stream(
    js: &jetstream::Context,
    name: &str,
    duplicate_window: Duration,
) -> Result<stream::Stream, BrokerError> {
    js.get_or_create_stream(stream::Config {
        name: stream_name(name),
        subjects: vec![name.to_owned()],
        storage: stream::StorageType::File,
        duplicate_window,
        ..Default::default()
    })
    .await
    .map_err(|e| BrokerError::op(BROKER, "stream create", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_come_from_the_user_part_decoded() {
        assert_eq!(url_credentials("nats://127.0.0.1:4222"), None);
        assert_eq!(
            url_credentials("nats://s3cr%40t@h:4222"),
            Some(("s3cr@t".to_owned(), None))
        );
        assert_eq!(
            url_credentials("tls://u:p%3Aw@h:4222"),
            Some(("u".to_owned(), Some("p:w".to_owned())))
        );
    }

    #[test]
    fn connection_files_come_out_of_the_url_and_pair_up() {
        let (url, files) =
            split_connect("nats://h:4222?nkey=%2Fetc%2Fidem.nk&cacertfile=/ca.pem").expect("split");
        assert_eq!(url, "nats://h:4222");
        assert_eq!(files.nkey.as_deref(), Some("/etc/idem.nk"));
        assert_eq!(files.ca.as_deref(), Some("/ca.pem"));
        for bad in [
            "nats://h?creds=/a&nkey=/b",
            "nats://h?certfile=/c",
            "nats://h?keyfile=/k",
            "nats://h?nkey=/a&nkey=/b",
        ] {
            assert!(split_connect(bad).is_err(), "{bad}");
        }
    }
}
