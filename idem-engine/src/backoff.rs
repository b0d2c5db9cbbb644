//! The workspace's one backoff: `backon`'s exponential builder, doubling from an initial
//! delay up to a cap, with "equal jitter" — a delay `c` becomes a time in `[c/2, c]`.
//! [`Backoff`](crate::outbox::Backoff) (the relay's retries, and `idem-runtime`'s
//! reconnects and store-failure pauses) and [`RetryPolicy`](crate::gate::RetryPolicy)
//! (a failed delivery's nack delay) are both built on it.
//!
//! `backon` computes each doubling in `f32` seconds, so a ceiling can differ from the
//! exact `initial × 2^(n-1)` by a few parts in ten million (under a microsecond at the
//! relay's 5 s cap); the cap itself is exact, and no delay exceeds it.

use std::time::Duration;

use backon::{BackoffBuilder as _, ExponentialBuilder};

/// After this many doublings of even one nanosecond every ceiling is the cap (2^64 ns
/// is 584 years): [`nth`] never walks further.
const MAX_STEPS: u32 = 64;

/// Doubling from `initial` (at most `max`), capped at `max`, endless, without jitter.
fn builder(initial: Duration, max: Duration) -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_factor(2.0)
        .with_min_delay(initial.min(max))
        .with_max_delay(max)
        .without_max_times()
}

/// The ceilings of attempts 1, 2, …: `min(initial × 2^(n-1), max)`.
pub(crate) fn ceilings(
    initial: Duration,
    max: Duration,
) -> impl Iterator<Item = Duration> + Send + Sync + Unpin {
    builder(initial, max).build()
}

/// The jittered delays of attempts 1, 2, …: each ceiling `c` becomes a time in
/// `[c/2, c]`. `backon`'s jitter adds a random fraction of a delay to it, so it is
/// applied to the halved ceilings (and the sum, rounded in `f32`, is held to `c`).
/// `seed` makes the draws deterministic (the same seed, the same sequence); `None` seeds
/// them randomly.
pub(crate) fn jittered(
    initial: Duration,
    max: Duration,
    seed: Option<u64>,
) -> impl Iterator<Item = Duration> + Send + Sync + Unpin {
    let half = builder(initial / 2, max / 2).with_jitter();
    let half = match seed {
        Some(seed) => half.with_jitter_seed(seed),
        None => half,
    };
    ceilings(initial, max)
        .zip(half.build())
        .map(|(c, d)| d.min(c))
}

/// The item of attempt `attempt` (counted from 1; 0 counts as 1) of an endless sequence.
pub(crate) fn nth(mut delays: impl Iterator<Item = Duration>, attempt: u32) -> Duration {
    let steps = attempt.saturating_sub(1).min(MAX_STEPS);
    delays
        .nth(usize::try_from(steps).unwrap_or(0))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Within a millionth (backon doubles in f32 seconds).
    #[track_caller]
    fn near(got: Duration, want: Duration) {
        let diff = got.abs_diff(want);
        assert!(diff <= want / 1_000_000, "{got:?} is not {want:?}");
    }

    #[test]
    fn ceilings_double_up_to_the_cap() {
        let want = [100, 200, 400, 800, 1600, 3200, 5000, 5000];
        for (n, w) in (1..).zip(want) {
            near(nth(ceilings(100 * MS, 5000 * MS), n), w * MS);
        }
        assert_eq!(nth(ceilings(100 * MS, 5000 * MS), 1), 100 * MS);
        assert_eq!(nth(ceilings(100 * MS, 5000 * MS), u32::MAX), 5000 * MS);
        // A first delay above the cap is the cap; zero stays zero.
        assert_eq!(nth(ceilings(10_000 * MS, 1000 * MS), 1), 1000 * MS);
        assert_eq!(nth(ceilings(Duration::ZERO, 1000 * MS), 9), Duration::ZERO);
        // 1 ns doubling reaches a one-hour cap (a capped shift would stop at 2^30 ns).
        let hour = Duration::from_secs(3600);
        assert_eq!(nth(ceilings(Duration::from_nanos(1), hour), 60), hour);
    }

    #[test]
    fn jittered_delays_stay_between_half_and_all_of_the_ceiling() {
        for _ in 0..200 {
            for n in 1..12 {
                let c = nth(ceilings(100 * MS, 5000 * MS), n);
                let d = nth(jittered(100 * MS, 5000 * MS, None), n);
                assert!(
                    d >= c / 2 - c / 1_000_000 && d <= c,
                    "attempt {n}: {d:?} of {c:?}"
                );
            }
        }
        assert_eq!(
            nth(jittered(Duration::ZERO, 5000 * MS, None), 3),
            Duration::ZERO
        );
    }

    #[test]
    fn a_seed_gives_the_same_delays_and_no_seed_spreads_them() {
        let seeded =
            |seed| -> Vec<Duration> { jittered(MS, 60_000 * MS, Some(seed)).take(8).collect() };
        assert_eq!(seeded(7), seeded(7));
        assert_ne!(seeded(7), seeded(8));
        let random: std::collections::BTreeSet<Duration> = (0..20)
            .map(|_| nth(jittered(1000 * MS, 1000 * MS, None), 1))
            .collect();
        assert!(random.len() > 1, "never jittered: {random:?}");
    }
}
