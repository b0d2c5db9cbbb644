//! The `--metrics-addr` endpoint of `idem consume` and `idem relay`: a tiny HTTP server
//! answering every request with the Prometheus text exposition format (version 0.0.4),
//! rendered afresh on each scrape ([`serve`]) by `prometheus-client` from a
//! [`Registry`], and the metrics it holds:
//!
//! - [`StageMetrics`], a [`GateObserver`] recording how long each step of the gate took
//!   (claim, handler, commit, ack) and how many acks failed after a successful commit;
//! - [`FilterCollector`]: the front filter's hits, errors and bypassed lookups, read from
//!   its [`FilterStats`] at scrape time;
//! - [`BacklogCollector`]: the outbox backlog and the age of its oldest unpublished
//!   event, measured in the store at each scrape;
//! - [`RelayCounters`]: events published and batches retried by the relay.
//!
//! `prometheus-client` ends each help text with a period itself: help texts are registered
//! without one. It also appends `_total` to a counter's name: counters are registered
//! without it (`idem_relay_published` is served as `idem_relay_published_total`).

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::gate::ATTEMPTS_EXHAUSTED;
use idem_core::outbox::OutboxBacklog;
use idem_core::{FilterStats, GateObserver, Outcome, OutcomeKind, Stage};
use idem_grant::GrantDb;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    prometheus_text, DescriptorEncoder, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::error::error_chain;
use crate::CliError;

/// How long a scrape may wait for the store before the backlog is reported as unknown.
const STORE_TIMEOUT: Duration = Duration::from_secs(2);

/// What an endpoint serves: the metrics registered in `registry`, then, once there is a
/// store, its outbox backlog measured at the scrape.
pub(crate) struct Exposition {
    registry: Registry,
    store: Arc<OnceLock<Arc<dyn GrantDb>>>,
}

impl Exposition {
    /// The exposition text of this scrape.
    pub(crate) async fn render(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_text::encode(&mut text, &self.registry);
        if let Some(db) = self.store.get() {
            let mut scrape = Registry::default();
            scrape.register_collector(Box::new(BacklogCollector::measure(db.as_ref()).await));
            let _ = prometheus_text::encode(&mut text, &scrape);
        }
        text
    }
}

/// Binds `addr` now (a taken port is the caller's mistake, exit 2) and serves
/// `exposition`'s text to every HTTP request on it, in the background, until the process
/// ends.
pub(crate) async fn serve(addr: SocketAddr, exposition: Exposition) -> Result<(), CliError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| CliError::usage(format!("--metrics-addr {addr}: {e}")))?;
    let exposition = Arc::new(exposition);
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
            let exposition = Arc::clone(&exposition);
            tokio::spawn(async move {
                // The request itself does not matter: every path gets the metrics.
                let mut buf = [0u8; 1024];
                let _ = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf)).await;
                let body = exposition.render().await;
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    prometheus_text::CONTENT_TYPE,
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok(())
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
/// until the store (and so the filter, if any) is open.
#[derive(Debug)]
pub(crate) struct FilterCollector(Arc<OnceLock<Arc<FilterStats>>>);

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
pub(crate) struct BacklogCollector(Option<OutboxBacklog>);

