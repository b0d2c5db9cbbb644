//! The SQLite store passes the shared conformance suite.

mod common;

idem_testkit::conformance_tests!(common::fresh().await);
