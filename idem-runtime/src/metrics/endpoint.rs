//! `/metrics`, `/healthz` and `/readyz`: the [`Endpoint`], its [`ReadyCheck`]s, and [`serve`].

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use http::header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE};
use http::StatusCode;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use idem_engine::StoreError;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;

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

/// An answer of the [`Endpoint`]: its status, its `Content-Type` and `Content-Length`, and
/// its body (empty in the answer to `HEAD`).
pub type Response = http::Response<String>;

/// `body` as `text/plain` with `status`.
fn text(status: StatusCode, body: impl Into<String>) -> Response {
    answer(status, TEXT, body.into())
}

/// `body` with `status` and `content_type`, its length declared.
fn answer(status: StatusCode, content_type: &'static str, body: String) -> Response {
    let length = body.len();
    let mut r = http::Response::new(body);
    *r.status_mut() = status;
    let headers = r.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(CONTENT_LENGTH, HeaderValue::from(length));
    r
}

/// The `Content-Type` of every answer but `/metrics`.
const TEXT: &str = "text/plain; charset=utf-8";

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
            return text(StatusCode::OK, "ready\n");
        }
        let body: String = results
            .iter()
            .map(|(name, r)| match r {
                Ok(()) => format!("{name}: ok\n"),
                Err(why) => format!("{name}: {why}\n"),
            })
            .collect();
        text(StatusCode::SERVICE_UNAVAILABLE, body)
    }

    /// The answer to `method path` (the query is ignored): `/metrics` (and `/`),
    /// `/healthz` (200 `ok` while the process answers), `/readyz`; 404 for another path,
    /// 405 (with `Allow: GET, HEAD`) for a method other than `GET` or `HEAD`. The answer
    /// to `HEAD` is that to `GET` without its body (its `Content-Length` kept).
    pub async fn respond(&self, method: &str, path: &str) -> Response {
        if method != "GET" && method != "HEAD" {
            let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "GET or HEAD\n");
            r.headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            return r;
        }
        let mut r = match path.split('?').next().unwrap_or_default() {
            "/" | "/metrics" => answer(
                StatusCode::OK,
                prometheus_text::CONTENT_TYPE,
                self.metrics().await,
            ),
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" => self.readyz().await,
            _ => text(StatusCode::NOT_FOUND, "/metrics, /healthz or /readyz\n"),
        };
        if method == "HEAD" {
            r.body_mut().clear();
        }
        r
    }
}

/// An [`Endpoint`] as a [`tower_service::Service`] of HTTP requests, for an application
/// that mounts `/metrics`, `/healthz` and `/readyz` on its own server (a hyper server
/// through `hyper_util::service::TowerToHyperService`, an axum router through
/// `route_service`, any tower stack). It answers every request with
/// [`Endpoint::respond`] to its method and path; the request's body is not read. Always
/// ready; never fails. Clones share the endpoint.
///
/// ```
/// use std::sync::Arc;
/// use idem_runtime::metrics::{Endpoint, EndpointService, Registry};
/// use tower_service::Service as _;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let mut service = EndpointService::new(Arc::new(Endpoint::new(Registry::default())));
/// let request = http::Request::get("/healthz").body(()).unwrap();
/// let response = service.call(request).await.unwrap();
/// assert_eq!(response.status(), 200);
/// assert_eq!(response.body(), "ok\n");
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct EndpointService(Arc<Endpoint>);

impl EndpointService {
    /// The service answering with `endpoint`.
    pub fn new(endpoint: Arc<Endpoint>) -> Self {
        Self(endpoint)
    }
}

impl From<Arc<Endpoint>> for EndpointService {
    fn from(endpoint: Arc<Endpoint>) -> Self {
        Self::new(endpoint)
    }
}

impl<B> tower_service::Service<http::Request<B>> for EndpointService {
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let endpoint = Arc::clone(&self.0);
        let method = request.method().clone();
        let path = request.uri().path().to_owned();
        Box::pin(async move { Ok(endpoint.respond(method.as_str(), &path).await) })
    }
}

/// How long a client may take to send a request's head before its connection is closed.
const HEAD_TIMEOUT: Duration = Duration::from_secs(2);

/// Binds `addr` now (a taken port is an error here, not later) and answers HTTP/1.1
/// requests on it with [`Endpoint::respond`] (through hyper and an [`EndpointService`]),
/// one request a connection (`Connection: close`), in the background, until the runtime
/// ends. Returns the bound address (for port 0, the port chosen).
///
/// # Errors
/// The address cannot be bound.
pub async fn serve(addr: SocketAddr, endpoint: Arc<Endpoint>) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let service = TowerToHyperService::new(EndpointService::new(endpoint));
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: do not spin.
                    tracing::warn!(target: "idem::metrics", error = %e, "accepting a metrics connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let service = service.clone();
            tokio::spawn(async move {
                let served = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEAD_TIMEOUT)
                    .keep_alive(false)
                    .title_case_headers(true)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
                if let Err(e) = served {
                    // A client that hung up or sent no HTTP: its business.
                    tracing::debug!(target: "idem::metrics", error = %e, "a metrics connection failed");
                }
            });
        }
    });
    Ok(bound)
}
