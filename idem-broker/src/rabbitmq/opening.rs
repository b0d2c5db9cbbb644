//! Giving up on opening a connection ends it, lapin's I/O thread and socket included.
//!
//! lapin runs each connection on a thread of its own (`lapin-io-loop`), which connects the
//! socket and then reads and writes it until the connection ends. Nothing tells that
//! thread that its caller gave up: dropping the future of `Connection::connect*` (a
//! `connection_timeout` that passed) or a `Connection` whose `connection.close` the
//! server never answers leaves it waiting for the server for ever, with its socket. A
//! server that accepts and never answers (a RabbitMQ out of file handles), a SYN never
//! answered, or a server silent after the handshake would so cost one thread and one
//! socket at every reconnect of `idem consume` or `idem relay`, until the process runs
//! out of file handles.
//!
//! So connections opened from a URL are opened through an [`Opening`]: it connects the
//! socket as lapin does (the host resolved, TCP, then TLS for `amqps://`, with the rustls
//! configuration idem builds: [`super::tls_connector`]), keeps a duplicate of each
//! socket's handle while the connection is being set up, and, dropped without
//! [`Opening::keep`], shuts every socket down and abandons a connect still under way
//! (resolving, the TCP handshake, TLS). lapin's thread then reads the end of the stream
//! (or fails its write), ends the connection with an error and exits, closing its socket:
//! the default `ConnectionProperties` never reconnect (no backoff attempts). A kept
//! opening drops its duplicates: the connection is then lapin's alone, closed as lapin
//! closes it.

use std::io;
use std::net::Shutdown;
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError};

use futures::future::{select, Either};
use lapin::tcp::AsyncTcpStream;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};
use tokio::sync::watch;

/// The connections being opened for one purpose (one [`super::open`], or a whole setup
/// in [`super::within_connection_timeout`]): dropped before [`keep`](Self::keep), it
/// shuts their sockets down, so their I/O threads end.
pub(crate) struct Opening {
    shared: Arc<Shared>,
    kept: bool,
}

/// What an [`Opening`] shares with the connect closures it hands to lapin (which live on
/// in lapin's I/O threads).
struct Shared {
    /// `true` once the opening is given up: a connect under way stops.
    given_up: watch::Sender<bool>,
    state: Mutex<State>,
}

enum State {
    /// Being opened: a duplicate of each connected socket's handle.
    Opening(Vec<std::net::TcpStream>),
    /// Kept: the connections are lapin's alone.
    Kept,
    /// Given up: every socket shut down, and any connected later too.
    GivenUp,
}

impl std::fmt::Debug for Opening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opening").finish_non_exhaustive()
    }
}

impl Opening {
    pub(crate) fn new() -> Self {
        Self {
            shared: Arc::new(Shared {
                given_up: watch::Sender::new(false),
                state: Mutex::new(State::Opening(Vec::new())),
            }),
            kept: false,
        }
    }

    /// Opens a connection to `uri` as `Connection::connect_with_config` does (default
    /// properties, lapin's default runtime), with TLS through `tls` for `amqps://`, its
    /// socket part of this opening.
    pub(crate) async fn connect(&self, uri: AMQPUri, tls: Tls) -> lapin::Result<Connection> {
        let runtime = lapin::runtime::default_runtime()?;
        let shared = Arc::clone(&self.shared);
        Connection::connector(
            uri,
            runtime,
            async move |uri, runtime| {
                let mut given_up = shared.given_up.subscribe();
                let connecting = async {
                    let addrs =
                        runtime.to_socket_addrs((uri.authority.host.clone(), uri.authority.port));
                    let stream = AsyncTcpStream::connect(&runtime, addrs).await?;
                    if let AsyncTcpStream::Plain(tcp) = &stream {
                        shared.register(duplicate(tcp.get_ref())?)?;
                    }
                    match uri.scheme {
                        AMQPScheme::AMQP => Ok(stream),
                        AMQPScheme::AMQPS => into_tls(stream, &uri.authority.host, &tls).await,
                    }
                };
                let giving_up =
                    async move { given_up.wait_for(|given_up| *given_up).await.map(drop) };
                match select(pin!(connecting), pin!(giving_up)).await {
                    Either::Left((connected, _)) => connected.map_err(lapin::Error::from),
                    Either::Right(_) => Err(given_up_error().into()),
                }
            },
            ConnectionProperties::default(),
        )
        .await
    }