impl BacklogCollector {
    /// Measures the backlog in `db` now.
    pub(crate) async fn measure(db: &dyn GrantDb) -> Self {
        match tokio::time::timeout(STORE_TIMEOUT, db.outbox_backlog()).await {
            Ok(Ok(b)) => Self(Some(b)),
            Ok(Err(e)) => {
                tracing::debug!(target: "idem::metrics", error = %error_chain(&e), "measuring the outbox backlog failed");
                Self(None)
            }
            Err(_) => Self(None),
        }
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

/// The relay's counters, shared between its loop and the metrics endpoint.
#[derive(Debug, Default)]
pub(crate) struct RelayCounters {
    /// Events published and marked.
    published: Counter,
    /// Batches published and marked.
    batches: Counter,
    /// Batches that failed (store or broker) and were released for another try.
    retries: Counter,
    /// Events moved aside after the broker refused them again and again.
    moved_aside: Counter,
    /// When the last batch was marked published.
    pub(crate) last_published: std::sync::Mutex<Option<std::time::Instant>>,
}

impl idem_core::RelayObserver for RelayCounters {
    fn published(&self, events: usize) {
        self.published.inc_by(events as u64);
        self.batches.inc();
        let now = std::time::Instant::now();
        *self
            .last_published
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(now);
    }

    fn failed(&self, _error: &idem_core::Error, _retry_in: Duration) {
        self.retries.inc();
    }

    fn moved_aside(&self, events: u64, _reason: &str) {
        self.moved_aside.inc_by(events);
    }
}

impl RelayCounters {
    /// Registers the counters in `registry`.
    fn register(&self, registry: &mut Registry) {
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

    /// What `idem relay --metrics-addr` serves: these counters and `db`'s backlog.
    pub(crate) fn exposition(&self, db: Arc<dyn GrantDb>) -> Exposition {
        let mut registry = Registry::default();
        self.register(&mut registry);
        let store = Arc::new(OnceLock::new());
        let _ = store.set(db);
        Exposition { registry, store }
    }
}

/// Serves the relay's counters and the store's outbox backlog at `addr`.
pub(crate) async fn serve_relay(
    addr: SocketAddr,
    counters: &RelayCounters,
    db: Arc<dyn GrantDb>,
) -> Result<(), CliError> {
    serve(addr, counters.exposition(db)).await
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

const KINDS: [OutcomeKind; 6] = [
    OutcomeKind::Processed,
    OutcomeKind::Duplicate,
    OutcomeKind::Deferred,
    OutcomeKind::Rejected,
    OutcomeKind::Failed,
    OutcomeKind::Conflict,
];

/// What `idem consume --metrics-addr` serves: deliveries by outcome, settle failures,
/// the gate's stage histograms, and once the store is open the front filter's counters
/// and the outbox backlog.
pub(crate) struct ConsumeMetrics {
    /// `idem_deliveries_total`, one counter per outcome (all six exported from the start).
    deliveries: Family<OutcomeLabel, Counter>,
    /// The family's counters in [`KINDS`] order.
    by_kind: [Counter; 6],
    settle_failures: Counter,
    stages: Arc<StageMetrics>,
    filter: Arc<OnceLock<Arc<FilterStats>>>,
    store: Arc<OnceLock<Arc<dyn GrantDb>>>,
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
            store: Arc::default(),
        }
    }
}

impl ConsumeMetrics {
    /// Counts one settled delivery (and logs a failed settlement).
    pub(crate) fn record(&self, o: &Outcome) {
        let i = KINDS.iter().position(|k| *k == o.kind()).unwrap_or(4);
        self.by_kind[i].inc();
        if let Some(e) = o.settle_error() {
            self.settle_failures.inc();
            tracing::warn!(target: "idem::consume", outcome = o.kind().as_str(), error = %e, "settling a delivery failed");
        }
    }

    /// The store is open: its backlog and filter counters are served from now on (a
    /// reconnect to the store keeps the first, the same database).
    pub(crate) fn opened(&self, db: Arc<dyn GrantDb>, filter: Option<Arc<FilterStats>>) {
        if self.store.set(db).is_ok() {
            if let Some(f) = filter {
                let _ = self.filter.set(f);
            }
        }
    }

    /// The gate observer feeding the stage histograms.
    pub(crate) fn stages(&self) -> Arc<dyn GateObserver> {
        Arc::clone(&self.stages) as Arc<dyn GateObserver>
    }

    /// The registry of everything but the backlog.
    fn registry(&self) -> Registry {
        let mut registry = Registry::default();
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
        self.stages.register(&mut registry);
        registry.register_collector(Box::new(FilterCollector(Arc::clone(&self.filter))));
        registry
    }

    /// What the endpoint serves.
    pub(crate) fn exposition(&self) -> Exposition {
        Exposition {
            registry: self.registry(),
            store: Arc::clone(&self.store),
        }
    }
}

/// Serves `metrics` at `addr`.
pub(crate) async fn serve_consume(
    addr: SocketAddr,
    metrics: &ConsumeMetrics,
) -> Result<(), CliError> {
    serve(addr, metrics.exposition()).await
}

/// Bucket upper bounds, in seconds (a commit's WAL flush is ~1-5 ms; a slow handler or a
/// broker under pressure reaches seconds).
pub(crate) const BUCKETS: [f64; 14] = [
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

const STAGES: [Stage; 4] = [Stage::Claim, Stage::Handler, Stage::Commit, Stage::Ack];

/// A [`GateObserver`] recording stage latencies.
#[derive(Debug)]
pub(crate) struct StageMetrics {
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
    fn register(&self, registry: &mut Registry) {
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

    fn stage_text(m: &StageMetrics) -> String {
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut t = String::new();
        prometheus_text::encode(&mut t, &registry).unwrap();
        t
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
    async fn consume_metrics_count_outcomes_and_name_every_counter_as_before() {
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
        let text = m.exposition().render().await;
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
        // No store yet: no filter counters, no backlog.
        assert!(!text.contains("idem_front_filter"), "{text}");
        assert!(!text.contains("idem_outbox"), "{text}");
    }

    #[test]
    fn the_filter_collector_reads_the_stats_at_each_scrape() {
        let slot = Arc::new(OnceLock::new());
        let mut registry = Registry::default();
        registry.register_collector(Box::new(FilterCollector(Arc::clone(&slot))));
        let render = || {
            let mut t = String::new();
            prometheus_text::encode(&mut t, &registry).unwrap();
            t
        };
        assert_eq!(render(), "");
        let stats = Arc::new(FilterStats::default());
        let _ = slot.set(Arc::clone(&stats));
        let t = render();
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
        let mut t = String::new();
        prometheus_text::encode(&mut t, &registry).unwrap();
        t
    }

    #[test]
    fn the_backlog_collector_reports_what_it_measured_or_that_it_could_not() {
        let t = backlog_text(BacklogCollector(Some(OutboxBacklog {
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
        let none = backlog_text(BacklogCollector(Some(OutboxBacklog {
            pending: 0,
            oldest_age: None,
        })));
        assert_eq!(
            value(&none, "idem_outbox_oldest_unpublished_age_seconds"),
            0.0
        );
        let down = backlog_text(BacklogCollector(None));
        assert_eq!(value(&down, "idem_outbox_backlog_up"), 0.0);
        assert!(!down.contains("idem_outbox_backlog "), "{down}");
        assert!(!down.contains("oldest"), "{down}");
    }

    #[test]
    fn relay_counters_keep_their_names() {
        use idem_core::RelayObserver as _;
        let c = RelayCounters::default();
        c.published(5);
        c.published(2);
        c.moved_aside(1, "refused");
        let mut registry = Registry::default();
        c.register(&mut registry);
        let mut t = String::new();
        prometheus_text::encode(&mut t, &registry).unwrap();
        assert_eq!(value(&t, "idem_relay_published_total"), 7.0);
        assert_eq!(value(&t, "idem_relay_batches_total"), 2.0);
        assert_eq!(value(&t, "idem_relay_retries_total"), 0.0);
        assert_eq!(value(&t, "idem_relay_moved_aside_total"), 1.0);
        assert!(
            t.contains("# TYPE idem_relay_published_total counter\n"),
            "{t}"
        );
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
