//! A service that embeds the gate and serves idem's metrics, liveness and readiness on a
//! port of its own: `cargo run -p idem-runtime --features metrics --example
//! embedded_metrics [ADDR]` (default `127.0.0.1:9898`). It processes a few simulated
//! deliveries, prints what `/metrics`, `/healthz` and `/readyz` answer, and keeps serving
//! until Ctrl-C when `--serve` is given.

use std::io::{Read as _, Write as _};
use std::sync::Arc;

use async_trait::async_trait;
use idem_engine::{
    Gate, GateConfig, Handler, HandlerError, Headers, IdempotencyKey, RejectReason, Submission,
};
use idem_runtime::metrics::{serve, Connected, ConsumeMetrics, Endpoint, Registry, SourceBacklog};
use idem_testkit::{MemoryOutbox, MemoryStore, MemoryTx, SimBroker};

/// Each body is its own award id.
struct Awards;

#[async_trait]
impl Handler<MemoryTx> for Awards {
    type Input = ();

    fn identify(&self, payload: &[u8], _: &Headers) -> Result<Submission<()>, RejectReason> {
        let award = std::str::from_utf8(payload)
            .map_err(|_| RejectReason::new("not_utf8", "the body is not UTF-8"))?;
        let key = IdempotencyKey::derive(award, "2026-07-01T09:00:00Z", payload)?;
        Ok(Submission {
            key,
            subject: award.to_owned(),
            input: (),
        })
    }

    async fn handle(&self, _: &mut MemoryTx, _: &Submission<()>) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// `GET path` at `addr`, the whole answer.
fn get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: example\r\n\r\n").as_bytes())?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args
        .next()
        .filter(|a| a != "--serve")
        .unwrap_or_else(|| "127.0.0.1:9898".to_owned());
    let keep_serving = std::env::args().any(|a| a == "--serve");

    // The service's own store and broker (here the testkit's in-memory ones).
    let store = MemoryStore::new();
    let broker = SimBroker::new(7);

    // The collectors in a registry, the endpoint over it, and its readiness checks: the
    // store (its outbox backlog answers) and the broker (the delivery stream connected).
    let metrics = Arc::new(ConsumeMetrics::default());
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let endpoint = Arc::new(Endpoint::new(registry));
    endpoint.set_backlog(Arc::new(SourceBacklog(MemoryOutbox::new(
        store.clone(),
        std::time::Duration::from_millis(10),
    ))));
    endpoint.check_store();
    let connected = Connected::new("broker");
    endpoint.add_check(connected.clone());
    let bound = serve(addr.parse()?, Arc::clone(&endpoint)).await?;

    let gate =
        Gate::with_config(store, Awards, GateConfig::default()).with_observer(metrics.stages());
    for award in ["A-1", "A-2", "A-1"] {
        broker.publish(award.as_bytes().to_vec());
    }
    connected.set(true);
    while let Some(delivery) = broker.receive() {
        let outcome = gate.process(delivery).await;
        metrics.record(&outcome);
    }

    for path in ["/healthz", "/readyz", "/metrics"] {
        let answer = tokio::task::spawn_blocking(move || get(bound, path)).await??;
        println!("GET {path}\n{answer}\n");
    }
    if keep_serving {
        println!("serving at http://{bound}/metrics until Ctrl-C");
        tokio::signal::ctrl_c().await?;
    }
    Ok(())
}
