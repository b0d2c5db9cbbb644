//! Prometheus metrics, liveness and readiness for a service that embeds idem (feature
//! `metrics`): the same collectors `idem consume --metrics-addr` and `idem relay
//! --metrics-addr` serve, for a team that runs the [`Gate`](idem_core::Gate) or the
//! [`Relay`](idem_core::Relay) inside its own service.
//!
//! - [`ConsumeMetrics`]: deliveries by outcome (`idem_deliveries_total{outcome}`), failed
//!   settlements, the gate's stage histograms (a [`GateObserver`]), commits whose ack then
//!   failed, deliveries dead-lettered after `max_attempts`, and the front filter's
//!   counters once [`set_filter`](ConsumeMetrics::set_filter) gives its [`FilterStats`];
//! - [`RelayMetrics`]: events published, batches, retries and events moved aside (a
//!   [`RelayObserver`]);
//! - [`BacklogCollector`]: the outbox backlog and the age of its oldest unpublished event,
//!   measured in the store at each scrape through a [`BacklogProbe`] (any
//!   [`OutboxSource`] through [`SourceBacklog`]);
//! - [`Endpoint`]: `/metrics` (the Prometheus text format), `/healthz` (the process
//!   answers) and `/readyz` (every [`ReadyCheck`] passes: the store reachable, the broker's
//!   delivery stream connected), answered by [`Endpoint::respond`] for a service that
//!   mounts them on its own HTTP server, or served on a port of their own by [`serve`].
//!
//! A service that keeps its own [`Registry`] registers the collectors there instead
//! ([`ConsumeMetrics::register`], [`RelayMetrics::register`]); `prometheus-client` is
//! re-exported ([`prometheus_client`]) so that both sides use one version of it.
//!
//! ```
//! use std::sync::Arc;
//! use idem_core::{Gate, GateConfig};
//! use idem_runtime::metrics::{serve, ConsumeMetrics, Connected, Endpoint, Registry};
//! use idem_testkit::{MemoryStore, SimBroker};
//! # use idem_core::{Handler, HandlerError, RejectReason, Submission, IdempotencyKey, Headers};
//! # use idem_testkit::MemoryTx;
//! # #[derive(Clone)] struct Noop;
//! # #[async_trait::async_trait]
//! # impl Handler<MemoryTx> for Noop {
//! #     type Input = ();
//! #     fn identify(&self, p: &[u8], _: &Headers) -> Result<Submission<()>, RejectReason> {
//! #         let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", p)?;
//! #         Ok(Submission { key, subject: "A-1".into(), input: () })
//! #     }
//! #     async fn handle(&self, _: &mut MemoryTx, _: &Submission<()>) -> Result<(), HandlerError> { Ok(()) }
//! # }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let metrics = Arc::new(ConsumeMetrics::default());
//! let gate = Gate::with_config(MemoryStore::new(), Noop, GateConfig::default())
//!     .with_observer(metrics.stages());
//!
//! let mut registry = Registry::default();
//! metrics.register(&mut registry);
//! let endpoint = Arc::new(Endpoint::new(registry));
//! let broker = Connected::new("broker");
//! endpoint.add_check(broker.clone());
//! let addr = serve("127.0.0.1:0".parse()?, Arc::clone(&endpoint)).await?;
//!
//! // Not ready until the broker's delivery stream is connected.
//! assert_eq!(endpoint.respond("GET", "/readyz").await.status, 503);
//! broker.set(true);
//! assert_eq!(endpoint.respond("GET", "/readyz").await.status, 200);
//!
//! let sim = SimBroker::new(1);
//! sim.publish(b"{}".to_vec());
//! let delivery = sim.receive().expect("one delivery");
//! let outcome = gate.process(delivery).await;
//! metrics.record(&outcome);
//! let text = endpoint.respond("GET", "/metrics").await.body;
//! assert!(text.contains("idem_deliveries_total{outcome=\"processed\"} 1"));
//! # let _ = addr;
//! # Ok(()) }
//! ```
//!
//! `prometheus-client` ends each help text with a period itself: help texts are registered
//! without one. It also appends `_total` to a counter's name: counters are registered
//! without it (`idem_relay_published` is served as `idem_relay_published_total`).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_core::gate::ATTEMPTS_EXHAUSTED;
use idem_core::outbox::{OutboxBacklog, OutboxSource};
use idem_core::{FilterStats, GateObserver, Outcome, RelayObserver, Stage, StoreError};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    prometheus_text, DescriptorEncoder, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
pub use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

