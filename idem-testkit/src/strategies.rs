//! proptest strategies for schedules of the exactly-once property.

use proptest::prelude::*;

use crate::fault::CrashPoint;
use crate::sim::Case;

/// Any crash point.
pub fn crash_point() -> impl Strategy<Value = CrashPoint> {
    proptest::sample::select(CrashPoint::ALL.to_vec())
}

/// Up to `max` submissions over a small set of subjects, so duplicates (the same subject,
/// timestamp and amount, hence the same bytes) are common.
pub fn submissions(max: usize) -> impl Strategy<Value = Vec<(String, String, i64)>> {
    proptest::collection::vec((0u32..12, 0u32..3, 0i64..1_000_000), 1..=max).prop_map(|v| {
        v.into_iter()
            .map(|(s, t, a)| (format!("A-{s}"), format!("2026-07-0{}T09:00:00Z", t + 1), a))
            .collect()
    })
}

/// A whole schedule: submissions, poison, broker redeliveries, crashes at any point,
/// concurrency and batch size.
pub fn case() -> impl Strategy<Value = Case> {
    (
        submissions(30),
        0usize..3,
        prop_oneof![Just(0.0), 0.0f64..0.6],
        proptest::collection::vec((crash_point(), 1u64..25), 0..8),
        1usize..4,
        prop_oneof![Just(1usize), 2usize..8],
        any::<u64>(),
    )
        .prop_map(
            |(submissions, poison, redelivery_rate, crashes, concurrency, batch_size, seed)| Case {
                submissions,
                poison,
                redelivery_rate,
                crashes,
                concurrency,
                batch_size,
                seed,
            },
        )
}
