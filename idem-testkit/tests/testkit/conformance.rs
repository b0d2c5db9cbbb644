//! The in-memory reference store passes the conformance suite.

idem_testkit::conformance_tests!(idem_testkit::MemoryStore::new());

#[tokio::test]
async fn memory_outbox_backlog_tracks_the_relay() {
    let store = idem_testkit::MemoryStore::new();
    let source =
        idem_testkit::MemoryOutbox::new(store.clone(), std::time::Duration::from_millis(10));
    idem_testkit::conformance::outbox_backlog_tracks_the_relay(store, source).await;
}

#[tokio::test]
async fn memory_outbox_carries_the_traceparent() {
    let store = idem_testkit::MemoryStore::new();
    let source =
        idem_testkit::MemoryOutbox::new(store.clone(), std::time::Duration::from_millis(10));
    idem_testkit::conformance::outbox_carries_the_traceparent(store, source).await;
}
