//! RabbitMQ through lapin (feature `rabbitmq`).
//!
//! - **Names**: a `NAME` is a durable queue, declared if missing: a quorum queue by
//!   default (`x-queue-type: quorum`, with `x-delivery-limit` 20 and at-least-once
//!   broker dead-lettering to `NAME.dead-letter` past it), a classic one with
//!   [`QueueType::Classic`] (URL `queue_type=classic`). Every role declares the same
//!   arguments; a queue that exists with others is a [`BrokerError::Config`] naming the
//!   difference (the broker's 406 `PRECONDITION_FAILED`), never redeclared. Messages are
//!   published through the default exchange with routing key `NAME`, persistent
//!   (`delivery_mode = 2`), with publisher confirms.
//! - **Consuming** ([`RabbitConsumer`]): manual acks on one channel whose prefetch
//!   (`basic.qos`) is set from the consumer's concurrency × batch size
//!   ([`RabbitConfig::prefetch_for`]). A delivery's attempt is the quorum queue's
//!   `x-delivery-count` + 1 (unknown on a classic queue). [`RabbitAcker`] settles a
//!   delivery, one step per channel: the settle lock is held from deciding (which tags
//!   are outstanding) until the frame is sent, so a multiple-ack never covers a delivery
//!   another task is rejecting.
//! - **Settle frames** (one pure function chooses them):
//!
//!   | settlement | frames |
//!   |---|---|
//!   | [`ack`](idem_core::Acker::ack) | `basic.ack` |
//!   | [`ack_all`](idem_core::Acker::ack_all) (a batch) | one `basic.ack` with `multiple = true` up to the highest tag below which every outstanding delivery is in the batch, one `basic.ack` each for the rest |
//!   | [`nack`](idem_core::Acker::nack) (a failed attempt) | `basic.reject` with `requeue = true`; with a delay, held unacked for it first (at most a minute, at most half the prefetch held; past that at once) |
//!   | [`defer`](idem_core::Acker::defer) (not the message's fault: its key held by another transaction, the store down) | none: held unacked for the delay (at most a minute) and handed back through the consumer's stream with the same attempt and headers, however many are held (deferrals that fill the prefetch stop the broker's sending: fetching stops, memory stays bounded); `basic.nack` with `requeue = true` only when the consumer is closing, or the delivery would stay unacked past 15 minutes (half RabbitMQ's default `consumer_timeout`) |
//!   | [`dead_letter`](idem_core::Acker::dead_letter) | a confirmed, persistent publish to the durable queue `NAME.dead-letter` with the reason in the [`DEAD_LETTER_REASON_HEADER`](crate::DEAD_LETTER_REASON_HEADER) header, on a connection of its own, then `basic.ack`; not confirmed within [`RabbitConfig::confirm_timeout`] (or refused), held 5 s, then `basic.reject` with `requeue = true`: never acked without a confirm |
//!   | an acker dropped unsettled | `basic.nack` with `requeue = true` |
//!
//!   Why these frames: every quorum queue counts a `basic.reject` with requeue in
//!   `x-delivery-count` (RabbitMQ 4.x maps it to `modify` with `delivery-failed`), so a
//!   failure counts towards the delivery limit on 3.x and 4.x alike; RabbitMQ 4.3+ no
//!   longer counts a `basic.nack` with requeue (3.x and 4.0–4.2 count every requeue), so
//!   a nack is kept for requeues that are nobody's failure. A deferral sends no frame at
//!   all and costs no delivery on any version. Dropping the consumer settles its held
//!   deliveries at once. A settlement on a closed channel or connection is an error.
//! - **The rule: no broker limit ends a message before the gate does.** The broker's
//!   count moves only with a failed attempt, a consumer lost holding the delivery, and (on
//!   3.x and 4.0–4.2) the rare requeue that is nobody's failure; the delivery limit is
//!   kept above the gate's `max_attempts` (default 20 against 10), always positive (4.x
//!   reads no `x-delivery-limit` as its default of 20; `0` is refused, see
//!   [`RabbitConfig::delivery_limit`]) and always with the dead-letter target, so a limit
//!   reached moves the message to `NAME.dead-letter`, never drops it.
//! - **Dead letters** are published on a second connection: RabbitMQ blocks a connection
//!   that publishes while it is low on memory or disk (and lapin then writes nothing on
//!   it), so the consumer's connection, which never publishes, keeps acking while dead
//!   letters wait for the alarm to clear (up to the confirm timeout each).
//! - A delivery whose channel closes unacked (a crash, a dropped consumer) goes back to
//!   the queue and is redelivered.
//! - **Publishing** ([`RabbitPublisher`]): each outbox event with its id in the
//!   [`EVENT_ID_HEADER`](idem_core::outbox::EVENT_ID_HEADER) header and as the AMQP
//!   `message_id`, `mandatory`, confirmed within the confirm timeout.
//! - **Your own connection**: [`RabbitConsumer::from_connection`] and
//!   [`RabbitPublisher::from_connection`] take `lapin::Connection`s the application
//!   opened as it likes (TLS, credentials, connection properties, its runtime); the
//!   consumer takes two, the second for its dead letters. [`RabbitConsumer::connect`]
//!   and [`RabbitPublisher::connect_with`] open them from the URL and call them.
//! - **Counting** ([`pending_count`]): the queue's ready messages (a passive declare).
//!   AMQP does not report unacked ones; they count again once their channel closes.
//! - **URL parameters** (`amqp://guest:guest@127.0.0.1:5672/%2f?queue_type=classic`,
//!   read by [`RabbitConfig::from_url`], whose table gives their defaults and values):
//!   `queue_type` (`quorum` or `classic`), `delivery_limit` (a quorum queue's
//!   `x-delivery-limit`, at least 1), `confirm_timeout` and `connection_timeout` (in
//!   milliseconds, default 30,000: [`DEFAULT_CONNECTION_TIMEOUT`]), which bounds the
//!   whole opening of a connection, TCP, TLS and the AMQP handshake, and from a URL the
//!   channel, confirm mode, the queue's declaration and the consumer's start with it, so
//!   a server that accepts (or completes the handshake) and then never answers is an
//!   error rather than a hang. A connection given up so (or when the caller drops the
//!   connect's future) has its socket shut down, so that lapin's I/O thread
//!   (`lapin-io-loop`), which would wait for the server for ever, ends with it; the
//!   server sees the connection closed. lapin's own `heartbeat`,
//!   `frame_max`, `channel_max` and `auth_mechanism` stay in the URL; any other
//!   parameter is an error.
//! - **TLS**: `amqps://` connects with TLS (feature `tls`, rustls) verifying the server
//!   against the system's roots and the URL's `cacertfile`; `certfile` and `keyfile`
//!   give a client certificate ([`RabbitConfig`]'s docs). Without the feature an
//!   `amqps://` URL is refused, never downgraded to plain TCP.

