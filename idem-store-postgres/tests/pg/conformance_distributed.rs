//! The testkit's conformance suite on the distributed layout (`PgLayout::Distributed`):
//! the same checks, claims keyed `(award_id, idempotency_key)` and outbox events `(subject,
//! event_id)`, on plain Postgres. One fresh schema per test.

use crate::common;

idem_testkit::conformance_tests!(common::fresh_distributed_store().await);
