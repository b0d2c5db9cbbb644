//! The delivery stream of the adapters that pull (Redis Streams, SQS, Kafka): a reader
//! with an `async fn next`, turned into a `Stream` once, here.

use std::future::Future;

use futures::stream::BoxStream;
use futures::StreamExt as _;
use idem_core::Delivery;

use crate::BrokerError;

/// An adapter's reader: the next delivery, fetching more from the broker when its buffer
/// is empty.
pub(crate) trait Pull: Send + 'static {
    /// The adapter's acker.
    type Acker: Send + 'static;

    /// The next delivery, or the error that ends the stream.
    fn next(&mut self) -> impl Future<Output = Result<Delivery<Self::Acker>, BrokerError>> + Send;
}

/// The reader's deliveries as a stream; an error is yielded, then ends the stream.
pub(crate) fn deliveries<R: Pull>(
    reader: R,
) -> BoxStream<'static, Result<Delivery<R::Acker>, BrokerError>> {
    futures::stream::unfold(Some(reader), |state| async move {
        let mut reader = state?;
        match reader.next().await {
            Ok(d) => Some((Ok(d), Some(reader))),
            Err(e) => Some((Err(e), None)),
        }
    })
    .boxed()
}