mod config;
mod consumer;
mod opening;
mod publisher;

pub use config::{QueueType, RabbitConfig, DEFAULT_CONFIRM_TIMEOUT, DEFAULT_DELIVERY_LIMIT};
pub use consumer::{RabbitAcker, RabbitConsumer};
pub use publisher::{pending_count, publish_raw, RabbitPublisher};

use std::time::Duration;

use lapin::options::{ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};

use crate::BrokerError;
use opening::Opening;

pub(crate) const BROKER: &str = "rabbitmq";

/// Connects to `url` as [`open`] does and reports the connection's blocking
/// ([`watch_blocking`]).
pub(crate) async fn connect(url: &str) -> Result<Connection, BrokerError> {
    let opening = Opening::new();
    let connection = open(url, &opening).await?;
    opening.keep();
    watch_blocking(&connection);
    Ok(connection)
}

/// Connects to `url`: with TLS for `amqps://` (its `cacertfile`, `certfile` and `keyfile`
/// read here), refused without the `tls` feature, within the URL's `connection_timeout`.
/// What the URL constructors hand to `from_connection`. The connection becomes part of
/// `setup` (shut down if `setup` is given up); one that fails or times out is shut down
/// here, its lapin I/O thread ended ([`opening`]).
pub(crate) async fn open(url: &str, setup: &Opening) -> Result<Connection, BrokerError> {
    crate::tls::check_compiled(url)?;
    let (url, files) = config::split_tls(url)?;
    let (url, limit) = connection_timeout(&url)?;
    let uri: lapin::uri::AMQPUri = url.parse().map_err(|e| BrokerError::connect(BROKER, e))?;
    let tls = tls_connector(&files, uri.scheme == lapin::uri::AMQPScheme::AMQPS)?;
    let this = Opening::new();
    match tokio::time::timeout(limit, this.connect(uri, tls)).await {
        Ok(Ok(connection)) => {
            setup.adopt(this);
            Ok(connection)
        }
        // `this` is dropped: a socket it opened is shut down.
        Ok(Err(e)) => Err(BrokerError::connect(BROKER, e)),
        Err(_) => Err(BrokerError::connect(
            BROKER,
            format!(
                "the server did not finish the connection's handshake within {} ms \
                 (connection_timeout): a RabbitMQ out of file handles (too many queues \
                 for its `ulimit -n`) accepts connections and never answers them",
                limit.as_millis()
            ),
        )),
    }
}

