//! `/metrics`, `/healthz` and `/readyz`: the [`Endpoint`], its [`ReadyCheck`]s, and [`serve`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use idem_engine::StoreError;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::{BacklogCollector, BacklogProbe, STORE_TIMEOUT};

/// One check of `/readyz`.
///
/// Contract: [`check`](Self::check) answers within a few seconds (the endpoint gives it
/// [`STORE_TIMEOUT`] and reports a slower one as failed), has no side effect a repeated
/// scrape would notice, and its error names what is not ready without a secret (it is
/// served to whoever can reach the endpoint).
#[async_trait]
pub trait ReadyCheck: Send + Sync {
    /// What is checked (`store`, `broker`): the first word of its line in `/readyz`.
    fn name(&self) -> &str;

    /// `Ok` when ready; else why not.
    async fn check(&self) -> Result<(), String>;
}

/// A [`ReadyCheck`] set from outside: the broker's delivery stream is connected, say
/// ([`watch`](Self::watch) each stream the consumer connects). Clones share one flag.
/// Starts not ready.
#[derive(Debug, Clone)]
pub struct Connected {
    name: Arc<str>,
    flag: Arc<AtomicBool>,
}

impl Connected {
    /// A flag named `name`, not set.
    pub fn new(name: &str) -> Self {
        Self {
            name: Arc::from(name),
            flag: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Sets the flag.
    pub fn set(&self, up: bool) {
        self.flag.store(up, Ordering::Release);
    }

    /// The flag itself, for whoever sets it.
    pub fn flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.flag)
    }

    /// `stream` (a broker's deliveries), reporting through this flag: set now, cleared
    /// when the stream yields an error, ends or is dropped. Give the gate (or
    /// [`supervise`](crate::supervise::supervise)) the watched stream.
    pub fn watch<S>(&self, stream: S) -> Watched<S> {
        self.set(true);
        Watched {
            inner: Box::pin(stream),
            flag: Arc::clone(&self.flag),
        }
    }
}

/// A stream watched by a [`Connected`] flag ([`Connected::watch`]).
pub struct Watched<S> {
    inner: std::pin::Pin<Box<S>>,
    flag: Arc<AtomicBool>,
}

impl<S> std::fmt::Debug for Watched<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("connected", &self.flag.load(Ordering::Acquire))
            .finish_non_exhaustive()
    }
}

impl<S, T, E> futures::Stream for Watched<S>
where
    S: futures::Stream<Item = Result<T, E>>,
{
    type Item = Result<T, E>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        if matches!(polled, std::task::Poll::Ready(None | Some(Err(_)))) {
            self.flag.store(false, Ordering::Release);
        }
        polled
    }
}

impl<S> Drop for Watched<S> {
    fn drop(&mut self) {
        self.flag.store(false, Ordering::Release);
    }
}

#[async_trait]
impl ReadyCheck for Connected {
    fn name(&self) -> &str {
        &self.name
    }

    async fn check(&self) -> Result<(), String> {
        if self.flag.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err("not connected".to_owned())
        }
    }
}

/// The store's readiness: its outbox backlog can be measured (a query that reads the
/// outbox's index; the same the scrape runs).
struct StoreReachable(Arc<OnceLock<Arc<dyn BacklogProbe>>>);

#[async_trait]
impl ReadyCheck for StoreReachable {
    fn name(&self) -> &str {
        "store"
    }

    async fn check(&self) -> Result<(), String> {
        let Some(probe) = self.0.get() else {
            return Err("not open yet".to_owned());
        };
        probe.backlog().await.map(|_| ()).map_err(|e| match e {
            StoreError::Unavailable { .. } => "unreachable".to_owned(),
            StoreError::Degraded { .. } => "degraded".to_owned(),
            StoreError::Config(_) => "misconfigured".to_owned(),
            _ => "failing".to_owned(),
        })
    }
}

/// An HTTP answer of the [`Endpoint`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The status code: 200, 404, 405 or 503.
    pub status: u16,
    /// The `Content-Type`.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
}

impl Response {
    fn text(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }

    fn reason(&self) -> &'static str {
        match self.status {
            200 => "OK",
            404 => "Not Found",
            405 => "Method Not Allowed",
            503 => "Service Unavailable",
            _ => "",
        }
    }
}

