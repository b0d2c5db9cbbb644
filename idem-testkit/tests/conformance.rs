//! The in-memory reference store passes the conformance suite.

idem_testkit::conformance_tests!(idem_testkit::MemoryStore::new());