/// Runs `setup` (opening the connection, its channel, confirm mode, the queue's
/// declaration, the consumer's start) within the URL's `connection_timeout` in all: a
/// server that completes the handshake and then answers nothing (a `channel.open` left
/// unanswered) is a retryable [`BrokerError::Connect`] after it, rather than a wait for
/// ever (the relay's leased batch held open meanwhile). The connections `setup` opens
/// with [`open`] in the [`Opening`] it is given are shut down when the time is up (or
/// this future is dropped), so that their lapin I/O threads end; once `setup` returns,
/// they are closed as lapin closes them.
pub(crate) async fn within_connection_timeout<T>(
    url: &str,
    setup: impl AsyncFnOnce(&Opening) -> Result<T, BrokerError>,
) -> Result<T, BrokerError> {
    let (_, limit) = connection_timeout(url)?;
    let opening = Opening::new();
    match tokio::time::timeout(limit, setup(&opening)).await {
        Ok(done) => {
            opening.keep();
            done
        }
        // `opening` is dropped: the setup's sockets are shut down.
        Err(_) => Err(BrokerError::connect(
            BROKER,
            format!(
                "the server did not open the channel and the queue within {} ms \
                 (connection_timeout)",
                limit.as_millis()
            ),
        )),
    }
}

/// How long opening a connection from a URL ([`RabbitConsumer::connect`],
/// [`RabbitPublisher::connect_with`]) may take, TCP, TLS and the AMQP handshake together,
/// when the URL sets no `connection_timeout`; past it, a retryable
/// [`BrokerError::Connect`].
pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// The URL without its `connection_timeout` (milliseconds, as lapin reads it), and that
/// bound on the whole opening of a connection ([`DEFAULT_CONNECTION_TIMEOUT`] if absent).
/// lapin's asynchronous connect bounds nothing with it, not even the TCP connect: a
/// server that accepts and never answers (one out of file handles does) would hold the
/// handshake for ever, a SYN never answered about two minutes.
fn connection_timeout(url: &str) -> Result<(String, Duration), BrokerError> {
    let (url, [ms]) = crate::setting::take_params(url, ["connection_timeout"])?;
    let limit = match ms {
        None => DEFAULT_CONNECTION_TIMEOUT,
        Some(ms) => crate::setting::number_in(1..=u64::MAX)(&ms)
            .map(Duration::from_millis)
            .map_err(|reason| BrokerError::InvalidParam {
                param: "connection_timeout".to_owned(),
                value: ms,
                reason: format!("milliseconds: {reason}"),
            })?,
    };
    Ok((url, limit))
}

/// Logs the broker's blocking and unblocking of `connection` ([`report_blocking`]) for
/// as long as it lives.
pub(crate) fn watch_blocking(connection: &Connection) {
    let events = connection.events_listener();
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while let Some(event) = futures::StreamExt::next(&mut events).await {
            report_blocking(&event);
        }
    });
}

