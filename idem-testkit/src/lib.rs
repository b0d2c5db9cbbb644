//! # idem-testkit
//!
//! Everything needed to prove exactly-once *effect* without a single server. The
//! simulated world (the in-memory store, the broker, the faults, the ledger, the driver)
//! comes from [`idem_sim`], re-exported here under the same paths:
//!
//! - [`MemoryStore`]: an in-memory transactional store with Postgres's claim semantics;
//! - [`SimBroker`]: a simulated at-least-once broker (redelivery, nack, crash, dead
//!   letters), deterministic from a seed;
//! - [`fault`]: wrappers that crash the pipeline at every step;
//! - [`Ledger`]: the model that asserts exactly-once;
//! - [`conformance`]: the suite every store runs ([`conformance_tests!`]);
//! - [`broker_conformance`]: the suite every broker adapter runs on its real server
//!   ([`broker_conformance::BrokerUnderTest`], [`broker_conformance_tests!`]), so an
//!   adapter of your own proves itself as idem's do;
//! - [`sim`]: a driver that runs a whole schedule of deliveries, redeliveries and crashes,
//!   and the crash-at-every-step suite for a handler of your own on your own store
//!   ([`sim::crash_suite`], [`sim::check_handler`]);
//! - [`strategies`]: proptest strategies for schedules;
//! - [`explore`]: an exhaustive explorer of the real gate's interleavings and faults.
//!
//! A schedule with duplicates, redeliveries and a crash after every commit (before its
//! ack), run through the real gate on the in-memory store, checked for exactly one
//! effect per submission — the same check every store's test suite runs:
//!
//! ```
//! use idem_testkit::{sim::{check_exactly_once, Case}, CrashPoint, MemoryStore};
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
//! println!("{report:?}");
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod broker_conformance;
pub mod conformance;
pub mod explore;
mod failing;
pub mod positions;
#[cfg(feature = "proptest")]
#[cfg_attr(docsrs, doc(cfg(feature = "proptest")))]
pub mod strategies;

// The simulated world, from idem-sim (the part a program may link), under the paths the
// kit has always given it: its modules (`sim`, `fault`, `memory`, …) and their items.
pub use idem_sim::*;

pub use failing::FailingEffects;

// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
