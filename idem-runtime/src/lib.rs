//! # idem-runtime
//!
//! What idem needs a runtime (tokio) for, between the broker adapters and the command, so
//! that `idem-core` stays pure and a downstream team gets everything `idem` does:
//!
//! - [`relay_options`]: core's [`RelayOptions`] with tokio's timer, so a
//!   [`Relay`](idem_engine::Relay) backs off, exits when idle and gives up on time;
//! - [`ReconnectingPublisher`]: a [`Publisher`](idem_engine::Publisher) that connects on first
//!   use and again after any failure (a broker restart closes the connection);
//! - [`retry`]: a connection attempt retried with backoff until a deadline, stopping at
//!   once on a mistake no retry can fix ([`Attempt::Final`]);
//! - [`supervise`](supervise::supervise): the supervised consumer — reconnects a closed
//!   delivery stream with backoff, slows down while the store keeps failing, gives up
//!   after the reconnect deadline, and keeps its counts across reconnects;
//! - [`Deadline`]: a handler whose attempt fails once it has run past its deadline, so a
//!   handler that never returns cannot hold its delivery for ever;
//! - [`tally`]: the outcome tally (per day: processed, duplicates, conflicts, dead letters
//!   by reason) written to the store's `idem_outcome_counts` every second, off the
//!   delivery path;
//! - [`metrics`] (feature `metrics`): the Prometheus collectors of the gate, the relay, the
//!   front filter and the outbox backlog, with `/metrics`, `/healthz` and `/readyz`, for a
//!   service that embeds them.
//!
//! A relay from an outbox (here the testkit's in-memory one) to a broker (here its
//! simulated one), exiting once idle:
//!
//! ```
//! use std::time::Duration;
//! use idem_engine::{ClaimMeta, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent, OutboxWriter, Relay};
//! use idem_testkit::{MemoryOutbox, MemoryStore, SimBroker};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MemoryStore::new();
//! let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}")?;
//! let mut tx = store.begin().await?;
//! tx.claim(&key, &ClaimMeta::new("A-1")).await?;
//! tx.enqueue(&OutboxEvent::new(key, "disbursement.recorded", "A-1", "{}")).await?;
//! tx.commit().await?;
//!
//! let broker = SimBroker::new(1);
//! let options = idem_runtime::relay_options()
//!     .batch_size(1000)
//!     .exit_when_idle(Some(Duration::from_millis(50)))
//!     .give_up_after(Some(Duration::from_secs(60)));
//! let source = MemoryOutbox::new(store.clone(), Duration::from_millis(10));
//! let relay = Relay::with_options(source, broker.clone(), options);
//! let stats = relay.run(std::future::pending()).await?;
//! assert_eq!(stats.published, 1);
//! assert_eq!(broker.published_events().len(), 1);
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod deadline;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
mod publisher;
mod retry;
pub mod supervise;
pub mod tally;

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
pub use idem_engine::outbox::{Backoff, RelayOptions, Sleep};

pub use deadline::{Deadline, DeadlineExceeded};
pub use publisher::ReconnectingPublisher;
pub use retry::{retry, Attempt, GaveUp};

/// tokio's timer as core's [`Sleep`].
pub fn tokio_sleep() -> Sleep {
    Arc::new(|d: Duration| tokio::time::sleep(d).boxed())
}

/// [`RelayOptions::default`] with tokio's timer.
pub fn relay_options() -> RelayOptions {
    RelayOptions::default().sleep(tokio_sleep())
}

// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
