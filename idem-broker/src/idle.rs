//! Ending a delivery stream when it goes quiet (`idem consume --exit-when-idle`).

use std::cell::RefCell;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::time::{sleep, Sleep};

/// Wraps `stream` so it ends when no item arrived for `idle` while it was being waited
/// for. Time spent by the caller between polls (processing a batch) does not count: the
/// clock runs only while the stream is polled and has nothing.
///
/// An adapter that knows better when its broker is quiet takes the decision over (SQS:
/// the stream ends once its receives have come back empty for `idle`, and never while a
/// receive is outstanding, so a slow receive from a deep queue is not taken for
/// idleness). It finds the limit while it is polled from inside this wrapper, through
/// any combinators in between that poll it in the same task (`map`, `then`, `chain`, a
/// `Box::pin`); polled from another task (behind a channel), the plain clock applies.
///
/// The wrapped stream must be `Unpin` (pin it with `Box::pin` if it is not).
///
/// ```no_run
/// # async fn demo(deliveries: impl futures::Stream<Item = u32>) {
/// use futures::StreamExt;
/// use std::time::Duration;
/// let mut quiet = idem_broker::until_idle(Box::pin(deliveries), Duration::from_secs(3));
/// while let Some(_item) = quiet.next().await {}
/// // three seconds without an item: done
/// # }
/// ```
pub fn until_idle<S: Stream>(stream: S, idle: Duration) -> UntilIdle<S> {
    UntilIdle {
        stream,
        idle,
        timer: None,
        done: false,
        link: Arc::new(IdleLink {
            limit: idle,
            adopted: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        }),
    }
}

/// The idle limit an [`UntilIdle`] hands to the adapter it wraps, and the adapter's
/// answer.
#[derive(Debug)]
pub(crate) struct IdleLink {
    limit: Duration,
    /// The adapter decides (the plain clock is off).
    adopted: AtomicBool,
    /// The adapter found its broker quiet for the limit, with nothing outstanding.
    stopped: AtomicBool,
}

#[allow(dead_code)] // used by the SQS adapter
impl IdleLink {
    /// The idle time.
    pub(crate) fn limit(&self) -> Duration {
        self.limit
    }

    /// Ends the stream at its next `Pending`.
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }
}

thread_local! {
    /// The link of the `UntilIdle` whose inner stream is being polled on this thread.
    static POLLING: RefCell<Option<Arc<IdleLink>>> = const { RefCell::new(None) };
}

/// The idle limit of the [`until_idle`] wrapper polling the caller right now, if any;
/// the caller then decides when the stream is idle (and calls [`IdleLink::stop`]).
#[allow(dead_code)] // used by the SQS adapter
pub(crate) fn adopt() -> Option<Arc<IdleLink>> {
    POLLING.with(|p| p.borrow().clone()).inspect(|link| {
        link.adopted.store(true, Ordering::SeqCst);
    })
}

/// The stream returned by [`until_idle`].
#[derive(Debug)]
#[must_use = "streams do nothing unless polled"]
pub struct UntilIdle<S> {
    stream: S,
    idle: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    done: bool,
    link: Arc<IdleLink>,
}

impl<S: Stream + Unpin> Stream for UntilIdle<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let link = Arc::clone(&self.link);
        let outer = POLLING.with(|p| p.replace(Some(Arc::clone(&link))));
        let polled = Pin::new(&mut self.stream).poll_next(cx);
        POLLING.with(|p| *p.borrow_mut() = outer);
        match polled {
            Poll::Ready(Some(item)) => {
                self.timer = None;
                Poll::Ready(Some(item))
            }
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Pending if link.adopted.load(Ordering::SeqCst) => {
                self.timer = None;
                if link.stopped.load(Ordering::SeqCst) {
                    self.done = true;
                    return Poll::Ready(None);
                }
                Poll::Pending
            }
            Poll::Pending => {
                let idle = self.idle;
                let timer = self.timer.get_or_insert_with(|| Box::pin(sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        self.done = true;
                        Poll::Ready(None)
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

// `Sleep::poll` needs `Future` in scope.
use std::future::Future as _;

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use tokio::time::Instant;

    #[tokio::test]
    async fn ends_after_silence_but_not_before() {
        let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
        let mut s = until_idle(rx, Duration::from_millis(300));
        tx.unbounded_send(1).ok();
        assert_eq!(s.next().await, Some(1));
        let t0 = Instant::now();
        let tx2 = tx.clone();
        tokio::spawn(async move {
            sleep(Duration::from_millis(200)).await;
            tx2.unbounded_send(2).ok();
        });
        // 200 ms of silence is less than the idle limit: the item still arrives.
        assert_eq!(s.next().await, Some(2));
        assert!(t0.elapsed() >= Duration::from_millis(200));
        let t1 = Instant::now();
        assert_eq!(s.next().await, None);
        assert!(t1.elapsed() >= Duration::from_millis(300));
        // Once ended, it stays ended even if more arrives.
        tx.unbounded_send(3).ok();
        assert_eq!(s.next().await, None);
    }

    /// A stream that adopts the link and says when it is idle: the clock is off, even
    /// through a combinator; it ends when the stream calls `stop`.
    #[tokio::test]
    async fn an_adopting_stream_decides() {
        use std::sync::Mutex;
        let seen: Arc<Mutex<Option<Arc<IdleLink>>>> = Arc::default();
        let polls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (seen2, polls2) = (Arc::clone(&seen), Arc::clone(&polls));
        let inner = futures::stream::poll_fn(move |cx| {
            let n = polls2.fetch_add(1, Ordering::SeqCst);
            let mut slot = seen2.lock().unwrap();
            if slot.is_none() {
                *slot = adopt();
            }
            if n == 0 {
                return Poll::Ready(Some(1u32));
            }
            // Outstanding work for a while, well past the idle limit, then quiet.
            if n >= 3 {
                if let Some(l) = slot.as_ref() {
                    l.stop();
                }
            }
            let waker = cx.waker().clone();
            tokio::spawn(async move {
                sleep(Duration::from_millis(150)).await;
                waker.wake();
            });
            Poll::Pending
        })
        .map(|x| x + 1);
        let mut s = until_idle(Box::pin(inner), Duration::from_millis(100));
        assert_eq!(s.next().await, Some(2));
        let t0 = Instant::now();
        assert_eq!(s.next().await, None);
        // Not at 100 ms (the limit): only after the stream said so, on its fourth poll.
        assert!(
            t0.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t0.elapsed()
        );
        assert!(seen.lock().unwrap().is_some());
        assert!(polls.load(Ordering::SeqCst) >= 4);
    }
}
