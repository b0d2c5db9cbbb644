//! [`FailingEffects`]: the test kit's handler with failures of the handler's own.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_engine::{ClaimMeta, Handler, HandlerError, Headers, RejectReason, Submission};

use crate::harness::{EffectHandlerFor, EffectInput, TestStore};

/// The test kit's handler ([`EffectHandlerFor`]), except that a run of a submission whose
/// subject starts with `prefix` fails with a transient error of the handler's own (its
/// downstream is down), `slow` after it began, until `limit` such runs have failed (over
/// every subject: a limit of 1 fails the first such run only). It counts those runs
/// ([`failures`](Self::failures)); clones share the count.
#[derive(Debug)]
pub struct FailingEffects<S> {
    inner: EffectHandlerFor<S>,
    prefix: &'static str,
    limit: u32,
    slow: Duration,
    failures: Arc<AtomicU32>,
}

impl<S> FailingEffects<S> {
    /// Fails the first `limit` runs of submissions whose subject starts with `prefix`.
    pub fn new(prefix: &'static str, limit: u32) -> Self {
        Self {
            inner: EffectHandlerFor::new(),
            prefix,
            limit,
            slow: Duration::ZERO,
            failures: Arc::default(),
        }
    }

    /// Each failing run takes `slow` before it fails.
    #[must_use]
    pub fn with_slow(mut self, slow: Duration) -> Self {
        self.slow = slow;
        self
    }

    /// How many runs failed so far.
    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::SeqCst)
    }
}

impl<S> Clone for FailingEffects<S> {
    fn clone(&self) -> Self {
        Self {
            inner: EffectHandlerFor::new(),
            prefix: self.prefix,
            limit: self.limit,
            slow: self.slow,
            failures: Arc::clone(&self.failures),
        }
    }
}

#[async_trait]
impl<S: TestStore> Handler<S::Tx> for FailingEffects<S> {
    type Input = EffectInput;

    fn identify(
        &self,
        payload: &[u8],
        headers: &Headers,
    ) -> Result<Submission<EffectInput>, RejectReason> {
        self.inner.identify(payload, headers)
    }

    fn claim_meta(&self, sub: &Submission<EffectInput>) -> ClaimMeta {
        self.inner.claim_meta(sub)
    }

    async fn handle(
        &self,
        tx: &mut S::Tx,
        sub: &Submission<EffectInput>,
    ) -> Result<(), HandlerError> {
        if sub.subject.starts_with(self.prefix)
            && self
                .failures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < self.limit).then_some(n + 1)
                })
                .is_ok()
        {
            tokio::time::sleep(self.slow).await;
            return Err(HandlerError::Transient("its downstream is down".into()));
        }
        self.inner.handle(tx, sub).await
    }
}
