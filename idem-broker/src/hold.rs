//! Deliveries held by a consumer and handed back into its own stream after a delay,
//! without a round trip through the broker (NATS JetStream, SQS, Redis Streams).
//!
//! A broker that counts every redelivery against a limit (JetStream's `max_deliver`, an
//! SQS redrive policy's `maxReceiveCount`) would end a message that the gate only
//! waited on — a key held by another transaction, a store outage — if each wait went
//! back through the broker. Instead the adapter keeps the delivery alive (its keep-alive
//! goes on extending it) and this module hands it back when the delay has passed.

use std::time::Duration;

use tokio::sync::mpsc;

/// Sends `item` into `into` (the channel the consumer's stream reads) after `delay`,
/// from a spawned task. If the stream is dropped first — before the delay is up or
/// while the item is on its way — `gone` gets the item back at once, so the adapter
/// stops keeping it alive and the broker delivers it again after its own timeout.
pub(crate) fn hand_back_after<T, F>(
    into: mpsc::UnboundedSender<T>,
    item: T,
    delay: Duration,
    gone: F,
) where
    T: Send + 'static,
    F: FnOnce(T) + Send + 'static,
{
    tokio::spawn(async move {
        tokio::select! {
            () = tokio::time::sleep(delay) => {
                if let Err(mpsc::error::SendError(item)) = into.send(item) {
                    gone(item);
                }
            }
            () = into.closed() => gone(item),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn an_item_comes_back_after_its_delay() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let start = tokio::time::Instant::now();
        hand_back_after(tx, 7u32, Duration::from_millis(200), |_| {
            panic!("the stream is alive")
        });
        assert_eq!(rx.recv().await, Some(7));
        assert!(start.elapsed() >= Duration::from_millis(200));
    }

    #[tokio::test]
    async fn a_dropped_stream_gets_nothing_and_the_item_is_given_up_at_once() {
        let (tx, rx) = mpsc::unbounded_channel::<u32>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let given_up = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&given_up);
        let start = tokio::time::Instant::now();
        hand_back_after(tx, 7, Duration::from_secs(3_600), move |item| {
            flag.store(item == 7, Ordering::SeqCst);
            let _ = done_tx.send(tokio::time::Instant::now());
        });
        drop(rx);
        let at = done_rx.await.expect("given up");
        assert!(given_up.load(Ordering::SeqCst));
        assert!(
            at.duration_since(start) < Duration::from_secs(1),
            "not after the delay"
        );
    }
}
