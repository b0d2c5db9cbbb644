//! The supervised consumer: a delivery stream the broker closes is reconnected, the
//! counts survive every reconnect, and the run ends once the broker goes quiet.

use std::convert::Infallible;
use std::pin::Pin;
use std::time::Duration;

use futures::{FutureExt as _, Stream};
use idem_core::{ConsumerConfig, Delivery, Gate};
use idem_runtime::supervise::{supervise, SupervisorConfig};
use idem_runtime::Attempt;
use idem_testkit::harness::{encode_submission, EffectHandlerFor};
use idem_testkit::{MemoryStore, SimAcker, SimBroker};

type Deliveries = Pin<Box<dyn Stream<Item = Result<Delivery<SimAcker>, Infallible>> + Send>>;

#[tokio::test]
async fn a_closed_stream_is_reconnected_and_counts_survive() {
    let broker = SimBroker::new(7);
    for i in 0..6 {
        broker.publish(encode_submission(
            &format!("A-{i}"),
            "2026-07-01T09:00:00Z",
            100,
        ));
    }
    let gate = Gate::new(MemoryStore::new(), EffectHandlerFor::<MemoryStore>::new());
    // Each connection hands out at most 2 deliveries, then the broker "closes" it; once
    // nothing is left, a connection stays open and quiet.
    let b = broker.clone();
    let connect = move || {
        let batch = b.receive_many(2);
        async move {
            let s: Deliveries = if batch.is_empty() {
                Box::pin(futures::stream::pending())
            } else {
                Box::pin(futures::stream::iter(batch.into_iter().map(Ok)))
            };
            Ok::<_, Attempt<std::io::Error>>(s)
        }
        .boxed()
    };
    let config = SupervisorConfig::new(ConsumerConfig::new(1, 1))
        .exit_when_idle(Some(Duration::from_millis(200)))
        .reconnect_timeout(Duration::from_secs(5));
    let run = supervise(&gate, None, connect, config, std::future::pending(), |_| {});
    let done = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the supervisor did not return")
        .expect("supervise");
    assert_eq!(done.stats.processed, 6, "{done:?}");
    assert_eq!(done.stats.deliveries(), 6);
    assert!(done.reconnects >= 3, "{done:?}");
    assert!(broker.is_settled());
}
