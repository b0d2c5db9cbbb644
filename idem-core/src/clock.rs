//! Time as the library sees it: a [`Clock`] that tests and the explorer can replace, so no
//! decision inside the library reads the wall clock directly.

use std::sync::Arc;
use std::time::{Duration, Instant};

/// A monotonic clock.
///
/// # Contract
/// - [`now`](Clock::now) never goes backwards; its origin is arbitrary but fixed for the
///   clock's lifetime.
/// - It is cheap and never blocks: it is read on the delivery path.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The time elapsed since the clock's origin.
    fn now(&self) -> Duration;
}

/// The process's monotonic clock ([`Instant`]).
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    origin: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A shared clock handle.
pub type SharedClock = Arc<dyn Clock>;

/// A new [`SystemClock`] behind a [`SharedClock`].
pub fn system() -> SharedClock {
    Arc::new(SystemClock::default())
}
