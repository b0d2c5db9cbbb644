//! The `--metrics-addr` endpoint of `idem consume` and `idem relay`: a tiny HTTP server
//! answering every request with the Prometheus text exposition format (version 0.0.4),
//! rendered afresh on each scrape ([`serve`]), and the pieces it is made of:
//!
//! - [`StageMetrics`], a [`GateObserver`] recording how long each step of the gate took
//!   (claim, handler, commit, ack) and how many acks failed after a successful commit;
//! - [`filter_text`]: the front filter's hits, errors and bypassed lookups;
//! - [`backlog_text`]: the outbox backlog and the age of its oldest unpublished event,
//!   measured in the store at scrape time;
//! - [`RelayCounters`]: events published and batches retried by the relay.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::future::BoxFuture;
use idem_core::gate::ATTEMPTS_EXHAUSTED;
use idem_core::{FilterStats, GateObserver, Outcome, OutcomeKind, Stage};
use idem_grant::GrantDb;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::error::error_chain;
use crate::CliError;

/// Renders the exposition text; called on every scrape.
pub(crate) type Render = Arc<dyn Fn() -> BoxFuture<'static, String> + Send + Sync>;

/// How long a scrape may wait for the store before the backlog is reported as unknown.
const STORE_TIMEOUT: Duration = Duration::from_secs(2);

/// Binds `addr` now (a taken port is the caller's mistake, exit 2) and serves `render`'s
/// text to every HTTP request on it, in the background, until the process ends.
pub(crate) async fn serve(addr: SocketAddr, render: Render) -> Result<(), CliError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| CliError::usage(format!("--metrics-addr {addr}: {e}")))?;
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
            let render = Arc::clone(&render);
            tokio::spawn(async move {
                // The request itself does not matter: every path gets the metrics.
                let mut buf = [0u8; 1024];
                let _ = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf)).await;
                let body = render().await;
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok(())
}

