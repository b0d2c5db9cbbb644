//! The metrics endpoint of `idem_runtime::metrics` over real HTTP on loopback: `/metrics`,
//! `/healthz`, `/readyz` with each check's answer, and the codes for other paths and
//! methods.

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt as _;
use idem_engine::outbox::OutboxBacklog;
use idem_engine::StoreError;
use idem_runtime::metrics::{
    serve, BacklogProbe, Connected, ConsumeMetrics, Endpoint, EndpointService, ReadyCheck, Registry,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tower_service::Service as _;

/// `METHOD path` at `addr`: the status code, the headers and the body.
async fn request(
    addr: SocketAddr,
    method: &'static str,
    path: &'static str,
) -> (u16, String, String) {
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(format!("{method} {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())
            .expect("write");
        let mut text = String::new();
        s.read_to_string(&mut text).expect("read");
        let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
        let status = head
            .split(' ')
            .nth(1)
            .expect("a status")
            .parse()
            .expect("a code");
        (status, head.to_owned(), body.to_owned())
    })
    .await
    .expect("request")
}

/// A store probe answering `result` after `delay`.
struct Probe {
    result: Result<u64, fn() -> StoreError>,
    delay: Duration,
}

#[async_trait]
impl BacklogProbe for Probe {
    async fn backlog(&self) -> Result<OutboxBacklog, StoreError> {
        tokio::time::sleep(self.delay).await;
        match &self.result {
            Ok(n) => Ok(OutboxBacklog {
                pending: *n,
                oldest_age: None,
            }),
            Err(e) => Err(e()),
        }
    }
}

async fn endpoint_with(probe: Probe) -> (Arc<Endpoint>, Connected, SocketAddr) {
    let metrics = ConsumeMetrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let endpoint = Arc::new(Endpoint::new(registry));
    endpoint.check_store();
    endpoint.set_backlog(Arc::new(probe));
    let broker = Connected::new("broker");
    endpoint.add_check(broker.clone());
    let addr = serve("127.0.0.1:0".parse().unwrap(), Arc::clone(&endpoint))
        .await
        .expect("bind");
    (endpoint, broker, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_healthz_and_readyz_answer_over_http() {
    let (_endpoint, broker, addr) = endpoint_with(Probe {
        result: Ok(3),
        delay: Duration::ZERO,
    })
    .await;
    let (status, head, body) = request(addr, "GET", "/metrics").await;
    assert_eq!(status, 200, "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(body.contains("\nidem_outbox_backlog 3\n"), "{body}");
    assert!(
        body.contains("idem_deliveries_total{outcome=\"processed\"} 0"),
        "{body}"
    );
    assert_eq!(request(addr, "GET", "/healthz").await.0, 200);

    let (status, _, body) = request(addr, "GET", "/readyz").await;
    assert_eq!(
        (status, body.as_str()),
        (503, "store: ok\nbroker: not connected\n")
    );
    broker.set(true);
    let (status, _, body) = request(addr, "GET", "/readyz?verbose").await;
    assert_eq!((status, body.as_str()), (200, "ready\n"));

    assert_eq!(request(addr, "GET", "/other").await.0, 404);
    assert_eq!(request(addr, "POST", "/metrics").await.0, 405);
    let (status, head, body) = request(addr, "HEAD", "/healthz").await;
    assert_eq!(status, 200);
    assert!(body.is_empty(), "HEAD has no body: {body:?}");
    assert!(head.contains("Content-Length: 3"), "{head}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_fails_or_hangs_is_not_ready_and_its_backlog_unknown() {
    let (_e, broker, addr) = endpoint_with(Probe {
        result: Err(|| StoreError::Unavailable {
            message: "connection refused".into(),
            source: None,
        }),
        delay: Duration::ZERO,
    })
    .await;
    broker.set(true);
    let (status, _, body) = request(addr, "GET", "/readyz").await;
    assert_eq!(
        (status, body.as_str()),
        (503, "store: unreachable\nbroker: ok\n")
    );
    let (_, _, text) = request(addr, "GET", "/metrics").await;
    assert!(text.contains("\nidem_outbox_backlog_up 0\n"), "{text}");

    let (_e, broker, addr) = endpoint_with(Probe {
        result: Ok(0),
        delay: Duration::from_secs(3_600),
    })
    .await;
    broker.set(true);
    let started = Instant::now();
    let (status, _, body) = request(addr, "GET", "/readyz").await;
    assert_eq!(
        (status, body.as_str()),
        (503, "store: no answer in time\nbroker: ok\n")
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "bounded by its timeout"
    );
}

/// `method path` through `service` itself, no socket: the status, a header and the body.
async fn call(
    service: &mut EndpointService,
    method: &str,
    path: &str,
    header: http::header::HeaderName,
) -> (u16, Option<String>, String) {
    std::future::poll_fn(|cx| tower_service::Service::<http::Request<()>>::poll_ready(service, cx))
        .await
        .expect("ready");
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .body(())
        .expect("a request");
    let response = service.call(request).await.expect("infallible");
    let value = response
        .headers()
        .get(&header)
        .map(|v| v.to_str().expect("text").to_owned());
    (response.status().as_u16(), value, response.into_body())
}

#[tokio::test]
async fn the_endpoint_answers_as_a_tower_service_without_a_socket() {
    use http::header::{ALLOW, CONTENT_LENGTH, CONTENT_TYPE};
    let metrics = ConsumeMetrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let endpoint = Arc::new(Endpoint::new(registry));
    endpoint.check_store();
    endpoint.set_backlog(Arc::new(Probe {
        result: Ok(7),
        delay: Duration::ZERO,
    }));
    let broker = Connected::new("broker");
    endpoint.add_check(broker.clone());
    let mut service = EndpointService::new(endpoint);

    let (status, content_type, body) = call(&mut service, "GET", "/metrics", CONTENT_TYPE).await;
    assert_eq!(status, 200);
    assert_eq!(
        content_type.as_deref(),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    assert!(body.contains("\nidem_outbox_backlog 7\n"), "{body}");
    let (_, length, _) = call(&mut service, "GET", "/", CONTENT_LENGTH).await;
    assert_eq!(length, Some(body.len().to_string()), "/ is /metrics");

    let (status, length, body) = call(&mut service, "HEAD", "/healthz", CONTENT_LENGTH).await;
    assert_eq!(
        (status, length.as_deref(), body.as_str()),
        (200, Some("3"), "")
    );
    let (status, _, body) = call(&mut service, "GET", "/readyz?x=1", CONTENT_TYPE).await;
    assert_eq!(
        (status, body.as_str()),
        (503, "store: ok\nbroker: not connected\n")
    );
    broker.set(true);
    let (status, content_type, body) = call(&mut service, "GET", "/readyz", CONTENT_TYPE).await;
    assert_eq!(
        (status, content_type.as_deref(), body.as_str()),
        (200, Some("text/plain; charset=utf-8"), "ready\n")
    );
    let (status, _, body) = call(&mut service, "GET", "/nowhere", CONTENT_TYPE).await;
    assert_eq!(
        (status, body.as_str()),
        (404, "/metrics, /healthz or /readyz\n")
    );
    let (status, allow, body) = call(&mut service, "DELETE", "/metrics", ALLOW).await;
    assert_eq!(
        (status, allow.as_deref(), body.as_str()),
        (405, Some("GET, HEAD"), "GET or HEAD\n")
    );
}

/// Everything the server sends on a fresh connection after `request`, until it closes it
/// (or 10 s pass).
async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(request).await.expect("write");
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer))
        .await
        .expect("the server closes the connection")
        .expect("read");
    String::from_utf8(answer).expect("text")
}

#[tokio::test]
async fn serve_speaks_http_1_1_on_a_socket_one_request_a_connection() {
    let (_endpoint, _broker, addr) = endpoint_with(Probe {
        result: Ok(2),
        delay: Duration::ZERO,
    })
    .await;
    let get = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n").await;
    let (head, body) = get.split_once("\r\n\r\n").expect("a head and a body");
    let mut lines = head.lines();
    assert_eq!(lines.next(), Some("HTTP/1.1 200 OK"), "{head}");
    let headers: Vec<&str> = lines.collect();
    assert!(headers.contains(&"Connection: close"), "{head}");
    assert!(
        headers.contains(&format!("Content-Length: {}", body.len()).as_str()),
        "{head}"
    );
    assert!(body.contains("\nidem_outbox_backlog 2\n"), "{body}");

    // HEAD: the same head, no body; the connection closed after it.
    let head_only = exchange(addr, b"HEAD /metrics HTTP/1.1\r\nHost: t\r\n\r\n").await;
    let (head, rest) = head_only.split_once("\r\n\r\n").expect("a head");
    assert!(rest.is_empty(), "no body: {rest:?}");
    assert!(
        head.contains(&format!("Content-Length: {}", body.len())),
        "{head}"
    );

    // A request in an HTTP/1.0 client's form, and one that is not HTTP.
    let old = exchange(addr, b"GET /healthz HTTP/1.0\r\n\r\n").await;
    assert!(old.starts_with("HTTP/1.0 200 OK\r\n"), "{old}");
    assert!(old.ends_with("\r\n\r\nok\n"), "{old}");
    let garbage = exchange(addr, b"\x16\x03\x01 not http\r\n\r\n").await;
    assert!(
        garbage.starts_with("HTTP/1.1 400 Bad Request\r\n"),
        "{garbage}"
    );

    // A client that sends nothing is let go once the head's time is up.
    let started = Instant::now();
    assert_eq!(exchange(addr, b"").await, "");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_watched_stream_is_connected_until_it_fails_or_ends() {
    let broker = Connected::new("broker");
    assert!(broker.check().await.is_err());
    let items: Vec<Result<u32, &str>> = vec![Ok(1), Err("closed")];
    let mut watched = broker.watch(futures::stream::iter(items));
    assert_eq!(broker.check().await, Ok(()));
    assert_eq!(watched.next().await, Some(Ok(1)));
    assert_eq!(broker.check().await, Ok(()));
    assert_eq!(watched.next().await, Some(Err("closed")));
    assert_eq!(broker.check().await, Err("not connected".to_owned()));

    let mut again = broker.watch(futures::stream::iter(Vec::<Result<u32, &str>>::new()));
    assert_eq!(broker.check().await, Ok(()));
    assert_eq!(again.next().await, None);
    assert!(broker.check().await.is_err(), "ended");
    let dropped = broker.watch(futures::stream::iter(Vec::<Result<u32, &str>>::new()));
    drop(dropped);
    assert!(broker.check().await.is_err(), "dropped");
}