pub use prometheus_client;

/// How long a scrape or a readiness check may wait for the store: past it, the backlog
/// is reported as unknown and the store as not ready.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(2);

/// What measures the outbox backlog at a scrape: the store, or a source over it.
#[async_trait]
pub trait BacklogProbe: Send + Sync {
    /// How many events are committed and unpublished, and the age of the oldest.
    async fn backlog(&self) -> Result<OutboxBacklog, StoreError>;
}

/// Any [`OutboxSource`] as a [`BacklogProbe`] (its [`backlog`](OutboxSource::backlog)).
#[derive(Debug, Clone)]
pub struct SourceBacklog<S>(pub S);

#[async_trait]
impl<S: OutboxSource> BacklogProbe for SourceBacklog<S> {
    async fn backlog(&self) -> Result<OutboxBacklog, StoreError> {
        self.0.backlog().await
    }
}

/// Encodes one metric of a collector.
fn encode_one(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    metric: &impl EncodeMetric,
) -> Result<(), std::fmt::Error> {
    let m = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
    metric.encode(m)
}

/// The front filter's counters, read from its [`FilterStats`] at each scrape; nothing
/// until the stats are set.
#[derive(Debug)]
struct FilterCollector(Arc<OnceLock<Arc<FilterStats>>>);

impl Collector for FilterCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(stats) = self.0.get() else {
            return Ok(());
        };
        for (name, help, value) in [
            (
                "idem_front_filter_hits",
                "Deliveries the front filter answered as already done (no store round trip).",
                stats.hits(),
            ),
            (
                "idem_front_filter_errors",
                "Front filter lookups or marks that failed (the store decided instead).",
                stats.errors(),
            ),
            (
                "idem_front_filter_bypassed",
                "Lookups skipped while the filter's circuit breaker was open.",
                stats.bypassed(),
            ),
        ] {
            encode_one(&mut encoder, name, help, &ConstCounter::new(value))?;
        }
        Ok(())
    }
}

/// The outbox backlog gauges of one scrape, measured in the store (at most
/// [`STORE_TIMEOUT`]) by [`measure`](Self::measure). When the store could not answer,
/// `idem_outbox_backlog_up` is 0 and the two gauges are left out rather than reported
/// stale.
#[derive(Debug)]
pub struct BacklogCollector(Option<OutboxBacklog>);

impl BacklogCollector {
    /// Measures the backlog through `probe` now.
    pub async fn measure(probe: &dyn BacklogProbe) -> Self {
        match tokio::time::timeout(STORE_TIMEOUT, probe.backlog()).await {
            Ok(Ok(b)) => Self(Some(b)),
            Ok(Err(e)) => {
                tracing::debug!(target: "idem::metrics", error = %e, "measuring the outbox backlog failed");
                Self(None)
            }
            Err(_) => Self(None),
        }
    }

    /// A collector of a backlog measured elsewhere (`None`: it could not be measured).
    pub fn of(backlog: Option<OutboxBacklog>) -> Self {
        Self(backlog)
    }
}

impl Collector for BacklogCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        if let Some(b) = &self.0 {
            let pending = i64::try_from(b.pending).unwrap_or(i64::MAX);
            encode_one(
                &mut encoder,
                "idem_outbox_backlog",
                "Outbox events committed but not yet published.",
                &ConstGauge::new(pending),
            )?;
            let age = b.oldest_age.map_or(0.0, |d| d.as_secs_f64());
            encode_one(
                &mut encoder,
                "idem_outbox_oldest_unpublished_age_seconds",
                "Age of the oldest unpublished outbox event (0 when none is pending).",
                &ConstGauge::new(age),
            )?;
        }
        encode_one(
            &mut encoder,
            "idem_outbox_backlog_up",
            "1 when this scrape could measure the outbox backlog in the store, else 0.",
            &ConstGauge::new(i64::from(self.0.is_some())),
        )
    }
}

