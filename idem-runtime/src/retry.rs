//! [`retry`]: an attempt repeated with backoff until it succeeds, fails for good, or a
//! deadline passes.

use std::future::Future;
use std::time::{Duration, Instant};

use backon::Retryable as _;
use idem_engine::outbox::Backoff;

/// A failed attempt: worth another try, or not.
#[derive(Debug)]
pub enum Attempt<E> {
    /// A failure a retry can fix (unreachable, timed out).
    Retry(E),
    /// A mistake no retry fixes (a bad URL, a missing table): stop at once.
    Final(E),
}

/// What [`retry`] returns when it stops without success.
#[derive(Debug, thiserror::Error)]
pub enum GaveUp<E: std::error::Error + 'static> {
    /// A failure no retry fixes.
    #[error(transparent)]
    Final(E),
    /// Still failing when the deadline passed; the last error.
    #[error("still failing after {:.0} s: {last}", .after.as_secs_f64())]
    Deadline {
        /// How long it tried.
        after: Duration,
        /// The last attempt's error.
        #[source]
        last: E,
    },
}

/// Runs `attempt` until it succeeds, returns [`Attempt::Final`], or `deadline` has passed
/// since the first try; waits a [`Backoff`] delay between tries (never past the
/// deadline). `what` names the thing for the logs. The loop is `backon`'s
/// [`Retryable`](backon::Retryable) over [`Backoff::delays`], cut at the deadline, with
/// tokio's timer.
///
/// # Errors
/// [`GaveUp::Final`] at once for a final error; [`GaveUp::Deadline`] with the last
/// error once `deadline` has passed.
pub async fn retry<T, E, F, Fut>(
    what: &str,
    deadline: Duration,
    backoff: Backoff,
    attempt: F,
) -> Result<T, GaveUp<E>>
where
    E: std::error::Error + 'static,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Attempt<E>>>,
{
    let started = Instant::now();
    // The backoff's delays, each cut to the time left, until none is left.
    let delays = backoff.delays().map_while(move |d| {
        let left = deadline.checked_sub(started.elapsed())?;
        (!left.is_zero()).then(|| d.min(left))
    });
    let mut n = 0u32;
    let result = attempt
        .retry(delays)
        .sleep(tokio::time::sleep)
        .when(|e| matches!(e, Attempt::Retry(_)))
        .notify(|e, wait| {
            n = n.saturating_add(1);
            let (Attempt::Retry(e) | Attempt::Final(e)) = e;
            tracing::warn!(target: "idem::runtime", attempt = n, error = %e, "{what} unreachable; retrying in {wait:?}");
        })
        .await;
    result.map_err(|e| match e {
        Attempt::Final(e) => GaveUp::Final(e),
        Attempt::Retry(last) => GaveUp::Deadline {
            after: started.elapsed(),
            last,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("down {0}")]
    struct Down(u32);

    const FAST: Backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(4));

    #[tokio::test]
    async fn a_retryable_failure_is_tried_again_until_it_succeeds() {
        let mut tries = 0u32;
        let r = retry("the thing", Duration::from_secs(30), FAST, || {
            tries += 1;
            let n = tries;
            async move {
                if n < 4 {
                    Err(Attempt::Retry(Down(n)))
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(r.expect("succeeded"), 4);
    }

    #[tokio::test]
    async fn a_final_failure_stops_at_once() {
        let mut tries = 0u32;
        let r: Result<(), _> = retry("the thing", Duration::from_secs(30), FAST, || {
            tries += 1;
            let n = tries;
            async move { Err(Attempt::Final(Down(n))) }
        })
        .await;
        assert!(matches!(r, Err(GaveUp::Final(Down(1)))), "{r:?}");
        assert_eq!(tries, 1);
    }

    #[tokio::test]
    async fn the_deadline_ends_it_with_the_last_error() {
        let deadline = Duration::from_millis(60);
        let started = Instant::now();
        let mut tries = 0u32;
        let r: Result<(), _> = retry("the thing", deadline, FAST, || {
            tries += 1;
            let n = tries;
            async move { Err(Attempt::Retry(Down(n))) }
        })
        .await;
        let Err(GaveUp::Deadline { after, last }) = r else {
            panic!("{r:?}");
        };
        assert!(after >= deadline, "{after:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(last.0, tries, "the last error");
        // Waits of at most 4 ms within 60 ms: many tries.
        assert!(tries > 5, "{tries}");
    }

    #[tokio::test]
    async fn no_time_left_means_no_retry() {
        let mut tries = 0u32;
        let r: Result<(), _> = retry("the thing", Duration::ZERO, FAST, || {
            tries += 1;
            async { Err(Attempt::Retry(Down(0))) }
        })
        .await;
        assert!(matches!(r, Err(GaveUp::Deadline { .. })), "{r:?}");
        assert_eq!(tries, 1);
    }
}