/// The TLS connector of an `amqps://` connection (`None` for `amqp://`), its files read
/// now: rustls with the `ring` provider named in its configuration
/// ([`crate::tls::client_config`]), so lapin builds none from rustls's process default.
/// The roots are the system's (`SSL_CERT_FILE` / `SSL_CERT_DIR` name others) and the
/// URL's `cacertfile`; a client certificate from `certfile` and `keyfile`.
#[cfg(feature = "tls")]
fn tls_connector(files: &config::TlsFiles, amqps: bool) -> Result<opening::Tls, BrokerError> {
    use crate::tls::{pem_certificates, pem_private_key};
    if !amqps {
        return Ok(None);
    }
    let invalid = |param: &str, path: &str, reason: String| BrokerError::InvalidParam {
        param: param.to_owned(),
        value: path.to_owned(),
        reason,
    };
    let read = |param: &str, path: &str| {
        std::fs::read(path).map_err(|e| invalid(param, path, format!("cannot read the file: {e}")))
    };
    let mut roots = rustls::RootCertStore::empty();
    let system = crate::tls::system_roots();
    roots.add_parsable_certificates(system.certs);
    if let Some(ca) = &files.ca {
        let certs =
            pem_certificates(&read("cacertfile", ca)?).map_err(|r| invalid("cacertfile", ca, r))?;
        roots.add_parsable_certificates(certs);
    }
    if roots.is_empty() {
        let why = system
            .errors
            .first()
            .map_or_else(|| "none found".to_owned(), ToString::to_string);
        return Err(BrokerError::connect(
            BROKER,
            format!(
                "no root certificate to verify the server with: none from the system ({why}), \
                 no cacertfile"
            ),
        ));
    }
    let identity = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => Some((
            pem_certificates(&read("certfile", cert)?).map_err(|r| invalid("certfile", cert, r))?,
            pem_private_key(&read("keyfile", key)?).map_err(|r| invalid("keyfile", key, r))?,
        )),
        _ => None,
    };
    let config = crate::tls::client_config(roots, identity).map_err(|e| match &files.cert {
        Some(cert) => invalid("certfile", cert, format!("with keyfile: {e}")),
        None => BrokerError::connect(BROKER, e),
    })?;
    Ok(Some(config.into()))
}

/// Without the `tls` feature there is no `amqps://` here (refused before) and no TLS
/// file (refused on `amqp://`).
#[cfg(not(feature = "tls"))]
#[allow(clippy::unnecessary_wraps)] // the TLS build's signature
fn tls_connector(_: &config::TlsFiles, _: bool) -> Result<opening::Tls, BrokerError> {
    Ok(None)
}

/// What a connection event tells an operator. RabbitMQ blocks a publishing connection
/// while it is low on memory or disk (a resource alarm): its publishes, their confirms
/// and so its dead letters wait, without an error, until the alarm clears. Nothing is
/// lost or acked meanwhile, but a relay, a consumer's dead letters or `idem publish`
/// stand still, so the wait is logged with the broker's reason (`connection.blocked`),
/// and its end too.
fn report_blocking(event: &lapin::Event) {
    match event {
        lapin::Event::ConnectionBlocked(reason) => {
            tracing::warn!(
                target: "idem::broker", broker = BROKER, reason = %reason,
                "the broker blocked this connection (a resource alarm: low on memory or disk); \
                 publishes, confirms and dead letters wait until it clears"
            );
        }
        lapin::Event::ConnectionUnblocked => {
            tracing::info!(target: "idem::broker", broker = BROKER, "the broker unblocked this connection");
        }
        _ => {}
    }
}

/// The arguments idem declares queue `name` with. Every role (consumer, publisher, relay,
/// a consumer of the dead letters) derives them from the name and the configuration
/// alone, so they always agree: a queue named `*.dead-letter` is a plain queue of the
/// configured type; any other quorum queue gets the delivery limit (positive:
/// [`RabbitConfig::check`] refuses 0) and dead-letters (at least once) to
/// `NAME.dead-letter` when the broker's limit is reached.
pub(crate) fn queue_args(name: &str, config: &RabbitConfig) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(config.queue_type.as_str().into()),
    );
    let is_dead_letter = name.ends_with(".dead-letter");
    if config.queue_type == QueueType::Quorum && !is_dead_letter && config.delivery_limit > 0 {
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(i64::from(config.delivery_limit)),
        );
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(crate::dead_letter_name(name).as_str().into()),
        );
        args.insert(
            "x-dead-letter-strategy".into(),
            AMQPValue::LongString("at-least-once".into()),
        );
        // At-least-once dead-lettering requires it (and no length limit is set).
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
    }
    args
}