/// The relay's counters: a [`RelayObserver`] (give it to
/// [`RelayOptions::observer`](idem_core::RelayOptions::observer)) and their registration.
#[derive(Debug, Default)]
pub struct RelayMetrics {
    /// Events published and marked.
    published: Counter,
    /// Batches published and marked.
    batches: Counter,
    /// Batches that failed (store or broker) and were released for another try.
    retries: Counter,
    /// Events moved aside after the broker refused them again and again.
    moved_aside: Counter,
    /// When the last batch was marked published.
    last_published: Mutex<Option<Instant>>,
}

impl RelayObserver for RelayMetrics {
    fn published(&self, events: usize) {
        self.published.inc_by(events as u64);
        self.batches.inc();
        *self
            .last_published
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
    }

    fn failed(&self, _error: &idem_core::Error, _retry_in: Duration) {
        self.retries.inc();
    }

    fn moved_aside(&self, events: u64, _reason: &str) {
        self.moved_aside.inc_by(events);
    }
}

impl RelayMetrics {
    /// Registers the counters in `registry`: `idem_relay_published_total`,
    /// `idem_relay_batches_total`, `idem_relay_retries_total`,
    /// `idem_relay_moved_aside_total`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "idem_relay_published",
            "Outbox events published to the broker and marked published",
            self.published.clone(),
        );
        registry.register(
            "idem_relay_batches",
            "Outbox batches published and marked",
            self.batches.clone(),
        );
        registry.register(
            "idem_relay_retries",
            "Outbox batches that failed (store or broker) and were retried",
            self.retries.clone(),
        );
        registry.register(
            "idem_relay_moved_aside",
            "Outbox events moved aside after the broker refused them max_publish_attempts times",
            self.moved_aside.clone(),
        );
    }

    /// When the last batch was marked published (`None`: none yet).
    pub fn last_published(&self) -> Option<Instant> {
        *self
            .last_published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The `outcome` label of `idem_deliveries_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// The `stage` label of `idem_stage_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabel {
    stage: &'static str,
}

use crate::supervise::{kind_index, KINDS};

/// A consumer's metrics: deliveries by outcome ([`record`](Self::record) each
/// [`Outcome`]), failed settlements, the gate's stage histograms ([`stages`](Self::stages),
/// the gate's observer) and the front filter's counters once
/// [`set_filter`](Self::set_filter) is called.
#[derive(Debug)]
pub struct ConsumeMetrics {
    /// `idem_deliveries_total`, one counter per outcome (all six exported from the start).
    deliveries: Family<OutcomeLabel, Counter>,
    /// The family's counters in [`KINDS`] order.
    by_kind: [Counter; 6],
    settle_failures: Counter,
    stages: Arc<StageMetrics>,
    filter: Arc<OnceLock<Arc<FilterStats>>>,
}

impl Default for ConsumeMetrics {
    fn default() -> Self {
        let deliveries = Family::<OutcomeLabel, Counter>::default();
        let by_kind = KINDS.map(|k| {
            deliveries.get_or_create_owned(&OutcomeLabel {
                outcome: k.as_str(),
            })
        });
        Self {
            deliveries,
            by_kind,
            settle_failures: Counter::default(),
            stages: Arc::default(),
            filter: Arc::default(),
        }
    }
}

impl ConsumeMetrics {
    /// Counts one settled delivery (and logs a failed settlement).
    pub fn record(&self, o: &Outcome) {
        let i = kind_index(o);
        self.by_kind[i].inc();
        if let Some(e) = o.settle_error() {
            self.settle_failures.inc();
            tracing::warn!(target: "idem::consume", outcome = o.kind().as_str(), error = %e, "settling a delivery failed");
        }
    }

    /// The front filter's counters are served from now on (the first call wins: a
    /// reconnect to the store keeps the first filter).
    pub fn set_filter(&self, stats: Arc<FilterStats>) {
        let _ = self.filter.set(stats);
    }

    /// The gate's observer feeding the stage histograms and the two counters of
    /// [`StageMetrics`] ([`Gate::with_observer`](idem_core::Gate::with_observer)).
    pub fn stages(&self) -> Arc<dyn GateObserver> {
        Arc::clone(&self.stages) as Arc<dyn GateObserver>
    }

    /// Registers everything in `registry`: `idem_deliveries_total{outcome}`,
    /// `idem_settle_failures_total`, the stage metrics and the front filter's counters.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "idem_deliveries",
            "Deliveries settled, by outcome",
            self.deliveries.clone(),
        );
        registry.register(
            "idem_settle_failures",
            "Acks, nacks or dead-letters that failed",
            self.settle_failures.clone(),
        );
        self.stages.register(registry);
        registry.register_collector(Box::new(FilterCollector(Arc::clone(&self.filter))));
    }
}

