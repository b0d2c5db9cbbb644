//! The front filter in front of a durable store (the in-memory reference store): the
//! mark is written only after the durable commit, so it never loses a message — under
//! crashes at every point, and through a Redis outage — while the naive
//! mark-before-commit filter does lose one.

mod common;

use std::time::Duration;

use common::{config, key, quiet_crashes, FilteredMem, NaiveFiltered};
use idem_core::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, DoneFilter, Gate, OutcomeKind};
use idem_store_redis::{ClientKind, RedisConfig, RedisFilter};
use idem_testkit::sim::{check_exactly_once, Case};
use idem_testkit::{encode_submission, CrashPoint, EffectHandlerFor, MemoryStore, SimBroker};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;

async fn filter(kind: ClientKind, tag: &str) -> RedisFilter {
    let config = config(kind, tag);
    RedisFilter::connect(config.clone())
        .await
        .unwrap_or_else(|e| panic!("Redis at {} must be running: {e}", config.url))
}

/// `seen` answers true only for marked keys, for a whole slice in one call.
async fn seen_only_after_mark(kind: ClientKind) {
    let f = filter(kind, "seen").await;
    let keys: Vec<_> = (0..100).map(|i| key(&format!("seen-{i}"))).collect();
    assert_eq!(f.seen(&keys).await.expect("seen"), vec![false; 100]);
    let marked: Vec<_> = keys.iter().step_by(3).copied().collect();
    f.mark_done(&marked).await.expect("mark");
    let seen = f.seen(&keys).await.expect("seen");
    for (i, s) in seen.iter().enumerate() {
        assert_eq!(*s, i % 3 == 0, "key {i}");
    }
    assert_eq!(f.seen(&[]).await.expect("seen"), Vec::<bool>::new());
}

/// Through the gate: the replay of a committed submission is answered by the filter;
/// a rolled-back claim leaves no mark.
async fn hits_only_after_the_durable_commit(kind: ClientKind) {
    let store = FilteredMem::new(filter(kind, "hits").await);
    let gate = Gate::new(store.clone(), EffectHandlerFor::<FilteredMem>::new());
    let broker = SimBroker::new(5);
    let body = encode_submission("F-1", "2026-07-01T09:00:00Z", 42);
    broker.publish(body.clone());
    broker.publish(body);
    let first = gate.process(broker.receive().expect("d")).await.kind();
    let second = gate.process(broker.receive().expect("d")).await.kind();
    assert_eq!(
        (first, second),
        (OutcomeKind::Processed, OutcomeKind::Duplicate)
    );
    assert_eq!(
        store.0.stats().hits(),
        1,
        "the replay must be answered by Redis"
    );

    let k = key("rolled-back");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &ClaimMeta::new("r")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(
        store.0.filter().seen(&[k]).await.expect("seen"),
        vec![false]
    );
}

fn crash_case(seed: u64) -> Case {
    Case {
        submissions: (0..12)
            .map(|i| {
                (
                    format!("A-{i}"),
                    "2026-07-01T09:00:00Z".to_owned(),
                    1000 + i,
                )
            })
            .collect(),
        poison: 1,
        redelivery_rate: 0.5,
        crashes: CrashPoint::ALL
            .iter()
            .flat_map(|&p| [(p, 1), (p, 4)])
            .collect(),
        concurrency: 3,
        batch_size: 3,
        seed,
    }
}

/// The exactly-once property with crashes everywhere, on generated schedules.
async fn exactly_once_under_crashes(kind: ClientKind) {
    quiet_crashes();
    let mut runner = TestRunner::deterministic();
    let strategy = idem_testkit::strategies::case();
    let mut cases: Vec<Case> = (0..24)
        .map(|_| strategy.new_tree(&mut runner).expect("case").current())
        .collect();
    cases.push(crash_case(1));
    let mut hits = 0;
    for case in &cases {
        let store = FilteredMem::new(filter(kind, "prop").await);
        if let Err(e) = check_exactly_once(store.clone(), case).await {
            panic!("{e}\nin case {case:?}");
        }
        hits += store.0.stats().hits();
    }
    assert!(
        hits > 0,
        "the filter answered no duplicate in {} schedules",
        cases.len()
    );
}

/// Redis unreachable (a port where nothing listens): every lookup errors and falls
/// through; the durable store alone keeps it exactly once.
async fn redis_outage_falls_through(kind: ClientKind) {
    quiet_crashes();
    let down = RedisConfig::new("redis://127.0.0.1:1")
        .with_client(kind)
        .with_timeout(Duration::from_millis(100));
    let f = RedisFilter::connect_lazy(down)
        .await
        .expect("a lazy filter needs no server");
    assert!(f.seen(&[key("x")]).await.is_err());
    let store = FilteredMem::new(f);
    check_exactly_once(store.clone(), &crash_case(2))
        .await
        .expect("exactly once through the durable store");
    assert_eq!(store.0.stats().hits(), 0);
    assert!(store.0.stats().errors() > 0, "the outage was not noticed");
}

/// The issue's key test: a crash after the claim. The naive filter (mark at claim time)
/// skips the redelivery and loses the message; ours does not.
async fn naive_filter_loses_a_message_ours_does_not(kind: ClientKind) {
    quiet_crashes();
    let case = Case {
        submissions: (0..5)
            .map(|i| (format!("N-{i}"), "2026-07-01T09:00:00Z".to_owned(), 10 + i))
            .collect(),
        poison: 0,
        redelivery_rate: 0.0,
        crashes: vec![(CrashPoint::AfterClaim, 1)],
        concurrency: 1,
        batch_size: 1,
        seed: 3,
    };
    let naive = NaiveFiltered {
        store: MemoryStore::new(),
        filter: filter(kind, "naive").await,
    };
    let err = check_exactly_once(naive, &case)
        .await
        .expect_err("the naive filter must lose the crashed message");
    assert!(err.contains("lost"), "expected a lost message, got: {err}");

    let ours = FilteredMem::new(filter(kind, "ours").await);
    let report = check_exactly_once(ours, &case)
        .await
        .expect("ours is exactly once");
    assert_eq!(
        report.total_crashes(),
        1,
        "the crash after the claim must have happened"
    );
}

per_client!(
    seen_only_after_mark,
    hits_only_after_the_durable_commit,
    exactly_once_under_crashes,
    redis_outage_falls_through,
    naive_filter_loses_a_message_ours_does_not,
);
