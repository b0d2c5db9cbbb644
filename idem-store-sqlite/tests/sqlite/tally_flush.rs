//! A tally flush is added once: the same flush id sent twice (its first answer lost, or
//! a timeout that dropped it while SQLite went on and committed) adds its counts once.

use crate::common;

use idem_engine::record::OutcomeCount;
use idem_engine::tally::FlushId;
use idem_engine::OutcomeCountStore;

#[tokio::test]
async fn the_same_flush_applied_twice_adds_once() {
    let t = common::fresh().await;
    let store: &dyn OutcomeCountStore = &t.store;
    let counts = [OutcomeCount::new("2026-07-01", "duplicate", "", 3)];
    let first = FlushId::new("a".repeat(32), 1);
    store
        .add_outcome_counts(&first, &counts)
        .await
        .expect("flush 1");
    store
        .add_outcome_counts(&first, &counts)
        .await
        .expect("flush 1 again");
    // An earlier flush of the same writer, arriving late, adds nothing either.
    let second = FlushId::new("a".repeat(32), 2);
    store
        .add_outcome_counts(&second, &counts)
        .await
        .expect("flush 2");
    store
        .add_outcome_counts(&FlushId::new("a".repeat(32), 1), &counts)
        .await
        .expect("flush 1 late");
    // Another writer's flush 1 is its own.
    store
        .add_outcome_counts(&FlushId::new("b".repeat(32), 1), &counts)
        .await
        .expect("other writer");
    let read = t
        .store
        .outcome_counts("2026-07-01", "2026-07-02")
        .await
        .expect("read")
        .expect("table");
    assert_eq!(read.iter().map(|c| c.count).sum::<u64>(), 9, "{read:?}");
}
