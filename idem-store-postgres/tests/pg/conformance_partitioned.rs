//! The testkit's conformance suite on the partitioned layout (`PgLayout::Partitioned`):
//! the same checks, claims filed by submission month. One fresh schema per test.

use crate::common;

idem_testkit::conformance_tests!(common::fresh_partitioned_store().await);
