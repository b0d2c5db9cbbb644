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
    serve, BacklogProbe, Connected, ConsumeMetrics, Endpoint, ReadyCheck, Registry,
};

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