/// Bucket upper bounds, in seconds (a commit's WAL flush is ~1-5 ms; a slow handler or a
/// broker under pressure reaches seconds).
pub const BUCKETS: [f64; 14] = [
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

const STAGES: [Stage; 4] = [Stage::Claim, Stage::Handler, Stage::Commit, Stage::Ack];

/// A [`GateObserver`] recording how long each step of the gate took
/// (`idem_stage_duration_seconds{stage}`: claim, handler, commit, ack), commits whose
/// ack then failed (`idem_ack_failures_after_commit_total`) and deliveries dead-lettered
/// after `max_attempts` (`idem_attempts_exhausted_total`).
#[derive(Debug)]
pub struct StageMetrics {
    /// `idem_stage_duration_seconds`, one histogram per stage (all four exported from the
    /// start).
    family: Family<StageLabel, Histogram, fn() -> Histogram>,
    /// The family's histograms in [`STAGES`] order.
    stages: [Histogram; 4],
    ack_failures_after_commit: Counter,
    attempts_exhausted: Counter,
}

impl Default for StageMetrics {
    fn default() -> Self {
        let family: Family<StageLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(|| Histogram::new(BUCKETS));
        let stages = STAGES.map(|s| family.get_or_create_owned(&StageLabel { stage: s.as_str() }));
        Self {
            family,
            stages,
            ack_failures_after_commit: Counter::default(),
            attempts_exhausted: Counter::default(),
        }
    }
}

fn index(stage: Stage) -> usize {
    match stage {
        Stage::Claim => 0,
        Stage::Handler => 1,
        Stage::Commit => 2,
        Stage::Ack => 3,
    }
}

impl StageMetrics {
    /// Registers the histograms and the two counters in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "idem_stage_duration_seconds",
            "Time spent in each step of the gate (a batch counts once)",
            self.family.clone(),
        );
        registry.register(
            "idem_ack_failures_after_commit",
            "Commits whose ack then failed (the redelivery is skipped as a duplicate)",
            self.ack_failures_after_commit.clone(),
        );
        registry.register(
            "idem_attempts_exhausted",
            "Deliveries dead-lettered because their attempts reached --max-attempts (the reason is the last error)",
            self.attempts_exhausted.clone(),
        );
    }
}

impl GateObserver for StageMetrics {
    fn stage(&self, stage: Stage, elapsed: Duration) {
        self.stages[index(stage)].observe(elapsed.as_secs_f64());
    }

    fn outcome(&self, outcome: &Outcome) {
        match outcome {
            Outcome::Processed { settle: Err(_), .. } => {
                self.ack_failures_after_commit.inc();
            }
            Outcome::Rejected { reason, .. } if reason.code == ATTEMPTS_EXHAUSTED => {
                self.attempts_exhausted.inc();
            }
            _ => {}
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, prefix: &str) -> &'a str {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line starting {prefix:?} in\n{text}"))
    }

