//! [`ReconnectingPublisher`].

use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;
use idem_engine::{OutboxEvent, PublishError, Publisher};
use tokio::sync::Mutex;

/// How a [`ReconnectingPublisher`] connects.
type Connect<P> = Box<dyn Fn() -> BoxFuture<'static, Result<P, PublishError>> + Send + Sync>;

/// A [`Publisher`] that connects on first use, and again after any failed publish (a
/// broker restart closes the connection; the next batch gets a new one). A failed
/// connection is a retryable [`PublishError`], so the relay backs off and tries again.
pub struct ReconnectingPublisher<P> {
    connect: Connect<P>,
    current: Mutex<Option<Arc<P>>>,
}

impl<P> fmt::Debug for ReconnectingPublisher<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReconnectingPublisher")
            .finish_non_exhaustive()
    }
}

impl<P: Publisher + 'static> ReconnectingPublisher<P> {
    /// A publisher that calls `connect` when it has no connection; `first`, when given,
    /// is used until it fails.
    pub fn new<F>(first: Option<P>, connect: F) -> Self
    where
        F: Fn() -> BoxFuture<'static, Result<P, PublishError>> + Send + Sync + 'static,
    {
        Self {
            connect: Box::new(connect),
            current: Mutex::new(first.map(Arc::new)),
        }
    }

    /// The connection in use, or a new one.
    async fn get(&self) -> Result<Arc<P>, PublishError> {
        let mut slot = self.current.lock().await;
        if let Some(p) = slot.as_ref() {
            return Ok(Arc::clone(p));
        }
        let p = Arc::new((self.connect)().await?);
        *slot = Some(Arc::clone(&p));
        Ok(p)
    }
}

#[idem_engine::async_trait]
impl<P: Publisher + 'static> Publisher for ReconnectingPublisher<P> {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        let publisher = self.get().await?;
        let r = publisher.publish(events).await;
        if r.is_err() {
            // Reconnect before the next batch (unless another batch already did).
            let mut slot = self.current.lock().await;
            if slot.as_ref().is_some_and(|p| Arc::ptr_eq(p, &publisher)) {
                *slot = None;
            }
        }
        r
    }
}
