//! Prometheus metrics, liveness and readiness for a service that embeds idem (feature
//! `metrics`): the same collectors `idem consume --metrics-addr` and `idem relay
//! --metrics-addr` serve, for a team that runs the [`Gate`](idem_engine::Gate) or the
//! [`Relay`](idem_engine::Relay) inside its own service.
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
//!   delivery stream connected), as a `tower` service ([`EndpointService`], answering
//!   with [`Endpoint::respond`]) for a service that mounts them on its own HTTP server, or
//!   served on a port of their own by [`serve`] (an HTTP/1.1 server on hyper).
//!
//! A service that keeps its own [`Registry`] registers the collectors there instead
//! ([`ConsumeMetrics::register`], [`RelayMetrics::register`]); `prometheus-client` is
//! re-exported ([`prometheus_client`]) so that both sides use one version of it.
//!
//! ```
//! use std::sync::Arc;
//! use idem_engine::{Gate, GateConfig};
//! use idem_runtime::metrics::{serve, ConsumeMetrics, Connected, Endpoint, Registry};
//! use idem_testkit::{MemoryStore, SimBroker};
//! # use idem_engine::{Handler, HandlerError, RejectReason, Submission, IdempotencyKey, Headers};
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
//! assert_eq!(endpoint.respond("GET", "/readyz").await.status(), 503);
//! broker.set(true);
//! assert_eq!(endpoint.respond("GET", "/readyz").await.status(), 200);
//!
//! let sim = SimBroker::new(1);
//! sim.publish(b"{}".to_vec());
//! let delivery = sim.receive().expect("one delivery");
//! let outcome = gate.process(delivery).await;
//! metrics.record(&outcome);
//! let text = endpoint.respond("GET", "/metrics").await.into_body();
//! assert!(text.contains("idem_deliveries_total{outcome=\"processed\"} 1"));
//! # let _ = addr;
//! # Ok(()) }
//! ```
//!
//! `prometheus-client` ends each help text with a period itself: help texts are registered
//! without one. It also appends `_total` to a counter's name: counters are registered
//! without it (`idem_relay_published` is served as `idem_relay_published_total`).

use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_engine::gate::ATTEMPTS_EXHAUSTED;
use idem_engine::outbox::{OutboxBacklog, OutboxSource};
use idem_engine::{FilterStats, GateObserver, Outcome, RelayObserver, Stage, StoreError};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
pub use prometheus_client::registry::Registry;

pub use prometheus_client;

mod endpoint;
#[cfg(test)]
mod tests;

pub use endpoint::{serve, Connected, Endpoint, EndpointService, ReadyCheck, Response, Watched};

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
/// [`RelayOptions::observer`](idem_engine::RelayOptions::observer)) and their registration.
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

    fn failed(&self, _error: &idem_engine::Error, _retry_in: Duration) {
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
    /// [`StageMetrics`] ([`Gate::with_observer`](idem_engine::Gate::with_observer)).
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
