//! Stage latency histograms for the metrics endpoint: [`StageMetrics`] is a
//! [`GateObserver`] that records how long each step of the gate took (claim, handler,
//! commit, ack) and how many acks failed after a successful commit, and renders them in
//! the Prometheus text exposition format (version 0.0.4).
//!
//! Wiring (in `consume`): `let m = Arc::new(StageMetrics::default());`, build the gate with
//! `Gate::new(store, handler).with_observer(m.clone())`, and append `m.render()` to the
//! text the `--metrics-addr` endpoint serves.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_core::{GateObserver, Outcome, Stage};

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
        s
    }
}

impl GateObserver for StageMetrics {
    fn stage(&self, stage: Stage, elapsed: Duration) {
        self.stages[index(stage)].observe(elapsed);
    }

    fn outcome(&self, outcome: &Outcome) {
        if let Outcome::Processed { settle: Err(_), .. } = outcome {
            self.ack_failures_after_commit
                .fetch_add(1, Ordering::Relaxed);
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
        // 4 stages x (15 buckets + sum + count) + the counter.
        assert_eq!(
            t.lines().filter(|l| !l.starts_with('#')).count(),
            4 * 17 + 1
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
}
