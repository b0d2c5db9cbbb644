//! # idem-testkit
//!
//! Everything needed to prove exactly-once *effect* without a single server:
//!
//! - [`MemoryStore`]: an in-memory transactional store with Postgres's claim semantics;
//! - [`SimBroker`]: a simulated at-least-once broker (redelivery, nack, crash, dead
//!   letters), deterministic from a seed;
//! - [`fault`]: wrappers that crash the pipeline at every step;
//! - [`Ledger`]: the model that asserts exactly-once;
//! - [`conformance`]: the suite every store runs ([`conformance_tests!`]);
//! - [`sim`]: a driver that runs a whole schedule of deliveries, redeliveries and crashes;
//! - [`strategies`]: proptest strategies for schedules.

pub mod broker;
pub mod conformance;
pub mod explore;
pub mod fault;
pub mod harness;
pub mod ledger;
pub mod memory;
pub mod sim;
#[cfg(feature = "proptest")]
pub mod strategies;

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
