//! proptest strategies for schedules of the exactly-once property.
//!
//! They aim at what breaks an idempotent consumer: the *same key at the same time*. The
//! submissions are drawn from a small space, so equal payloads (the at-least-once
//! duplicate, often in one batch or two tasks at once) are the rule, not the exception;
//! same award and timestamp with another amount (a different key) happens too; the
//! broker redelivers acked messages and lets visibility timeouts expire so one message is
//! in flight twice; faults are errors of each kind as well as crashes, at occurrences low
//! enough that they fire (`SimReport::crashes`/`errors` say which did).

use proptest::prelude::*;

use crate::fault::{CrashPoint, ErrorPoint};
use crate::sim::Case;

/// Any crash point.
pub fn crash_point() -> impl Strategy<Value = CrashPoint> {
    proptest::sample::select(CrashPoint::ALL.to_vec())
}

/// Any error point.
pub fn error_point() -> impl Strategy<Value = ErrorPoint> {
    proptest::sample::select(ErrorPoint::ALL.to_vec())
}

/// Up to `max` submissions from a space of 6 awards × 2 timestamps × 3 amounts: with
/// more than a handful, equal payloads (the same key) are certain, and the same award
/// and timestamp with another amount (another key) is common.
pub fn submissions(max: usize) -> impl Strategy<Value = Vec<(String, String, i64)>> {
    proptest::collection::vec((0u32..6, 0u32..2, 0i64..3), 1..=max).prop_map(|v| {
        v.into_iter()
            .map(|(s, t, a)| {
                (
                    format!("A-{s}"),
                    format!("2026-07-0{}T09:00:00Z", t + 1),
                    1_000 * (a + 1),
                )
            })
            .collect()
    })
}

/// A whole schedule: submissions, poison, broker redeliveries and expired visibility
/// timeouts, crashes and errors at low occurrences, concurrency and batch size.
pub fn case() -> impl Strategy<Value = Case> {
    (
        (
            submissions(30),
            0usize..3,
            prop_oneof![Just(0.0), 0.0f64..0.6],
            prop_oneof![Just(0.0), 0.0f64..0.5],
        ),
        (
            proptest::collection::vec((crash_point(), 1u64..12), 0..6),
            proptest::collection::vec((error_point(), 1u64..12), 0..6),
        ),
        1usize..4,
        prop_oneof![Just(1usize), 2usize..8],
        any::<u64>(),
    )
        .prop_map(
            |(
                (submissions, poison, redelivery_rate, expiry_rate),
                (crashes, errors),
                concurrency,
                batch_size,
                seed,
            )| Case {
                submissions,
                poison,
                redelivery_rate,
                crashes,
                errors,
                expiry_rate,
                concurrency,
                batch_size,
                seed,
            },
        )
}
