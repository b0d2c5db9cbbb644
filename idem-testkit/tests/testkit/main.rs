//! The integration tests of `idem-testkit`, one module per former test file, in one test
//! binary: the dependency world is linked once instead of once per file.
//! `property_mutant.rs` stays a binary of its own, built only with the `mutants` feature.
//!
//! Some modules change state of the whole process and rely on one process per test, as
//! `scripts/test` runs them (`cargo nextest`); under plain `cargo test`, whose tests share
//! one process, they could disturb the tests running beside them:
//! - `explore` switches the explorer's mutants on and off (`idem_engine::mutant::set`,
//!   process-wide with the `mutants` feature); its own tests take turns on a lock;
//! - `properties` chains a panic hook that silences the test kit's injected crashes.

mod conformance;
mod explore;
mod failures;
mod filter;
mod gate;
/// The proptest strategies (`idem_testkit::strategies`) are behind the `proptest` feature,
/// a default one.
#[cfg(feature = "proptest")]
mod properties;
mod trace;
