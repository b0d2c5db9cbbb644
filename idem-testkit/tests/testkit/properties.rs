//! The exactly-once property on the in-memory store: any schedule of deliveries — equal
//! payloads at once, redeliveries, a message in flight twice — with crashes and errors at
//! any point leaves one effect per distinct submission; and the schedules are ones where
//! the faults they script actually fire.

use idem_testkit::sim::check_exactly_once;
use idem_testkit::{strategies, CrashPoint, ErrorPoint, MemoryStore};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_schedule_is_exactly_once(case in strategies::case()) {
        idem_testkit::fault::quiet_injected_crashes();
        let result = runtime().block_on(check_exactly_once(MemoryStore::new(), &case));
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}

/// The generated schedules exercise what the property is about: over 200 of them, most
/// scripted faults fire, every crash point and error point fires somewhere, equal
/// payloads are delivered, messages are in flight twice and acks are lost.
#[test]
fn the_generated_schedules_fire_their_faults_and_repeat_keys() {
    idem_testkit::fault::quiet_injected_crashes();
    let rt = runtime();
    let mut runner = TestRunner::new(Config::default());
    let strategy = strategies::case();
    let (mut scripted, mut fired) = (0u64, 0u64);
    let mut crash_points = std::collections::BTreeSet::new();
    let mut error_points = std::collections::BTreeSet::new();
    let (mut repeated_keys, mut expired, mut acks_lost) = (0u64, 0u64, 0u64);
    for _ in 0..200 {
        let case = strategy.new_tree(&mut runner).unwrap().current();
        let distinct: std::collections::BTreeSet<_> = case.submissions.iter().collect();
        repeated_keys += (case.submissions.len() - distinct.len()) as u64;
        let report = rt
            .block_on(check_exactly_once(MemoryStore::new(), &case))
            .unwrap_or_else(|e| panic!("{e}\n{case:?}"));
        scripted += (case.crashes.len() + case.errors.len()) as u64;
        fired += report.total_crashes() + report.errors.values().sum::<u64>();
        crash_points.extend(report.crashes.keys().copied());
        error_points.extend(report.errors.keys().copied());
        expired += report.broker.expired;
        acks_lost += report.broker.acks_lost;
    }
    assert!(
        fired * 2 >= scripted,
        "only {fired} of {scripted} scripted faults fired"
    );
    assert_eq!(
        crash_points.len(),
        CrashPoint::ALL.len(),
        "{crash_points:?}"
    );
    assert_eq!(
        error_points.len(),
        ErrorPoint::ALL.len(),
        "{error_points:?}"
    );
    assert!(repeated_keys > 200, "equal payloads: {repeated_keys}");
    assert!(expired > 50, "messages in flight twice: {expired}");
    assert!(acks_lost > 50, "lost acks: {acks_lost}");
}
