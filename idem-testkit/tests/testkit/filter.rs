//! The core front filter: a filter outage falls through, and the breaker keeps it cheap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use idem_engine::{
    async_trait, DoneFilter, Filtered, Gate, IdempotencyKey, OutcomeKind, StoreError,
};
use idem_testkit::{encode_submission, EffectHandlerFor, MemoryStore, SimBroker, TestStore};

/// A filter whose every call fails, counting the calls.
#[derive(Default)]
struct Down(Arc<AtomicU64>);

#[async_trait]
impl DoneFilter for Down {
    async fn seen(&self, _keys: &[IdempotencyKey]) -> Result<Vec<bool>, StoreError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Err(StoreError::unavailable(
            "filter down",
            std::io::Error::other("refused"),
        ))
    }

    async fn mark_done(&self, _keys: &[IdempotencyKey]) -> Result<(), StoreError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Err(StoreError::unavailable(
            "filter down",
            std::io::Error::other("refused"),
        ))
    }
}

#[tokio::test]
async fn an_outage_falls_through_and_the_breaker_skips_the_filter() {
    let calls = Arc::new(AtomicU64::new(0));
    let store = MemoryStore::new();
    let filtered = Filtered::new(store.clone(), Down(calls.clone()));
    let stats = filtered.stats_handle();
    let broker = SimBroker::new(1);
    for i in 0..50 {
        let b = encode_submission(&format!("A-{i}"), "t", 1);
        broker.publish(b.clone());
        broker.publish(b);
    }
    let gate = Gate::new(
        filtered,
        EffectHandlerFor::<Filtered<MemoryStore, Down>>::new(),
    );
    let mut processed = 0;
    while let Some(d) = broker.receive() {
        if gate.process(d).await.kind() == OutcomeKind::Processed {
            processed += 1;
        }
    }
    assert_eq!(processed, 50, "the durable store decided every claim");
    assert_eq!(store.effects().await.unwrap().len(), 50);
    assert_eq!(stats.hits(), 0);
    assert!(
        calls.load(Ordering::Relaxed) <= 2,
        "the breaker opened after the first error"
    );
    assert!(
        stats.bypassed() >= 98,
        "later lookups and marks were skipped: {}",
        stats.bypassed()
    );
}
