//! The `--metrics-addr` endpoint of `idem consume` and `idem relay`: the library's
//! collectors and endpoint ([`idem_runtime::metrics`]) over the command's store —
//! `/metrics` (the Prometheus text format), `/healthz` and `/readyz` (consume: the store
//! answers and the broker's delivery stream is connected; relay: the store answers).

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use idem_engine::outbox::OutboxBacklog;
use idem_engine::{FilterStats, StoreError};
use idem_grant::GrantDb;
use idem_runtime::metrics::{
    serve, BacklogProbe, Connected, ConsumeMetrics, Endpoint, Registry, RelayMetrics,
};

use crate::CliError;

/// The store's outbox backlog, measured at each scrape.
struct GrantBacklog(Arc<dyn GrantDb>);

#[async_trait]
impl BacklogProbe for GrantBacklog {
    async fn backlog(&self) -> Result<OutboxBacklog, StoreError> {
        self.0.outbox_backlog().await
    }
}

/// Serves `endpoint` at `addr`; a taken port is the caller's mistake (exit 2).
async fn bind(addr: SocketAddr, endpoint: Arc<Endpoint>) -> Result<(), CliError> {
    serve(addr, endpoint)
        .await
        .map(|_| ())
        .map_err(|e| CliError::usage(format!("--metrics-addr {addr}: {e}")))
}

/// What `idem consume` counts and serves: the library's [`ConsumeMetrics`], the store's
/// backlog once it is open, and readiness (store and broker).
pub(crate) struct ConsumeEndpoint {
    pub(crate) metrics: ConsumeMetrics,
    endpoint: Arc<Endpoint>,
    /// The broker's delivery stream is connected.
    pub(crate) broker: Connected,
}

impl Default for ConsumeEndpoint {
    fn default() -> Self {
        let metrics = ConsumeMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let endpoint = Arc::new(Endpoint::new(registry));
        endpoint.check_store();
        let broker = Connected::new("broker");
        endpoint.add_check(broker.clone());
        Self {
            metrics,
            endpoint,
            broker,
        }
    }
}

impl ConsumeEndpoint {
    /// The store is open: its backlog and filter counters are served from now on (a
    /// reconnect to the store keeps the first, the same database).
    pub(crate) fn opened(&self, db: Arc<dyn GrantDb>, filter: Option<Arc<FilterStats>>) {
        self.endpoint.set_backlog(Arc::new(GrantBacklog(db)));
        if let Some(f) = filter {
            self.metrics.set_filter(f);
        }
    }

    /// Serves the endpoint at `addr`.
    pub(crate) async fn serve(&self, addr: SocketAddr) -> Result<(), CliError> {
        bind(addr, Arc::clone(&self.endpoint)).await
    }
}

/// Serves the relay's counters, the store's outbox backlog and readiness (the store) at
/// `addr`.
pub(crate) async fn serve_relay(
    addr: SocketAddr,
    counters: &RelayMetrics,
    db: Arc<dyn GrantDb>,
) -> Result<(), CliError> {
    let mut registry = Registry::default();
    counters.register(&mut registry);
    let endpoint = Arc::new(Endpoint::new(registry));
    endpoint.set_backlog(Arc::new(GrantBacklog(db)));
    endpoint.check_store();
    bind(addr, endpoint).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn consume_is_not_ready_before_the_store_and_the_broker_and_is_after() {
        let c = ConsumeEndpoint::default();
        let r = c.endpoint.respond("GET", "/readyz").await;
        assert_eq!(r.status(), 503);
        assert!(r.body().contains("store: not open yet"), "{}", r.body());
        assert!(r.body().contains("broker: not connected"), "{}", r.body());
        c.opened(Arc::new(idem_sim::MemoryStore::new()), None);
        c.broker.set(true);
        let r = c.endpoint.respond("GET", "/readyz").await;
        assert_eq!((r.status().as_u16(), r.body().as_str()), (200, "ready\n"));
        let m = c.endpoint.respond("GET", "/metrics").await;
        assert!(m.body().contains("idem_outbox_backlog 0\n"), "{}", m.body());
        assert_eq!(c.endpoint.respond("GET", "/healthz").await.status(), 200);
    }
}
