//! The integration tests of `idem-store-redis`, one module per former test file, in one
//! test binary: the dependency world is linked once instead of once per file. Each test
//! still gets its own key prefix (`common`), so they run in parallel.
//!
//! Some modules change state of the whole process and rely on one process per test, as
//! `scripts/test` runs them (`cargo nextest`); under plain `cargo test`, whose tests share
//! one process, they could disturb the tests running beside them:
//! - `tls` sets `SSL_CERT_FILE`, checks that no process-wide rustls crypto provider was
//!   installed, and installs one (redis-rs installs ring's at its first TLS connection;
//!   a test installs the application's own);
//! - `filter`, `lease` and `cluster` chain a panic hook that silences the test kit's
//!   injected crashes (`common::quiet_crashes`, once per process).

// First, so that `per_client!` is in scope in the modules below.
#[macro_use]
mod common;

mod cluster;
mod conformance;
mod filter;
mod lease;
mod tls;
