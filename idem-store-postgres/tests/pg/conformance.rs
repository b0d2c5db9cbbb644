//! The testkit's conformance suite against the real server, one fresh schema per test.

use crate::common;

idem_testkit::conformance_tests!(common::fresh_store().await);
