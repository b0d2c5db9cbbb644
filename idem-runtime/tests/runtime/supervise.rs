//! The supervised consumer: a delivery stream the broker closes is reconnected, the
//! counts survive every reconnect, and the run ends once the broker goes quiet.

use std::convert::Infallible;
use std::pin::Pin;
use std::time::Duration;

use futures::{FutureExt as _, Stream, StreamExt as _};
use idem_engine::{ConsumerConfig, Delivery, Gate};
use idem_runtime::supervise::{supervise, SourceCheck, SuperviseError, SupervisorConfig};
use idem_runtime::Attempt;
use idem_testkit::harness::{encode_submission, EffectHandlerFor};
use idem_testkit::{MemoryStore, SimAcker, SimBroker};

/// The testkit's handler, except that the first run of a submission whose subject starts
/// with `ONCE` fails (a transient error of the handler's own).
type FailsOnce = idem_testkit::FailingEffects<MemoryStore>;

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

/// A store that gives no transaction: each `begin` waits 300 ms (a pool waiting for a
/// connection) and fails, and its probe fails too.
#[derive(Debug, Clone, Default)]
struct Down;

#[idem_engine::async_trait]
impl idem_engine::ClaimStore for Down {
    type Tx = <MemoryStore as idem_engine::ClaimStore>::Tx;

    async fn begin(&self) -> Result<Self::Tx, idem_engine::StoreError> {
        tokio::time::sleep(Duration::from_millis(300)).await;
        Err(idem_engine::StoreError::Unavailable {
            message: "connection refused".into(),
            source: None,
        })
    }

    fn capabilities(&self) -> idem_engine::Capabilities {
        idem_engine::Capabilities::TRANSACTIONAL
    }

    async fn probe(&self) -> Result<(), idem_engine::StoreError> {
        self.begin().await.map(|_| ())
    }
}

/// `--reconnect-timeout` is kept whatever the workers are doing: a batch of 100 whose
/// store gives no transaction fails at once (one `begin`, not one per delivery), and the
/// run ends with `StoreFailing` about the deadline after the failures began. Before, the
/// batch fell back to one transaction per delivery (100 × 300 ms) and the deadline was
/// checked only when the stream was polled again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconnect_timeout_holds_while_the_workers_wait_on_the_store() {
    let broker = SimBroker::new(3);
    for i in 0..300 {
        broker.publish(encode_submission(
            &format!("D-{i}"),
            "2026-07-01T09:00:00Z",
            1,
        ));
    }
    let gate = Gate::new(Down, EffectHandlerFor::<MemoryStore>::new());
    let b = broker.clone();
    let connect = move || {
        let batch = b.receive_many(100);
        async move {
            let s: Deliveries = Box::pin(
                futures::stream::iter(batch.into_iter().map(Ok)).chain(futures::stream::pending()),
            );
            Ok::<_, Attempt<std::io::Error>>(s)
        }
        .boxed()
    };
    let config = SupervisorConfig::new(ConsumerConfig::new(1, 100))
        .reconnect_timeout(Duration::from_secs(1));
    let started = std::time::Instant::now();
    let run = supervise(&gate, None, connect, config, std::future::pending(), |_| {});
    let done = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the supervisor did not return");
    let took = started.elapsed();
    assert!(
        matches!(
            done,
            Err(idem_runtime::supervise::SuperviseError::StoreFailing { .. })
        ),
        "{done:?}"
    );
    assert!(took < Duration::from_secs(8), "gave up after {took:?}");
    assert!(broker.dead_letters().is_empty());
}

/// A drain ends only when drained: a delivery that failed comes back after its delay
/// (here 1.5 s, held by the broker's side), longer than the idle limit (300 ms); the run
/// waits for it and ends with it processed. Before, the run ended idle with the delivery
/// still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_run_waits_for_a_delivery_that_failed_and_comes_back() {
    let broker = SimBroker::new(5);
    let ts = "2026-07-01T09:00:00Z";
    broker.publish(encode_submission("ONCE-1", ts, 1));
    broker.publish(encode_submission("OK-1", ts, 2));
    let gate = Gate::new(MemoryStore::new(), FailsOnce::new("ONCE", 1));
    let b = broker.clone();
    // Every delivery seen before comes back 1.5 s late, as a broker's delayed redelivery.
    let connect = move || {
        let b = b.clone();
        async move {
            let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
            let s: Deliveries =
                Box::pin(futures::stream::unfold((b, seen), |(b, seen)| async move {
                    loop {
                        if let Some(d) = b.receive() {
                            let again = !seen.lock().unwrap().insert(d.payload.clone());
                            if again {
                                tokio::time::sleep(Duration::from_millis(1500)).await;
                            }
                            return Some((Ok(d), (b, seen)));
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }));
            Ok::<_, Attempt<std::io::Error>>(s)
        }
        .boxed()
    };
    let config = SupervisorConfig::new(ConsumerConfig::new(1, 1))
        .exit_when_idle(Some(Duration::from_millis(300)))
        .reconnect_timeout(Duration::from_secs(5));
    let run = supervise(&gate, None, connect, config, std::future::pending(), |_| {});
    let done = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the supervisor did not return")
        .expect("drained");
    assert_eq!(done.stats.processed, 2, "{done:?}");
    assert_eq!(done.stats.failed, 1, "{done:?}");
    assert!(broker.is_settled());
}

/// A drain does not end while a delivery is in flight: the last one's handler runs 1 s
/// (past the idle limit of 300 ms) and then fails; the run waits for it, sees it fail,
/// and ends with it processed. Before, the run went idle while the handler ran and ended
/// with the message handed back to the broker (`idem consume --exit-when-idle` exited 0
/// with a lock wait's message still in the queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_run_waits_for_a_delivery_in_flight() {
    let broker = SimBroker::new(5);
    let ts = "2026-07-01T09:00:00Z";
    broker.publish(encode_submission("OK-1", ts, 1));
    broker.publish(encode_submission("ONCE-1", ts, 2));
    let gate = Gate::new(
        MemoryStore::new(),
        FailsOnce::new("ONCE", 1).with_slow(Duration::from_secs(1)),
    );
    let b = broker.clone();
    let connect = move || {
        let b = b.clone();
        async move { Ok::<_, Attempt<std::io::Error>>(polling(b)) }.boxed()
    };
    let config = SupervisorConfig::new(ConsumerConfig::new(2, 1))
        .exit_when_idle(Some(Duration::from_millis(300)))
        .reconnect_timeout(Duration::from_secs(5));
    let run = supervise(&gate, None, connect, config, std::future::pending(), |_| {});
    let done = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the supervisor did not return")
        .expect("drained");
    assert_eq!(done.stats.processed, 2, "{done:?}");
    assert_eq!(done.stats.failed, 1, "{done:?}");
    assert!(broker.is_settled());
}