/// One metric's `# HELP` and `# TYPE` lines.
fn header(s: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// The front filter's counters.
pub(crate) fn filter_text(stats: &FilterStats) -> String {
    let mut s = String::new();
    for (name, help, value) in [
        (
            "idem_front_filter_hits_total",
            "Deliveries the front filter answered as already done (no store round trip).",
            stats.hits(),
        ),
        (
            "idem_front_filter_errors_total",
            "Front filter lookups or marks that failed (the store decided instead).",
            stats.errors(),
        ),
        (
            "idem_front_filter_bypassed_total",
            "Lookups skipped while the filter's circuit breaker was open.",
            stats.bypassed(),
        ),
    ] {
        header(&mut s, name, "counter", help);
        let _ = writeln!(s, "{name} {value}");
    }
    s
}

/// The outbox backlog gauges, measured now in `db` (at most [`STORE_TIMEOUT`]). When the
/// store cannot answer, `idem_outbox_backlog_up` is 0 and the two gauges are left out
/// rather than reported stale.
pub(crate) async fn backlog_text(db: &dyn GrantDb) -> String {
    let mut s = String::new();
    let measured = tokio::time::timeout(STORE_TIMEOUT, db.outbox_backlog()).await;
    let backlog = match measured {
        Ok(Ok(b)) => Some(b),
        Ok(Err(e)) => {
            tracing::debug!(target: "idem::metrics", error = %error_chain(&e), "measuring the outbox backlog failed");
            None
        }
        Err(_) => None,
    };
    if let Some(b) = backlog {
        header(
            &mut s,
            "idem_outbox_backlog",
            "gauge",
            "Outbox events committed but not yet published.",
        );
        let _ = writeln!(s, "idem_outbox_backlog {}", b.pending);
        header(
            &mut s,
            "idem_outbox_oldest_unpublished_age_seconds",
            "gauge",
            "Age of the oldest unpublished outbox event (0 when none is pending).",
        );
        let age = b.oldest_age.map_or(0.0, |d| d.as_secs_f64());
        let _ = writeln!(s, "idem_outbox_oldest_unpublished_age_seconds {age:.3}");
    }
    header(
        &mut s,
        "idem_outbox_backlog_up",
        "gauge",
        "1 when this scrape could measure the outbox backlog in the store, else 0.",
    );
    let _ = writeln!(s, "idem_outbox_backlog_up {}", u8::from(backlog.is_some()));
    s
}

/// The relay's counters, shared between its loop and the metrics endpoint.
#[derive(Debug, Default)]
pub(crate) struct RelayCounters {
    /// Events published and marked.
    pub(crate) published: AtomicU64,
    /// Batches published and marked.
    pub(crate) batches: AtomicU64,
    /// Batches that failed (store or broker) and were released for another try.
    pub(crate) retries: AtomicU64,
    /// Events moved aside after the broker refused them again and again.
    pub(crate) moved_aside: AtomicU64,
    /// When the last batch was marked published.
    pub(crate) last_published: std::sync::Mutex<Option<std::time::Instant>>,
}

impl idem_core::RelayObserver for RelayCounters {
    fn published(&self, events: usize) {
        self.published.fetch_add(events as u64, Ordering::Relaxed);
        self.batches.fetch_add(1, Ordering::Relaxed);
        let now = std::time::Instant::now();
        *self
            .last_published
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(now);
    }

    fn failed(&self, _error: &idem_core::Error, _retry_in: Duration) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    fn moved_aside(&self, events: u64, _reason: &str) {
        self.moved_aside.fetch_add(events, Ordering::Relaxed);
    }
}

/// Serves the relay's counters and the store's outbox backlog at `addr`.
pub(crate) async fn serve_relay(
    addr: SocketAddr,
    counters: Arc<RelayCounters>,
    db: Arc<dyn GrantDb>,
) -> Result<(), CliError> {
    let render: Render = Arc::new(move || {
        let (c, db) = (Arc::clone(&counters), Arc::clone(&db));
        Box::pin(async move {
            let mut s = c.render();
            s.push_str(&backlog_text(db.as_ref()).await);
            s
        })
    });
    serve(addr, render).await
}

impl RelayCounters {
    /// The counters' exposition text.
    pub(crate) fn render(&self) -> String {
        let mut s = String::new();
        for (name, help, value) in [
            (
                "idem_relay_published_total",
                "Outbox events published to the broker and marked published.",
                &self.published,
            ),
            (
                "idem_relay_batches_total",
                "Outbox batches published and marked.",
                &self.batches,
            ),
            (
                "idem_relay_retries_total",
                "Outbox batches that failed (store or broker) and were retried.",
                &self.retries,
            ),
            (
                "idem_relay_moved_aside_total",
                "Outbox events moved aside after the broker refused them max_publish_attempts times.",
                &self.moved_aside,
            ),
        ] {
            header(&mut s, name, "counter", help);
            let _ = writeln!(s, "{name} {}", value.load(Ordering::Relaxed));
        }
        s
    }
}

/// What `idem consume --metrics-addr` serves: deliveries by outcome, settle failures,
/// the gate's stage histograms, and once the store is open the front filter's counters
/// and the outbox backlog.
#[derive(Default)]
pub(crate) struct ConsumeMetrics {
    by_kind: [AtomicU64; 6],
    settle_failures: AtomicU64,
    stages: Arc<StageMetrics>,
    opened: OnceLock<Opened>,
}

/// The opened store and its front filter's counters.
type Opened = (Arc<dyn GrantDb>, Option<Arc<FilterStats>>);

const KINDS: [OutcomeKind; 6] = [
    OutcomeKind::Processed,
    OutcomeKind::Duplicate,
    OutcomeKind::Deferred,
    OutcomeKind::Rejected,
    OutcomeKind::Failed,
    OutcomeKind::Conflict,
];

impl ConsumeMetrics {
    /// Counts one settled delivery (and logs a failed settlement).
    pub(crate) fn record(&self, o: &Outcome) {
        let i = KINDS.iter().position(|k| *k == o.kind()).unwrap_or(4);
        self.by_kind[i].fetch_add(1, Ordering::Relaxed);
        if let Some(e) = o.settle_error() {
            self.settle_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(target: "idem::consume", outcome = o.kind().as_str(), error = %e, "settling a delivery failed");
        }
    }

    /// The store is open: its backlog and filter counters are served from now on (a
    /// reconnect to the store keeps the first, the same database).
    pub(crate) fn opened(&self, db: Arc<dyn GrantDb>, filter: Option<Arc<FilterStats>>) {
        let _ = self.opened.set((db, filter));
    }

    /// The gate observer feeding the stage histograms.
    pub(crate) fn stages(&self) -> Arc<dyn GateObserver> {
        Arc::clone(&self.stages) as Arc<dyn GateObserver>
    }

    /// The counters' and histograms' exposition text.
    pub(crate) fn counters_text(&self) -> String {
        let mut s = String::new();
        header(
            &mut s,
            "idem_deliveries_total",
            "counter",
            "Deliveries settled, by outcome.",
        );
        for (k, n) in KINDS.iter().zip(&self.by_kind) {
            let _ = writeln!(
                s,
                "idem_deliveries_total{{outcome=\"{}\"}} {}",
                k.as_str(),
                n.load(Ordering::Relaxed)
            );
        }
        header(
            &mut s,
            "idem_settle_failures_total",
            "counter",
            "Acks, nacks or dead-letters that failed.",
        );
        let failures = self.settle_failures.load(Ordering::Relaxed);
        let _ = writeln!(s, "idem_settle_failures_total {failures}");
        s.push_str(&self.stages.render());
        s
    }

    async fn render(&self) -> String {
        let mut s = self.counters_text();
        if let Some((db, filter)) = self.opened.get() {
            if let Some(f) = filter {
                s.push_str(&filter_text(f));
            }
            s.push_str(&backlog_text(db.as_ref()).await);
        }
        s
    }
}

/// Serves `metrics` at `addr`.
pub(crate) async fn serve_consume(
    addr: SocketAddr,
    metrics: Arc<ConsumeMetrics>,
) -> Result<(), CliError> {
    let render: Render = Arc::new(move || {
        let m = Arc::clone(&metrics);
        Box::pin(async move { m.render().await })
    });
    serve(addr, render).await
}

/// Bucket upper bounds, in seconds (a commit's WAL flush is ~1-5 ms; a slow handler or a
/// broker under pressure reaches seconds).
pub(crate) const BUCKETS: [f64; 14] = [
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

const STAGES: [Stage; 4] = [Stage::Claim, Stage::Handler, Stage::Commit, Stage::Ack];

/// One histogram: cumulative-on-render bucket counts, a sum in nanoseconds, a count.
#[derive(Debug, Default)]
struct Histogram {
    /// Per bucket (not cumulative), plus the overflow (`+Inf`) slot.
    buckets: [AtomicU64; BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|&le| secs <= le)
            .unwrap_or(BUCKETS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// A [`GateObserver`] recording stage latencies (lock-free: atomics only).
#[derive(Debug, Default)]
pub(crate) struct StageMetrics {
    stages: [Histogram; 4],
    ack_failures_after_commit: AtomicU64,
    attempts_exhausted: AtomicU64,
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
    /// The Prometheus text exposition of the histograms and the counter.
    pub(crate) fn render(&self) -> String {
        let mut s = String::new();
        s.push_str(
            "# HELP idem_stage_duration_seconds Time spent in each step of the gate \
             (a batch counts once).\n# TYPE idem_stage_duration_seconds histogram\n",
        );
        for stage in STAGES {
            let h = &self.stages[index(stage)];
            let name = stage.as_str();
            // Read the count first: buckets observed after it may make +Inf exceed it
            // by a few, never fall below it.
            let mut cumulative = 0u64;
            for (i, le) in BUCKETS.iter().enumerate() {
                cumulative += h.buckets[i].load(Ordering::Relaxed);
                let _ = writeln!(
                    s,
                    "idem_stage_duration_seconds_bucket{{stage=\"{name}\",le=\"{le}\"}} {cumulative}"
                );
            }
            cumulative += h.buckets[BUCKETS.len()].load(Ordering::Relaxed);
            let _ = writeln!(
                s,
                "idem_stage_duration_seconds_bucket{{stage=\"{name}\",le=\"+Inf\"}} {cumulative}"
            );
            let sum = h.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
            let _ = writeln!(
                s,
                "idem_stage_duration_seconds_sum{{stage=\"{name}\"}} {sum}"
            );
            let _ = writeln!(
                s,
                "idem_stage_duration_seconds_count{{stage=\"{name}\"}} {cumulative}"
            );
        }
        s.push_str(
            "# HELP idem_ack_failures_after_commit_total Commits whose ack then failed \
             (the redelivery is skipped as a duplicate).\n\
             # TYPE idem_ack_failures_after_commit_total counter\n",
        );
        let _ = writeln!(
            s,
            "idem_ack_failures_after_commit_total {}",
            self.ack_failures_after_commit.load(Ordering::Relaxed)
        );
        s.push_str(
            "# HELP idem_attempts_exhausted_total Deliveries dead-lettered because their \
             attempts reached --max-attempts (the reason is the last error).\n\
             # TYPE idem_attempts_exhausted_total counter\n",
        );
        let _ = writeln!(
            s,
            "idem_attempts_exhausted_total {}",
            self.attempts_exhausted.load(Ordering::Relaxed)
        );
        s
    }
}

impl GateObserver for StageMetrics {
    fn stage(&self, stage: Stage, elapsed: Duration) {
        self.stages[index(stage)].observe(elapsed);
    }

    fn outcome(&self, outcome: &Outcome) {
        match outcome {
            Outcome::Processed { settle: Err(_), .. } => {
                self.ack_failures_after_commit
                    .fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Rejected { reason, .. } if reason.code == ATTEMPTS_EXHAUSTED => {
                self.attempts_exhausted.fetch_add(1, Ordering::Relaxed);
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

    #[test]
    fn exposition_text_has_cumulative_buckets_sum_and_count() {
        let m = StageMetrics::default();
        m.stage(Stage::Commit, Duration::from_micros(300)); // <= 0.0005
        m.stage(Stage::Commit, Duration::from_millis(3)); // <= 0.005
        m.stage(Stage::Commit, Duration::from_millis(3));
        m.stage(Stage::Commit, Duration::from_secs(30)); // +Inf only
        m.stage(Stage::Claim, Duration::from_millis(1)); // exactly on a bound: <= 0.001
        let t = m.render();

        assert!(
            t.contains("# TYPE idem_stage_duration_seconds histogram\n"),
            "{t}"
        );
        assert!(
            t.contains("# TYPE idem_ack_failures_after_commit_total counter\n"),
            "{t}"
        );
        let b = |stage: &str, le: &str| {
            line(
                &t,
                &format!("idem_stage_duration_seconds_bucket{{stage=\"{stage}\",le=\"{le}\"}} "),
            )
            .rsplit(' ')
            .next()
            .unwrap()
            .to_owned()
        };
        assert_eq!(b("commit", "0.0005"), "1");
        assert_eq!(b("commit", "0.001"), "1");
        assert_eq!(b("commit", "0.005"), "3");
        assert_eq!(b("commit", "10"), "3");
        assert_eq!(b("commit", "+Inf"), "4");
        assert_eq!(b("claim", "0.0005"), "0");
        assert_eq!(b("claim", "0.001"), "1");
        assert_eq!(b("handler", "+Inf"), "0");
        assert_eq!(
            line(&t, "idem_stage_duration_seconds_count{stage=\"commit\"}"),
            "idem_stage_duration_seconds_count{stage=\"commit\"} 4"
        );
        assert_eq!(
            line(&t, "idem_stage_duration_seconds_sum{stage=\"commit\"}"),
            "idem_stage_duration_seconds_sum{stage=\"commit\"} 30.0063"
        );
        assert_eq!(
            line(&t, "idem_stage_duration_seconds_sum{stage=\"ack\"}"),
            "idem_stage_duration_seconds_sum{stage=\"ack\"} 0"
        );
        assert_eq!(
            line(&t, "idem_ack_failures_after_commit_total"),
            "idem_ack_failures_after_commit_total 0"
        );
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

    #[test]
    fn metrics_text_counts_outcomes() {
        let m = ConsumeMetrics::default();
        m.by_kind[0].fetch_add(3, Ordering::Relaxed);
        let text = m.counters_text();
        assert!(
            text.contains("idem_deliveries_total{outcome=\"processed\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("idem_deliveries_total{outcome=\"duplicate\"} 0"),
            "{text}"
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
        assert!(m
            .render()
            .contains("\nidem_ack_failures_after_commit_total 1\n"));
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
        assert!(m.render().contains("\nidem_attempts_exhausted_total 2\n"));
    }
}
