//! # idem-engine
//!
//! The engine of exactly-once *effect* for consumers of at-least-once brokers, over the
//! contract in [`idem_core`] (re-exported here whole, so one dependency is enough):
//!
//! - the [`Gate`] runs claim → handler → commit → ack for one delivery or one batch: a
//!   duplicate rolls back and acks, bad input is dead-lettered with a reason, a failure is
//!   judged (the message's fault or the store's) and handed back or dead-lettered;
//! - [`consumer::run`] drives a gate over a stream of deliveries with bounded concurrency
//!   and graceful shutdown;
//! - the [`Relay`] publishes the outbox at least once with deterministic [`EventId`]s;
//! - [`Filtered`] puts a fast front filter of committed keys before a durable store;
//! - [`OutcomeTally`] counts outcomes per day for the audit report.
//!
//! Like the contract, the engine has no runtime and no driver: stores and broker adapters
//! live in their own crates, and `idem-runtime` adds the tokio parts.
//!
//! ```
//! # use idem_engine::*;
//! # async fn demo<S, H, A>(gate: Gate<S, H>, delivery: Delivery<A>)
//! # where S: ClaimStore, H: Handler<S::Tx>, A: Acker {
//! match gate.process(delivery).await {
//!     Outcome::Processed { key, .. } => println!("{} committed", key.short()),
//!     Outcome::Duplicate { .. } => println!("skipped a redelivery"),
//!     other => println!("{:?}", other.kind()),
//! }
//! # }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc(no_inline)]
pub use idem_core::*;

pub mod audit;
mod backoff;
pub mod consumer;
pub mod filter;
pub mod gate;
pub mod outbox;
pub mod tally;

pub use consumer::{ConsumerConfig, ConsumerStats};
pub use filter::{FilterStats, Filtered, FilteredTx, BREAKER_COOL_DOWN};
pub use gate::{
    ConflictPolicy, Gate, GateConfig, GateObserver, Handler, HandlerPanic, Identified, RetryPolicy,
    Stage, Submission,
};
pub use outbox::{Backoff, Relay, RelayObserver, RelayOptions, RelayStats};
pub use tally::{FanOut, OutcomeTally};