    /// The value of the sample `name` (labels included).
    fn value(text: &str, name: &str) -> f64 {
        line(text, &format!("{name} "))
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} has no number in\n{text}"))
    }

    fn encode(registry: &Registry) -> String {
        let mut t = String::new();
        prometheus_text::encode(&mut t, registry).unwrap();
        t
    }

    fn stage_text(m: &StageMetrics) -> String {
        let mut registry = Registry::default();
        m.register(&mut registry);
        encode(&registry)
    }

    #[test]
    fn exposition_text_has_cumulative_buckets_sum_and_count() {
        let m = StageMetrics::default();
        m.stage(Stage::Commit, Duration::from_micros(300)); // <= 0.0005
        m.stage(Stage::Commit, Duration::from_millis(3)); // <= 0.005
        m.stage(Stage::Commit, Duration::from_millis(3));
        m.stage(Stage::Commit, Duration::from_secs(30)); // +Inf only
        m.stage(Stage::Claim, Duration::from_millis(1)); // exactly on a bound: <= 0.001
        let t = stage_text(&m);

        assert!(
            t.contains(
                "# HELP idem_stage_duration_seconds Time spent in each step of the gate (a batch counts once).\n\
                 # TYPE idem_stage_duration_seconds histogram\n"
            ),
            "{t}"
        );
        assert!(
            t.contains("# TYPE idem_ack_failures_after_commit_total counter\n"),
            "{t}"
        );
        let b = |stage: &str, le: &str| {
            value(
                &t,
                &format!("idem_stage_duration_seconds_bucket{{stage=\"{stage}\",le=\"{le}\"}}"),
            )
        };
        assert_eq!(b("commit", "0.0005"), 1.0);
        assert_eq!(b("commit", "0.001"), 1.0);
        assert_eq!(b("commit", "0.005"), 3.0);
        assert_eq!(b("commit", "1"), 3.0);
        assert_eq!(b("commit", "10"), 3.0);
        assert_eq!(b("commit", "+Inf"), 4.0);
        assert_eq!(b("claim", "0.0005"), 0.0);
        assert_eq!(b("claim", "0.001"), 1.0);
        assert_eq!(b("handler", "+Inf"), 0.0);
        assert_eq!(
            value(&t, "idem_stage_duration_seconds_count{stage=\"commit\"}"),
            4.0
        );
        let sum = value(&t, "idem_stage_duration_seconds_sum{stage=\"commit\"}");
        assert!((sum - 30.0063).abs() < 1e-9, "{sum}");
        assert_eq!(
            value(&t, "idem_stage_duration_seconds_sum{stage=\"ack\"}"),
            0.0
        );
        assert_eq!(value(&t, "idem_ack_failures_after_commit_total"), 0.0);
        // Every sample line is `name{labels} value` or `name value`, value a number.
        for l in t.lines().filter(|l| !l.starts_with('#')) {
            let v = l.rsplit(' ').next().unwrap();
            assert!(v.parse::<f64>().is_ok(), "{l}");
        }
        // 4 stages x (15 buckets + sum + count) + the two counters.
        assert_eq!(
            t.lines().filter(|l| !l.starts_with('#')).count(),
            4 * 17 + 2
        );
    }

    #[tokio::test]
    async fn consume_metrics_count_outcomes_and_name_every_counter() {
        let m = ConsumeMetrics::default();
        let key = idem_core::IdempotencyKey::derive("A", "t", b"{}").unwrap();
        for _ in 0..3 {
            m.record(&Outcome::Processed {
                key,
                settle: Ok(()),
            });
        }
        m.record(&Outcome::Processed {
            key,
            settle: Err(idem_core::AckError::new("connection lost", true, None)),
        });
        let mut registry = Registry::default();
        m.register(&mut registry);
        let text = Endpoint::new(registry).metrics().await;
        assert!(
            text.contains("\nidem_deliveries_total{outcome=\"processed\"} 4\n"),
            "{text}"
        );
        for kind in KINDS.iter().skip(1) {
            let sample = format!(
                "\nidem_deliveries_total{{outcome=\"{}\"}} 0\n",
                kind.as_str()
            );
            assert!(text.contains(&sample), "{sample} in\n{text}");
        }
        for (name, kind, help) in [
            ("idem_deliveries_total", "counter", "Deliveries settled, by outcome."),
            ("idem_settle_failures_total", "counter", "Acks, nacks or dead-letters that failed."),
            (
                "idem_attempts_exhausted_total",
                "counter",
                "Deliveries dead-lettered because their attempts reached --max-attempts (the reason is the last error).",
            ),
        ] {
            let header = format!("# HELP {name} {help}\n# TYPE {name} {kind}\n");
            assert!(text.contains(&header), "{header} in\n{text}");
        }
        assert_eq!(value(&text, "idem_settle_failures_total"), 1.0);
        // No filter stats, no backlog probe: neither is served.
        assert!(!text.contains("idem_front_filter"), "{text}");
        assert!(!text.contains("idem_outbox"), "{text}");
    }

    #[test]
    fn the_filter_collector_reads_the_stats_at_each_scrape() {
        let m = ConsumeMetrics::default();
        let mut registry = Registry::default();
        m.register(&mut registry);
        assert!(!encode(&registry).contains("idem_front_filter"));
        let stats = Arc::new(FilterStats::default());
        m.set_filter(Arc::clone(&stats));
        let t = encode(&registry);
        assert!(
            t.contains(
                "# HELP idem_front_filter_hits_total Deliveries the front filter answered as already done (no store round trip).\n\
                 # TYPE idem_front_filter_hits_total counter\n\
                 idem_front_filter_hits_total 0\n"
            ),
            "{t}"
        );
        assert_eq!(value(&t, "idem_front_filter_errors_total"), 0.0);
        assert_eq!(value(&t, "idem_front_filter_bypassed_total"), 0.0);
    }

    fn backlog_text(c: BacklogCollector) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(c));
        encode(&registry)
    }

    #[test]
    fn the_backlog_collector_reports_what_it_measured_or_that_it_could_not() {
        let t = backlog_text(BacklogCollector::of(Some(OutboxBacklog {
            pending: 20,
            oldest_age: Some(Duration::from_millis(1500)),
        })));
        assert!(
            t.contains(
                "# HELP idem_outbox_backlog Outbox events committed but not yet published.\n\
                 # TYPE idem_outbox_backlog gauge\nidem_outbox_backlog 20\n"
            ),
            "{t}"
        );
        assert_eq!(value(&t, "idem_outbox_oldest_unpublished_age_seconds"), 1.5);
        assert_eq!(value(&t, "idem_outbox_backlog_up"), 1.0);
        let none = backlog_text(BacklogCollector::of(Some(OutboxBacklog {
            pending: 0,
            oldest_age: None,
        })));
        assert_eq!(
            value(&none, "idem_outbox_oldest_unpublished_age_seconds"),
            0.0
        );
        let down = backlog_text(BacklogCollector::of(None));
        assert_eq!(value(&down, "idem_outbox_backlog_up"), 0.0);
        assert!(!down.contains("idem_outbox_backlog "), "{down}");
        assert!(!down.contains("oldest"), "{down}");
    }

    #[test]
    fn relay_metrics_keep_their_names() {
        let c = RelayMetrics::default();
        assert!(c.last_published().is_none());
        c.published(5);
        c.published(2);
        c.moved_aside(1, "refused");
        let mut registry = Registry::default();
        c.register(&mut registry);
        let t = encode(&registry);
        assert_eq!(value(&t, "idem_relay_published_total"), 7.0);
        assert_eq!(value(&t, "idem_relay_batches_total"), 2.0);
        assert_eq!(value(&t, "idem_relay_retries_total"), 0.0);
        assert_eq!(value(&t, "idem_relay_moved_aside_total"), 1.0);
        assert!(
            t.contains("# TYPE idem_relay_published_total counter\n"),
            "{t}"
        );
        assert!(c.last_published().is_some());
    }

    #[test]
    fn a_failed_ack_after_commit_is_counted() {
        let m = StageMetrics::default();
        let key = idem_core::IdempotencyKey::derive("A", "t", b"{}").unwrap();
        m.outcome(&Outcome::Processed {
            key,
            settle: Ok(()),
        });
        m.outcome(&Outcome::Processed {
            key,
            settle: Err(idem_core::AckError::new("connection lost", true, None)),
        });
        assert!(stage_text(&m).contains("\nidem_ack_failures_after_commit_total 1\n"));
    }

    #[test]
    fn deliveries_dead_lettered_after_max_attempts_are_counted() {
        let m = StageMetrics::default();
        let reject = |code| Outcome::Rejected {
            reason: idem_core::RejectReason::new(code, "x"),
            settle: Ok(()),
        };
        m.outcome(&reject(ATTEMPTS_EXHAUSTED));
        m.outcome(&reject("not_json"));
        m.outcome(&reject(ATTEMPTS_EXHAUSTED));
        assert!(stage_text(&m).contains("\nidem_attempts_exhausted_total 2\n"));
    }
}
