//! # idem-runtime
//!
//! What idem needs a runtime (tokio) for, between the broker adapters and the command, so
//! that `idem-core` stays pure and a downstream team gets everything `idem` does:
//!
//! - [`relay_options`]: core's [`RelayOptions`] with tokio's timer, so a
//!   [`Relay`](idem_core::Relay) backs off, exits when idle and gives up on time;
//! - [`ReconnectingPublisher`]: a [`Publisher`](idem_core::Publisher) that connects on first
//!   use and again after any failure (a broker restart closes the connection);
//! - [`retry`]: a connection attempt retried with backoff until a deadline, stopping at
//!   once on a mistake no retry can fix ([`Attempt::Final`]);
//! - [`supervise`](supervise::supervise): the supervised consumer — reconnects a closed
//!   delivery stream with backoff, slows down while the store keeps failing, gives up
//!   after the reconnect deadline, and keeps its counts across reconnects.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::{OutboxSource, Publisher, Relay};
//!
//! async fn relay(source: impl OutboxSource, broker: impl Publisher) -> Result<(), idem_core::Error> {
//!     let options = idem_runtime::relay_options()
//!         .batch_size(1000)
//!         .exit_when_idle(Some(Duration::from_secs(5)))
//!         .give_up_after(Some(Duration::from_secs(60)));
//!     let relay = Relay::with_options(source, broker, options);
//!     let stats = relay.run(async { let _ = tokio::signal::ctrl_c().await; }).await?;
//!     println!("published {}, moved aside {}", stats.published, stats.moved_aside);
//!     Ok(())
//! }
//! ```

mod publisher;
mod retry;
pub mod supervise;

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
pub use idem_core::outbox::{Backoff, RelayOptions, Sleep};

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
