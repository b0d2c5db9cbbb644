//! # idem-sim
//!
//! The simulated world that `idem demo`, the `memory://` store and idem's test kit run in,
//! deterministic from a seed and without a single server:
//!
//! - [`MemoryStore`]: an in-memory transactional store with Postgres's claim semantics
//!   (and an outbox, [`MemoryOutbox`]);
//! - [`SimBroker`]: a simulated at-least-once broker (redelivery, nack, crash, dead
//!   letters);
//! - [`fault`]: wrappers that crash the pipeline at every step;
//! - [`Ledger`]: the model that checks a run for exactly one effect per submission;
//! - [`sim`]: a driver that runs a whole schedule of deliveries, redeliveries and crashes
//!   through the real gate, and the crash-at-every-step suite for a handler of your own on
//!   your own store ([`sim::crash_suite`], [`sim::check_handler`]).
//!
//! It is the part of `idem-testkit` that a program may link: the test kit re-exports
//! every item here under the same paths (`idem_testkit::sim`, `idem_testkit::MemoryStore`,
//! …) and adds what only tests need (the conformance suites, the proptest strategies, the
//! explorer, the TLS test servers).
//!
//! A schedule with duplicates, redeliveries and a crash after every commit (before its
//! ack), run through the real gate on the in-memory store, checked for exactly one
//! effect per submission:
//!
//! ```
//! use idem_sim::{sim::{check_exactly_once, Case}, CrashPoint, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), String> {
//! let case = Case {
//!     submissions: vec![
//!         ("A-1".into(), "2026-07-01T09:00:00Z".into(), 125_000),
//!         ("A-2".into(), "2026-07-01T09:05:00Z".into(), 80_000),
//!         ("A-1".into(), "2026-07-01T09:00:00Z".into(), 125_000), // sent twice
//!     ],
//!     poison: 1,
//!     redelivery_rate: 0.5,
//!     crashes: vec![(CrashPoint::AfterCommitBeforeAck, 1)],
//!     errors: vec![],
//!     expiry_rate: 0.0,
//!     concurrency: 2,
//!     batch_size: 1,
//!     seed: 7,
//! };
//! let report = check_exactly_once(MemoryStore::new(), &case).await?;
//! println!("exactly once, across {} injected crashes", report.total_crashes());
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod broker;
pub mod fault;
pub mod harness;
pub mod ledger;
pub mod memory;
pub mod sim;

pub use broker::{BrokerStats, SimAcker, SimBroker, SimMessage};
pub use fault::{
    CrashPoint, ErrorPoint, FaultPlan, FaultyAcker, FaultyHandler, FaultyStore, FaultyTx,
};
pub use harness::{
    encode_submission, Effect, EffectHandler, EffectHandlerFor, EffectInput, TestStore,
};
pub use ledger::{Ledger, Violation};
pub use memory::{ClaimRecord, MemoryOutbox, MemoryOutboxBatch, MemoryStore, MemoryTx, Row};
pub use sim::{SimConfig, SimReport};

// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
