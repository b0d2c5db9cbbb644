//! The integration tests of `idem-store-sqlite`, one module per former test file, in one
//! test binary: the dependency world is linked once instead of once per file. Each test
//! still gets its own database file (`common`), so they run in parallel.
//!
//! Some modules change state of the whole process and rely on one process per test, as
//! `scripts/test` runs them (`cargo nextest`); under plain `cargo test`, whose tests share
//! one process, they could disturb the tests running beside them:
//! - `positions` switches a mutant on (`idem_engine::mutant::set`, process-wide in a build
//!   with the `_mutants` feature);
//! - `properties` chains a panic hook that silences the test kit's injected crashes.

mod common;

mod conflicts;
mod conformance;
mod durability;
mod full_disk;
mod outcome_counts;
mod positions;
mod properties;
mod relay;
mod retention;
mod store;
mod tally_flush;
