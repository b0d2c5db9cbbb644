//! What the batch acks of the adapters that settle a batch in one operation (RabbitMQ's
//! multiple-ack, Redis's `XACK`, SQS's `DeleteMessageBatch`) have in common.

use std::sync::Arc;

use idem_core::AckProof;

/// The one connection every acker of `items` settles through (`shared` of each), or
/// `None` when there are none or they are not all of one (deliveries of two consumers in
/// one batch): a batch operation covers one connection's deliveries, and a batch of
/// several connections is acked one by one ([`Acker::ack_each`](idem_core::Acker::ack_each)).
pub(crate) fn one_connection<A, S>(
    items: &[(A, AckProof)],
    shared: impl Fn(&A) -> &Arc<S>,
) -> Option<Arc<S>> {
    let (first, _) = items.first()?;
    let one = shared(first);
    items
        .iter()
        .all(|(a, _)| Arc::ptr_eq(shared(a), one))
        .then(|| Arc::clone(one))
}

/// The result of one operation that settled `n` deliveries, once for each of them.
#[cfg(any(feature = "rabbitmq", feature = "redis-streams"))]
pub(crate) fn each_of(
    n: usize,
    r: Result<(), idem_core::AckError>,
) -> Vec<Result<(), idem_core::AckError>> {
    match r {
        Ok(()) => (0..n).map(|_| Ok(())).collect(),
        Err(e) => (0..n)
            .map(|_| {
                Err(idem_core::AckError::new(
                    e.message.clone(),
                    e.retryable,
                    None,
                ))
            })
            .collect(),
    }
}