/// What the endpoint serves: `/metrics` (the collectors registered in its registry, then
/// the outbox backlog once a [`BacklogProbe`] is set), `/healthz` and `/readyz`.
pub struct Endpoint {
    registry: Registry,
    backlog: Arc<OnceLock<Arc<dyn BacklogProbe>>>,
    checks: Mutex<Vec<Arc<dyn ReadyCheck>>>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").finish_non_exhaustive()
    }
}

impl Endpoint {
    /// An endpoint serving `registry`, ready (no check) until checks are added.
    pub fn new(registry: Registry) -> Self {
        Self {
            registry,
            backlog: Arc::default(),
            checks: Mutex::new(Vec::new()),
        }
    }

    /// From now on every scrape measures the outbox backlog through `probe`, and
    /// `/readyz` checks that the store answers it (the first call wins). Until then
    /// `/readyz` reports the store as not open.
    pub fn set_backlog(&self, probe: Arc<dyn BacklogProbe>) {
        let _ = self.backlog.set(probe);
    }

    /// The store's readiness, the backlog probe of [`set_backlog`](Self::set_backlog):
    /// call it before the store is open to report it as not open yet.
    pub fn check_store(&self) {
        self.add_check(StoreReachable(Arc::clone(&self.backlog)));
    }

    /// Adds a check to `/readyz`.
    pub fn add_check(&self, check: impl ReadyCheck + 'static) {
        self.checks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::new(check));
    }

    /// The Prometheus text of this scrape.
    pub async fn metrics(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_text::encode(&mut text, &self.registry);
        if let Some(probe) = self.backlog.get() {
            let mut scrape = Registry::default();
            scrape.register_collector(Box::new(BacklogCollector::measure(probe.as_ref()).await));
            let _ = prometheus_text::encode(&mut text, &scrape);
        }
        text
    }

    /// `/readyz`: 200 `ready` when every check passes, else 503 with a line per check
    /// (`store: ok`, `broker: not connected`).
    pub async fn readyz(&self) -> Response {
        let checks = self
            .checks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let results = futures::future::join_all(checks.iter().map(|c| async move {
            let r = tokio::time::timeout(STORE_TIMEOUT, c.check())
                .await
                .unwrap_or_else(|_| Err("no answer in time".to_owned()));
            (c.name().to_owned(), r)
        }))
        .await;
        if results.iter().all(|(_, r)| r.is_ok()) {
            return Response::text(200, "ready\n");
        }
        let body: String = results
            .iter()
            .map(|(name, r)| match r {
                Ok(()) => format!("{name}: ok\n"),
                Err(why) => format!("{name}: {why}\n"),
            })
            .collect();
        Response::text(503, body)
    }

    /// The answer to `method path` (the query is ignored): `/metrics` (and `/`),
    /// `/healthz` (200 `ok` while the process answers), `/readyz`; 404 for another path,
    /// 405 for a method other than `GET` or `HEAD`.
    pub async fn respond(&self, method: &str, path: &str) -> Response {
        if method != "GET" && method != "HEAD" {
            return Response::text(405, "GET or HEAD\n");
        }
        match path.split('?').next().unwrap_or_default() {
            "/" | "/metrics" => Response {
                status: 200,
                content_type: prometheus_text::CONTENT_TYPE,
                body: self.metrics().await,
            },
            "/healthz" => Response::text(200, "ok\n"),
            "/readyz" => self.readyz().await,
            _ => Response::text(404, "/metrics, /healthz or /readyz\n"),
        }
    }
}

/// Binds `addr` now (a taken port is an error here, not later) and answers HTTP requests
/// on it with [`Endpoint::respond`], in the background, until the runtime ends. Returns
/// the bound address (for port 0, the port chosen).
///
/// # Errors
/// The address cannot be bound.
pub async fn serve(addr: SocketAddr, endpoint: Arc<Endpoint>) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let mut stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: do not spin.
                    tracing::warn!(target: "idem::metrics", error = %e, "accepting a metrics connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let endpoint = Arc::clone(&endpoint);
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let n = match tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf))
                    .await
                {
                    Ok(Ok(n)) => n,
                    _ => return,
                };
                let request = String::from_utf8_lossy(&buf[..n]);
                let mut words = request.lines().next().unwrap_or_default().split(' ');
                let (method, path) = (
                    words.next().unwrap_or_default(),
                    words.next().unwrap_or("/"),
                );
                let r = endpoint.respond(method, path).await;
                let body = if method == "HEAD" {
                    ""
                } else {
                    r.body.as_str()
                };
                let response = format!(
                    "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    r.status,
                    r.reason(),
                    r.content_type,
                    r.body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok(bound)
}