/// A stream of whatever `broker` holds, polled every 50 ms, never ending.
fn polling(broker: SimBroker) -> Deliveries {
    Box::pin(futures::stream::unfold(broker, |b| async move {
        loop {
            if let Some(d) = b.receive() {
                return Some((Ok(d), b));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }))
}

/// A supervised drain of `broker` (idle after `idle`, asking `check`), at most 20 s.
async fn drain(
    gate: &Gate<MemoryStore, EffectHandlerFor<MemoryStore>>,
    broker: &SimBroker,
    idle: Duration,
    check: SourceCheck,
) -> Result<idem_runtime::supervise::Supervised, SuperviseError<std::io::Error>> {
    let b = broker.clone();
    let connect = move || {
        let b = b.clone();
        async move { Ok::<_, Attempt<std::io::Error>>(polling(b)) }.boxed()
    };
    let config = SupervisorConfig::new(ConsumerConfig::new(1, 1))
        .exit_when_idle(Some(idle))
        .source_check(Some(check))
        .reconnect_timeout(Duration::from_secs(5));
    let run = supervise(gate, None, connect, config, std::future::pending(), |_| {});
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .expect("the supervisor did not return")
}

/// A drain ends only when the source is empty for it: three messages are invisible (a
/// killed consumer's, until their visibility timeout runs out 1.5 s later) when the run
/// goes idle after the two it could see; the source check says the source still holds
/// them, so the run waits and processes all five. Without the check the run ended idle
/// after two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_run_waits_until_the_source_is_empty() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let broker = SimBroker::new(5);
    let ts = "2026-07-01T09:00:00Z";
    for i in 0..2 {
        broker.publish(encode_submission(&format!("SEEN-{i}"), ts, 1));
    }
    let invisible = Arc::new(AtomicU64::new(3));
    let (b, inv) = (broker.clone(), Arc::clone(&invisible));
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        for i in 0..3 {
            b.publish(encode_submission(&format!("LATE-{i}"), ts, 1));
        }
        inv.store(0, Ordering::SeqCst);
    });
    let (b, inv) = (broker.clone(), Arc::clone(&invisible));
    let check = SourceCheck::new(move || {
        let left = inv.load(Ordering::SeqCst) + u64::from(!b.is_settled());
        async move { Ok(left) }
    });
    let gate = Gate::new(MemoryStore::new(), EffectHandlerFor::<MemoryStore>::new());
    let done = drain(&gate, &broker, Duration::from_millis(300), check)
        .await
        .expect("drained");
    assert_eq!(done.stats.processed, 5, "{done:?}");
    assert!(broker.is_settled());
}

/// A source that keeps holding messages this consumer never receives (a dead Kafka
/// member's partitions that are never handed on): once nothing has been delivered for
/// twice the longest retry delay, the drain ends with `SourceNotDrained`, saying how
/// many are left, instead of exiting 0 as if drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_run_whose_source_stays_full_is_not_drained() {
    let broker = SimBroker::new(5);
    broker.publish(encode_submission("ONLY-1", "2026-07-01T09:00:00Z", 1));
    let check = SourceCheck::new(|| async { Ok(4) });
    let gate = Gate::with_config(
        MemoryStore::new(),
        EffectHandlerFor::<MemoryStore>::new(),
        idem_engine::GateConfig::default().with_retry(idem_engine::gate::RetryPolicy::fixed(
            Duration::from_millis(400),
        )),
    );
    let started = std::time::Instant::now();
    let e = drain(&gate, &broker, Duration::from_millis(200), check)
        .await
        .expect_err("not drained");
    assert!(
        matches!(e, SuperviseError::SourceNotDrained { left: Some(4), .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("still holds 4 messages"), "{e}");
    assert!(
        started.elapsed() >= Duration::from_millis(800),
        "{:?}",
        started.elapsed()
    );
    assert!(broker.is_settled(), "the one it could see is processed");
}
