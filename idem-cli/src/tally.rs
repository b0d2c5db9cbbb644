//! Flushing an [`OutcomeTally`] into the store's `idem_outcome_counts` every second and
//! at exit (`idem consume`, `idem demo`), on a task of its own: a delivery never waits for
//! it. A failed flush keeps its counts for the next one and is logged (a warning when
//! flushes start failing, then quietly until one succeeds again).

use std::sync::Arc;
use std::time::Duration;

use idem_core::{OutcomeCountStore, OutcomeTally};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How often the tally is written.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// The longest one flush may take (a store that does not answer: the flush is dropped
/// and, being cancel-safe, keeps its counts for the next one).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest one of the flushes at exit may take (three at most): a store that is gone
/// delays the exit by seconds, not by the pool's connect timeout.
const FINAL_FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// The running flusher of one tally.
pub(crate) struct Flusher {
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
        Err(_) => Err(idem_core::StoreError::other(
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
    pub(crate) fn spawn(
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
    pub(crate) async fn finish(mut self) -> bool {
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

impl Drop for Flusher {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