/// Declares the durable queue `name` with [`queue_args`] (idempotent). A queue that
/// exists with other arguments (a classic queue where a quorum one is asked, another
/// delivery limit) is a [`BrokerError::Config`] naming the difference, as the broker
/// reported it; the channel is closed by the broker then.
pub(crate) async fn declare(
    channel: &Channel,
    name: &str,
    config: &RabbitConfig,
) -> Result<u32, BrokerError> {
    let q = channel
        .queue_declare(
            name.into(),
            QueueDeclareOptions::durable(),
            queue_args(name, config),
        )
        .await
        .map_err(|e| declare_error(name, config, e))?;
    Ok(q.message_count())
}

fn declare_error(name: &str, config: &RabbitConfig, e: lapin::Error) -> BrokerError {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    if let lapin::ErrorKind::ProtocolError(p) = e.kind() {
        if *p.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) {
            return BrokerError::Config {
                broker: BROKER,
                detail: format!(
                    "queue {name:?} exists with other settings than asked \
                     (queue_type={}, delivery_limit={}): {}; use the existing queue's \
                     settings in the URL (queue_type=classic for a classic queue, \
                     delivery_limit=N) or move its messages and delete it",
                    config.queue_type.as_str(),
                    config.delivery_limit,
                    p.get_message()
                ),
            };
        }
    }
    BrokerError::op(BROKER, "queue.declare", e)
}

/// A channel in confirm mode.
pub(crate) async fn confirm_channel(connection: &Connection) -> Result<Channel, BrokerError> {
    let ch = connection
        .create_channel()
        .await
        .map_err(|e| BrokerError::op(BROKER, "channel.open", e))?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| BrokerError::op(BROKER, "confirm.select", e))?;
    Ok(ch)
}

pub(crate) fn check_name(name: &str) -> Result<(), BrokerError> {
    if name.is_empty() || name.len() > 200 {
        return Err(BrokerError::invalid_name(
            name,
            "a RabbitMQ queue name is 1 to 200 bytes (room for .dead-letter)",
        ));
    }
    if name.starts_with("amq.") {
        return Err(BrokerError::invalid_name(
            name,
            "names starting with amq. are reserved by RabbitMQ",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that takes the TCP connection and never answers (RabbitMQ out of file
    /// handles does this) is a retryable connect error once `connection_timeout` passes,
    /// not a hang.
    #[tokio::test]
    async fn a_server_that_never_answers_is_a_connect_error_after_connection_timeout() {
        // Never accepted: the kernel completes the TCP handshake into the backlog.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = silent.local_addr().expect("addr").port();
        let url = format!("amqp://guest:guest@127.0.0.1:{port}/%2f?connection_timeout=300");
        let started = std::time::Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(20), open(&url, &Opening::new()))
            .await
            .expect("open returned")
            .expect_err("no handshake");
        assert!(started.elapsed() >= Duration::from_millis(300), "{err}");
        assert!(matches!(err, BrokerError::Connect { .. }), "{err:?}");
        assert!(err.is_retryable());
        let cause = std::error::Error::source(&err)
            .expect("a cause")
            .to_string();
        assert!(
            cause.contains("within 300 ms") && cause.contains("file handles"),
            "{cause}"
        );
    }

    #[test]
    fn connection_timeout_is_taken_from_the_url_and_checked() {
        let (url, limit) =
            connection_timeout("amqp://h/%2f?heartbeat=5&connection_timeout=1500").unwrap();
        assert_eq!(
            (url.as_str(), limit),
            ("amqp://h/%2f?heartbeat=5", Duration::from_millis(1500))
        );
        let (url, limit) = connection_timeout("amqp://h/%2f").unwrap();
        assert_eq!(
            (url.as_str(), limit),
            ("amqp://h/%2f", DEFAULT_CONNECTION_TIMEOUT)
        );
        for bad in ["0", "soon", "1.5", "-3"] {
            let err = connection_timeout(&format!("amqp://h/%2f?connection_timeout={bad}"))
                .expect_err(bad);
            assert!(
                matches!(&err, BrokerError::InvalidParam { param, .. } if param == "connection_timeout"),
                "{bad}: {err:?}"
            );
        }
    }
}
