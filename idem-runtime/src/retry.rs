//! [`retry`]: an attempt repeated with backoff until it succeeds, fails for good, or a
//! deadline passes.

use std::future::Future;
use std::time::{Duration, Instant};

use idem_core::outbox::Backoff;

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
/// deadline). `what` names the thing for the logs.
///
/// # Errors
/// [`GaveUp::Final`] at once for a final error; [`GaveUp::Deadline`] with the last
/// error once `deadline` has passed.
pub async fn retry<T, E, F, Fut>(
    what: &str,
    deadline: Duration,
    backoff: Backoff,
    mut attempt: F,
) -> Result<T, GaveUp<E>>
where
    E: std::error::Error + 'static,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Attempt<E>>>,
{
    let started = Instant::now();
    let mut n = 0u32;
    loop {
        match attempt().await {
            Ok(v) => return Ok(v),
            Err(Attempt::Final(e)) => return Err(GaveUp::Final(e)),
            Err(Attempt::Retry(e)) => {
                n = n.saturating_add(1);
                let elapsed = started.elapsed();
                if elapsed >= deadline {
                    return Err(GaveUp::Deadline {
                        after: elapsed,
                        last: e,
                    });
                }
                let wait = backoff.delay(n).min(deadline.saturating_sub(elapsed));
                tracing::warn!(target: "idem::runtime", attempt = n, error = %e, "{what} unreachable; retrying in {wait:?}");
                tokio::time::sleep(wait).await;
            }
        }
    }
}
