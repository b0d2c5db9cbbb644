//! The integration tests of `idem-store-postgres`, one module per former test file, in one
//! test binary: the dependency world is linked once instead of once per file. Each test
//! still gets its own schema (`common`), so they run in parallel.
//!
//! Some modules change state of the whole process and rely on one process per test, as
//! `scripts/test` runs them (`cargo nextest`); under plain `cargo test`, whose tests share
//! one process, they could disturb the tests running beside them:
//! - `positions` switches a mutant on (`idem_engine::mutant::set`, process-wide in a build
//!   with the `_mutants` feature);
//! - `tls` checks that no process-wide rustls crypto provider was installed, then installs
//!   one;
//! - `properties` chains a panic hook that silences the test kit's injected crashes.

mod common;

mod append_only;
mod cdc;
mod claims;
mod compat;
mod conflicts;
mod conformance;
mod conformance_distributed;
mod conformance_partitioned;
mod distributed;
mod durability;
mod edges_ddl;
mod export_plan;
mod inspect;
mod outcome_counts;
mod partitioned;
mod positions;
mod properties;
mod relay;
mod relay_failures;
mod retention;
mod roles;
mod rows;
mod timeouts;
mod tls;
mod warm;