    /// The connections stay open, lapin's alone: the duplicated handles are closed (the
    /// sockets are not shut down).
    pub(crate) fn keep(mut self) {
        self.kept = true;
        *self.shared.lock() = State::Kept;
    }

    /// Makes `other`'s connections part of this opening: shut down if this one is given
    /// up, kept with it.
    pub(crate) fn adopt(&self, mut other: Opening) {
        other.kept = true;
        let adopted = std::mem::replace(&mut *other.shared.lock(), State::Kept);
        if let State::Opening(sockets) = adopted {
            for socket in sockets {
                self.shared.register(socket).ok();
            }
        }
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        self.shared.given_up.send_replace(true);
        if let State::Opening(sockets) = std::mem::replace(&mut *self.shared.lock(), State::GivenUp)
        {
            for socket in sockets {
                // lapin's thread reads the end of the stream, or fails its next write.
                socket.shutdown(Shutdown::Both).ok();
            }
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `socket` (a duplicate handle) until the opening is kept or given up; given
    /// up already, shuts it down and fails.
    fn register(&self, socket: std::net::TcpStream) -> io::Result<()> {
        match &mut *self.lock() {
            State::Opening(sockets) => sockets.push(socket),
            State::Kept => {}
            State::GivenUp => {
                socket.shutdown(Shutdown::Both).ok();
                return Err(given_up_error());
            }
        }
        Ok(())
    }
}

/// The TLS connector of `amqps://` connections: rustls over the configuration idem builds
/// ([`super::tls_connector`]), never one lapin builds from rustls's process default.
#[cfg(feature = "tls")]
pub(crate) type Tls = Option<lapin::tcp::RustlsConnector>;

/// Without the `tls` feature there is none: an `amqps://` URL is refused before
/// connecting.
#[cfg(not(feature = "tls"))]
pub(crate) type Tls = Option<std::convert::Infallible>;

/// `stream` upgraded to TLS with `tls`, for `host`.
#[cfg(feature = "tls")]
async fn into_tls<S>(
    stream: AsyncTcpStream<S>,
    host: &str,
    tls: &Tls,
) -> io::Result<AsyncTcpStream<S>>
where
    S: futures::io::AsyncRead + futures::io::AsyncWrite + Send + Unpin + 'static,
{
    match tls {
        Some(connector) => stream.into_rustls(connector, host).await,
        None => Err(no_tls()),
    }
}

/// Without the `tls` feature: an error (`amqps://` is refused before connecting).
#[cfg(not(feature = "tls"))]
#[allow(clippy::unused_async)] // the TLS build's signature
async fn into_tls<S>(_: AsyncTcpStream<S>, _: &str, _: &Tls) -> io::Result<AsyncTcpStream<S>>
where
    S: futures::io::AsyncRead + futures::io::AsyncWrite + Send + Unpin + 'static,
{
    Err(no_tls())
}

fn no_tls() -> io::Error {
    io::Error::other("amqps:// without a TLS configuration")
}

fn given_up_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the connection's opening was given up (connection_timeout)",
    )
}

/// A second handle on `socket`'s connection, to shut it down with.
#[cfg(unix)]
fn duplicate(socket: &impl std::os::fd::AsFd) -> io::Result<std::net::TcpStream> {
    Ok(socket.as_fd().try_clone_to_owned()?.into())
}

/// A second handle on `socket`'s connection, to shut it down with.
#[cfg(windows)]
fn duplicate(socket: &impl std::os::windows::io::AsSocket) -> io::Result<std::net::TcpStream> {
    Ok(socket.as_socket().try_clone_to_owned()?.into())
}
