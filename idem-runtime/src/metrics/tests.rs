use prometheus_client::encoding::prometheus_text;

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
    let key = idem_engine::IdempotencyKey::derive("A", "t", b"{}").unwrap();
    for _ in 0..3 {
        m.record(&Outcome::Processed {
            key,
            settle: Ok(()),
        });
    }
    m.record(&Outcome::Processed {
        key,
        settle: Err(idem_engine::AckError::new("connection lost", true, None)),
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
    let key = idem_engine::IdempotencyKey::derive("A", "t", b"{}").unwrap();
    m.outcome(&Outcome::Processed {
        key,
        settle: Ok(()),
    });
    m.outcome(&Outcome::Processed {
        key,
        settle: Err(idem_engine::AckError::new("connection lost", true, None)),
    });
    assert!(stage_text(&m).contains("\nidem_ack_failures_after_commit_total 1\n"));
}

#[test]
fn deliveries_dead_lettered_after_max_attempts_are_counted() {
    let m = StageMetrics::default();
    let reject = |code| Outcome::Rejected {
        reason: idem_engine::RejectReason::new(code, "x"),
        settle: Ok(()),
    };
    m.outcome(&reject(ATTEMPTS_EXHAUSTED));
    m.outcome(&reject("not_json"));
    m.outcome(&reject(ATTEMPTS_EXHAUSTED));
    assert!(stage_text(&m).contains("\nidem_attempts_exhausted_total 2\n"));
}
