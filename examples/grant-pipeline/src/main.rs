//! A grant-disbursement consumer on the embedded SQLite store.
//!
//! Publishes a few submissions — one of them twice, one of them malformed — to the
//! simulated at-least-once broker, consumes them through the gate, and shows that the
//! duplicate took effect once and the poison message was dead-lettered with its reason.
//!
//! Run it with `cargo run -p grant-pipeline`.

use idem_engine::{consumer, ConsumerConfig, Gate};
use idem_grant::{GrantDb, GrantHandler};
use idem_store_sqlite::{SqliteConfig, SqliteStore};
use idem_testkit::SimBroker;
use source::stream_from_broker;

mod source {
    use idem_engine::Delivery;
    use idem_testkit::{SimAcker, SimBroker};

    /// The broker's ready deliveries as a stream that ends when none is left.
    pub(crate) fn stream_from_broker(
        broker: SimBroker,
    ) -> impl futures::Stream<Item = Result<Delivery<SimAcker>, std::convert::Infallible>> {
        futures::stream::iter(std::iter::from_fn(move || broker.receive().map(Ok)))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("grants.db");
    let store = SqliteStore::connect(
        path.to_str().ok_or("non UTF-8 path")?,
        SqliteConfig::default(),
    )
    .await?;
    store.migrate_grants().await?;

    let broker = SimBroker::new(42);
    let award = br#"{"award_id":"A-2026-014","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":125000}"#;
    broker.publish(award.to_vec());
    broker.publish(award.to_vec()); // the broker delivers it again: at least once
    broker.publish(br#"{"award_id":"A-2026-015","submission_timestamp":"2026-07-01T09:05:00Z","amount_cents":98000}"#.to_vec());
    broker.publish(b"{not json".to_vec());

    let gate = Gate::new(store.clone(), GrantHandler::new());
    let stats = consumer::run(
        &gate,
        stream_from_broker(broker.clone()),
        ConsumerConfig::new(1, 1),
        std::future::pending::<()>(),
        |_| {},
    )
    .await?;

    let ledger = store.ledger().await?;
    println!(
        "processed {}, duplicates {}, rejected {}",
        stats.processed, stats.duplicates, stats.rejected
    );
    println!("disbursements: {}", ledger.len());
    for (_, reason) in broker.dead_letters() {
        println!("dead-lettered: {reason}");
    }
    assert_eq!(ledger.len(), 2, "one disbursement per distinct submission");
    assert_eq!(stats.duplicates, 1);
    assert!(broker.is_settled());
    Ok(())
}
