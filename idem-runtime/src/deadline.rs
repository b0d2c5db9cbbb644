//! A deadline for the handler: [`Deadline`] wraps a [`Handler`] so that an attempt whose
//! business writes do not return in time fails like a transient error.
//!
//! Without a deadline, a handler that never returns (a lock it waits on with no timeout,
//! a call to a service that hangs) holds its delivery, its transaction and any lease it
//! keeps alive for ever: the broker sees an unacked delivery that is never settled, and
//! nothing says why. With one, the attempt fails once `limit` has passed, as a store that
//! did not answer in time ([`StoreError::Unavailable`] with [`DeadlineExceeded`] as its
//! source): the handler's future is dropped (which stops whatever it was doing, a lease's
//! keep-alive included), the gate rolls the transaction back and defers the delivery with
//! its retry delay. The attempt counts against the message only with the store's evidence
//! that it works for others (see [`GateConfig::max_attempts`]): a store slow for everyone
//! dead-letters nothing, while a message whose handler alone never returns is
//! dead-lettered with `attempts_exhausted` and this error once its attempts run out.
//!
//! Dropping the future stops the client, not the server: a statement still running there
//! holds the connection, and the rollback waits for it. Give the store the same bound
//! (idem-store-postgres's `PgConfig::statement_timeout`, which `idem consume
//! --handler-timeout` sets), so that the server cancels the statement at the deadline.
//!
//! ```
//! use std::time::Duration;
//! use idem_engine::{Gate, GateConfig};
//! use idem_runtime::Deadline;
//! use idem_testkit::{EffectHandlerFor, MemoryStore};
//!
//! let handler = Deadline::new(EffectHandlerFor::<MemoryStore>::new(), Duration::from_secs(30));
//! let gate = Gate::with_config(MemoryStore::new(), handler, GateConfig::default());
//! # let _ = gate;
//! ```
//!
//! [`GateConfig::max_attempts`]: idem_engine::GateConfig::max_attempts

use std::time::Duration;

use async_trait::async_trait;
use idem_engine::{
    ClaimMeta, Handler, HandlerError, Headers, RejectReason, StoreError, Submission,
};

/// A [`Handler`] whose [`handle`](Handler::handle) and
/// [`handle_batch`](Handler::handle_batch) must return within `limit`; see the
/// [module](self).
#[derive(Debug, Clone)]
pub struct Deadline<H> {
    inner: H,
    limit: Duration,
}

impl<H> Deadline<H> {
    /// `inner` with a deadline of `limit` per attempt (per batch for a batch).
    pub fn new(inner: H, limit: Duration) -> Self {
        Self { inner, limit }
    }

    /// The wrapped handler.
    pub fn inner(&self) -> &H {
        &self.inner
    }

    /// The deadline.
    pub fn limit(&self) -> Duration {
        self.limit
    }
}

/// The failure of an attempt past its deadline: the store's side did not answer in time.
fn past(limit: Duration) -> HandlerError {
    HandlerError::Store(StoreError::Unavailable {
        message: format!("the handler did not return within its deadline of {limit:?}"),
        source: Some(Box::new(DeadlineExceeded(limit))),
    })
}

/// An attempt's handler did not return within its [`Deadline`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the handler did not return within its deadline of {0:?}")]
pub struct DeadlineExceeded(pub Duration);

#[async_trait]
impl<Tx: Send, H: Handler<Tx>> Handler<Tx> for Deadline<H> {
    type Input = H::Input;

    fn identify(
        &self,
        payload: &[u8],
        headers: &Headers,
    ) -> Result<Submission<Self::Input>, RejectReason> {
        self.inner.identify(payload, headers)
    }

    async fn handle(
        &self,
        tx: &mut Tx,
        submission: &Submission<Self::Input>,
    ) -> Result<(), HandlerError> {
        match tokio::time::timeout(self.limit, self.inner.handle(tx, submission)).await {
            Ok(r) => r,
            Err(_) => Err(past(self.limit)),
        }
    }

    fn claim_meta(&self, submission: &Submission<Self::Input>) -> ClaimMeta {
        self.inner.claim_meta(submission)
    }

    async fn handle_batch(
        &self,
        tx: &mut Tx,
        submissions: &[&Submission<Self::Input>],
    ) -> Result<(), HandlerError> {
        match tokio::time::timeout(self.limit, self.inner.handle_batch(tx, submissions)).await {
            Ok(r) => r,
            Err(_) => Err(past(self.limit)),
        }
    }
}
