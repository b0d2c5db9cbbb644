//! Ending a delivery stream when it goes quiet (`idem consume --exit-when-idle`).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::time::{sleep, Sleep};

/// Wraps `stream` so it ends when no item arrived for `idle` while it was being waited
/// for. Time spent by the caller between polls (processing a batch) does not count: the
/// clock runs only while the stream is polled and has nothing.
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
    }
}

/// The stream returned by [`until_idle`].
#[derive(Debug)]
#[must_use = "streams do nothing unless polled"]
pub struct UntilIdle<S> {
    stream: S,
    idle: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    done: bool,
}

impl<S: Stream + Unpin> Stream for UntilIdle<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.stream).poll_next(cx) {
            Poll::Ready(Some(item)) => {
                self.timer = None;
                Poll::Ready(Some(item))
            }
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
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
}
