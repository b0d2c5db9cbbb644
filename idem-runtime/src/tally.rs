//! Flushing an [`OutcomeTally`] into the store's `idem_outcome_counts` every second and
//! at exit (`idem consume`, `idem demo`), on a task of its own: a delivery never waits for
//! it. A failed flush keeps its counts for the next one and is logged (a warning when
//! flushes start failing, then quietly until one succeeds again).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::sync::Arc;
//! use idem_engine::{GateObserver, OutcomeCountStore};
//! use idem_runtime::tally::with_outcome_tally;
//!
//! # let metrics: Arc<dyn GateObserver> = Arc::new(idem_engine::OutcomeTally::new());
//! // A store that keeps no tally (None): the observer is the metrics alone.
//! let (observer, flusher) = with_outcome_tally(metrics, None::<Arc<dyn OutcomeCountStore>>);
//! assert!(flusher.is_none());
//! # let _ = observer;
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use idem_engine::{FanOut, GateObserver, OutcomeCountStore, OutcomeTally};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How often the tally is written.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// The longest one flush may take (a store that does not answer: the flush is dropped
/// and, being cancel-safe, keeps its counts for the next one).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest one of the flushes at exit may take (three at most): a store that is gone
/// delays the exit by seconds, not by the pool's connect timeout.
const FINAL_FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// The running flusher of one tally: stop it with [`finish`](Flusher::finish) to write
/// what is left.
pub struct Flusher {
    tally: Arc<OutcomeTally>,
    sink: Arc<dyn OutcomeCountStore>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

/// One flush, logged; returns whether it succeeded. `failing` remembers whether the last
/// one failed, so that a store that stays unwritable warns once, not every second.
async fn flush_logged(
    tally: &OutcomeTally,
    sink: &dyn OutcomeCountStore,
    failing: &mut bool,
    timeout: Duration,
) -> bool {
    let flushed = match tokio::time::timeout(timeout, tally.flush(sink)).await {
        Ok(r) => r,
        Err(_) => Err(idem_engine::StoreError::other(
            format!("no answer within {timeout:?}"),
            true,
        )),
    };
    match flushed {
        Ok(n) => {
            if *failing {
                tracing::info!(target: "idem::tally", deliveries = n, "outcome counts written again");
            }
            *failing = false;
            true
        }
        Err(e) => {
            if *failing {
                tracing::debug!(target: "idem::tally", error = %e, "writing outcome counts failed again; kept for the next try");
            } else {
                tracing::warn!(target: "idem::tally", error = %e, "writing outcome counts to idem_outcome_counts failed; kept for the next try (run `idem migrate`, or grant INSERT, UPDATE on it)");
            }
            *failing = true;
            false
        }
    }
}

impl Flusher {
    /// Starts flushing `tally` into `sink` every `every`.
    pub fn spawn(
        tally: Arc<OutcomeTally>,
        sink: Arc<dyn OutcomeCountStore>,
        every: Duration,
    ) -> Self {
        let (stop, mut stopped) = oneshot::channel::<()>();
        let task = {
            let (tally, sink) = (Arc::clone(&tally), Arc::clone(&sink));
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick.tick().await; // the first tick is immediate
                let mut failing = false;
                loop {
                    tokio::select! {
                        _ = &mut stopped => break,
                        _ = tick.tick() => {
                            flush_logged(&tally, sink.as_ref(), &mut failing, FLUSH_TIMEOUT).await;
                        }
                    }
                }
            })
        };
        Self {
            tally,
            sink,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Stops the periodic flushes and writes what is left (up to three tries of two
    /// seconds, a short pause between). Returns whether everything counted was written;
    /// what could not be is logged as lost.
    pub async fn finish(mut self) -> bool {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            // A flush in progress finishes (it is bounded by FLUSH_TIMEOUT): aborting it
            // could leave a committed flush counted again by the final one.
            let _ = task.await;
        }
        let mut failing = false;
        for attempt in 0..3 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let sink = self.sink.as_ref();
            if flush_logged(&self.tally, sink, &mut failing, FINAL_FLUSH_TIMEOUT).await {
                return true;
            }
        }
        let lost: u64 = self.tally.drain().iter().map(|c| c.count).sum();
        tracing::warn!(target: "idem::tally", deliveries = lost, "outcome counts not written at exit: lost");
        false
    }
}

impl std::fmt::Debug for Flusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flusher")
            .field("running", &self.task.is_some())
            .finish_non_exhaustive()
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// `observer` with an [`OutcomeTally`] beside it that a [`Flusher`] writes into `sink`
/// every [`FLUSH_EVERY`] — when the store keeps outcome counts (`sink` is `Some`);
/// otherwise `observer` alone. Call [`Flusher::finish`] at exit.
pub fn with_outcome_tally(
    observer: Arc<dyn GateObserver>,
    sink: Option<Arc<dyn OutcomeCountStore>>,
) -> (Arc<dyn GateObserver>, Option<Flusher>) {
    match sink {
        Some(sink) => {
            let tally = Arc::new(OutcomeTally::new());
            let flusher = Flusher::spawn(Arc::clone(&tally), sink, FLUSH_EVERY);
            let both: Arc<dyn GateObserver> = Arc::new(FanOut::new(vec![observer, tally]));
            (both, Some(flusher))
        }
        None => (observer, None),
    }
}
