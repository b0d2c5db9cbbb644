//! No NATS limit ends a message before the gate does, on the real server
//! (`IDEM_TEST_NATS_URL`, default `nats://127.0.0.1:4222`) and the real Postgres store
//! (`IDEM_TEST_POSTGRES_URL`). A missing service fails the test.
//!
//! Every test runs with a short ack wait (2 s) and a small `max_deliver` (3), set through
//! the URL as a user would: whatever waits longer than `ack_wait × max_deliver` (6 s)
//! — a key held by another transaction, a store outage, a delivery waiting in the
//! consumer's buffer — would be abandoned by the server if it cost a delivery each time.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use idem_broker::any::{pending_count, publish_raw, AnyConsumer, BrokerUrl};
use idem_broker::dead_letter_name;
use idem_broker::nats::{stream_name, NatsConfig, NatsConsumer};
use idem_engine::{
    consumer, Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, ConsumerConfig,
    ConsumerStats, Gate, GateConfig, IdempotencyKey, OutcomeKind, StoreError,
};
use idem_grant::GrantDb;
use idem_store_postgres::PgStore;
use idem_testkit::MemoryStore;

use common::{effects, fresh_name, plain_bodies, submissions, take, Plain};

/// The server's URL, without the test's settings.
fn server() -> String {
    std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// The ack wait of every test here.
const ACK_WAIT: Duration = Duration::from_secs(2);
/// The `max_deliver` of every test here.
const MAX_DELIVER: u32 = 3;

/// The server's URL with the test's ack wait and `max_deliver`.
fn url() -> BrokerUrl {
    let base = server();
    let sep = if base.contains('?') { '&' } else { '?' };
    BrokerUrl::parse(&format!(
        "{base}{sep}ack_wait={}s&max_deliver={MAX_DELIVER}",
        ACK_WAIT.as_secs()
    ))
    .expect("NATS URL")
}

/// Longer than the server would keep redelivering a message that cost a delivery each
/// time it came back.
fn past_the_limit() -> Duration {
    ACK_WAIT * MAX_DELIVER * 2
}

/// A migrated grant store on a new schema whose claims give up on a held key after
/// 200 ms (`InProgress`: the gate defers the delivery).
async fn fresh_pg() -> PgStore {
    common::fresh_pg_with(|c| c.with_lock_timeout(Some(Duration::from_millis(200)))).await
}

/// How often the server has redelivered a message of `name` (the durable `idem`).
async fn redelivered(name: &str) -> usize {
    let client = async_nats::connect(server()).await.expect("connect");
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(stream_name(name)).await.expect("stream");
    stream
        .consumer_info("idem")
        .await
        .expect("consumer info")
        .num_redelivered
}

/// Runs the gate over `deliveries` until `done` says so (checked every 200 ms, for at
/// most `limit`), then 2 s more to catch a late redelivery; the stats of the run.
async fn run_until<S, H, St, A, F, Fut>(
    gate: &Gate<S, H>,
    deliveries: St,
    config: ConsumerConfig,
    limit: Duration,
    done: F,
) -> ConsumerStats
where
    S: ClaimStore,
    H: idem_engine::Handler<S::Tx>,
    A: idem_engine::Acker,
    St: futures::Stream<Item = Result<idem_engine::Delivery<A>, idem_broker::BrokerError>>,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let stop = async {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline && !done().await {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    consumer::run(gate, deliveries, config, stop, |_| {})
        .await
        .expect("consumer run")
}

/// A key held by another transaction for twice `ack_wait × max_deliver`: every claim of
/// the delivery answers `InProgress` and the gate defers it, again and again. When the
/// holder rolls back, the message is processed, once, and nothing is dead-lettered.
/// (Before, each deferral was a `-NAK` that cost a server delivery: after three the server
/// never delivered the message again, and nothing was dead-lettered.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_longer_than_max_deliver_allows_is_processed_once_when_released() {
    common::within(async {
        let url = url();
        let name = fresh_name("nats-held");
        let store = fresh_pg().await;
        let (bodies, ledger) = submissions(&name, 1);
        let award = format!("T-{name}-00000");
        let key = IdempotencyKey::derive(&award, "2026-07-01T09:00:00Z", &bodies[0]).expect("key");

        // Another transaction holds the key.
        let mut holder = store.begin().await.expect("begin");
        assert_eq!(
            holder
                .claim(&key, &ClaimMeta::new(award.clone()))
                .await
                .expect("claim"),
            ClaimOutcome::Claimed
        );
        publish_raw(&url, &name, &bodies).await.expect("publish");
        let deliveries = AnyConsumer::connect(&url, &name, 2)
            .await
            .expect("consumer");
        let gate = Gate::new(store.clone(), store.grant_handler());
        let held = past_the_limit();
        let released = Arc::new(Mutex::new(Some(holder)));
        let started = Instant::now();
        let stats = run_until(
            &gate,
            deliveries,
            ConsumerConfig::new(1, 1),
            held + Duration::from_secs(20),
            || {
                let (store, released) = (store.clone(), Arc::clone(&released));
                async move {
                    if started.elapsed() >= held {
                        let tx = released.lock().expect("lock").take();
                        if let Some(tx) = tx {
                            tx.rollback().await.expect("the holder rolls back");
                        }
                        return !effects(&store).await.is_empty();
                    }
                    false
                }
            },
        )
        .await;
        assert!(
            released.lock().expect("lock").is_none(),
            "the holder was released"
        );
        assert_eq!(
            stats.processed, 1,
            "processed once after release: {stats:?}"
        );
        assert!(stats.deferred > 0, "deferred while held: {stats:?}");
        assert_eq!((stats.rejected, stats.failed), (0, 0), "{stats:?}");
        ledger.assert_exactly_once(&effects(&store).await);
        assert_eq!(
            pending_count(&url, &dead_letter_name(&name))
                .await
                .expect("count"),
            0,
            "nothing dead-lettered"
        );
        assert_eq!(common::wait_pending(&url, &name, 0).await, 0, "settled");
        assert_eq!(
            redelivered(&name).await,
            0,
            "no deferral cost a server delivery"
        );
    })
    .await;
}

/// A store that is down (every `begin` fails as unreachable) until `up_at`.
#[derive(Clone)]
struct DownUntil {
    inner: PgStore,
    up_at: Instant,
}

#[async_trait]
impl ClaimStore for DownUntil {
    type Tx = <PgStore as ClaimStore>::Tx;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        if Instant::now() < self.up_at {
            return Err(StoreError::Unavailable {
                message: "injected outage: connection refused".to_owned(),
                source: None,
            });
        }
        self.inner.begin().await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// A store outage twice as long as `ack_wait × max_deliver`: every attempt fails and the
/// gate nacks with a delay. When the store is back, each message is processed once and
/// nothing is dead-lettered. (Before, each nack cost a server delivery: after three the
/// messages were never delivered again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_longer_than_max_deliver_allows_strands_nothing() {
    common::within(async {
        let url = url();
        let name = fresh_name("nats-outage");
        let pg = fresh_pg().await;
        let (bodies, ledger) = submissions(&name, 3);
        publish_raw(&url, &name, &bodies).await.expect("publish");
        let down = past_the_limit();
        let store = DownUntil {
            inner: pg.clone(),
            up_at: Instant::now() + down,
        };
        let gate = Gate::with_config(
            store,
            pg.grant_handler(),
            GateConfig::default().with_retry_delay(Some(Duration::from_millis(500))),
        );
        let deliveries = AnyConsumer::connect(&url, &name, 4)
            .await
            .expect("consumer");
        let stats = run_until(
            &gate,
            deliveries,
            ConsumerConfig::new(1, 2),
            down + Duration::from_secs(20),
            || {
                let pg = pg.clone();
                async move { effects(&pg).await.len() == 3 }
            },
        )
        .await;
        assert_eq!(stats.processed, 3, "{stats:?}");
        assert!(
            stats.failed > 0,
            "failed while the store was down: {stats:?}"
        );
        assert_eq!(stats.rejected, 0, "{stats:?}");
        ledger.assert_exactly_once(&effects(&pg).await);
        assert_eq!(
            pending_count(&url, &dead_letter_name(&name))
                .await
                .expect("count"),
            0,
            "nothing dead-lettered"
        );
        assert_eq!(common::wait_pending(&url, &name, 0).await, 0, "settled");
        assert_eq!(redelivered(&name).await, 0, "no nack cost a delivery");
    })
    .await;
}

/// Deliveries waiting in the consumer's buffer behind a slow handler, longer than
/// `ack_wait × max_deliver`: each is kept alive from the moment it arrives, so none is
/// redelivered (every attempt is 1, no duplicate) and all are processed once. (Before,
/// the prefetched deliveries not yet taken from async-nats's buffer had no `+WPI`: the
/// server redelivered them every ack wait.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_waiting_in_the_buffer_are_not_redelivered() {
    common::within(async {
        const N: usize = 12;
        let url = url();
        let name = fresh_name("nats-buffer");
        publish_raw(&url, &name, &plain_bodies(&name, N))
            .await
            .expect("publish");
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&attempts);
        let deliveries = AnyConsumer::connect(&url, &name, N)
            .await
            .expect("consumer")
            .map(move |r| {
                if let Ok(d) = &r {
                    seen.lock().expect("lock").push(d.attempt);
                }
                r
            });
        let store = MemoryStore::new();
        // 12 × 700 ms: the last waits 7.7 s in the buffer, past 3 × 2 s.
        let gate = Gate::new(
            store.clone(),
            Plain {
                fail: false,
                slow: Duration::from_millis(700),
            },
        );
        let stats = run_until(
            &gate,
            deliveries,
            ConsumerConfig::new(1, 1),
            Duration::from_secs(40),
            || {
                let store = store.clone();
                async move { store.rows("done").len() >= N }
            },
        )
        .await;
        let attempts = attempts.lock().expect("lock").clone();
        assert!(
            attempts.iter().all(|a| *a == Some(1)),
            "redelivered: {attempts:?}"
        );
        assert_eq!(
            (stats.processed, stats.duplicates),
            (N as u64, 0),
            "{stats:?}"
        );
        assert_eq!(store.rows("done").len(), N);
        assert_eq!(redelivered(&name).await, 0);
    })
    .await;
}

/// A nack with a delay is kept by the consumer (alive with `+WPI`) and handed back after
/// the delay without a server delivery: the attempt counts it (the gate's count of
/// failures), the server does not. A deferral (`NatsAcker::defer`) counts nowhere: the
/// delivery comes back with the same attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_is_counted_as_an_attempt_and_a_deferral_is_not_and_neither_costs_a_delivery() {
    common::within(async {
        let name = fresh_name("nats-handback");
        publish_raw(&url(), &name, &plain_bodies(&name, 1))
            .await
            .expect("publish");
        let config = NatsConfig::from_url(&url(), &name).expect("config");
        let mut stream = NatsConsumer::connect(&config).await.expect("connect");
        let mut last = Vec::new();
        let d = take(&mut stream, 1).await.remove(0);
        assert_eq!(d.attempt, Some(1));
        last.clone_from(&d.payload);
        // Past the ack wait, twice over: kept alive all along.
        use idem_engine::Acker;
        d.acker.nack(Some(ACK_WAIT * 3)).await.expect("nack held");
        let d = take(&mut stream, 1).await.remove(0);
        assert_eq!(d.payload, last);
        assert_eq!(d.attempt, Some(2), "a nack counts as an attempt");
        d.acker.defer(ACK_WAIT * 3).await.expect("defer held");
        let d = take(&mut stream, 1).await.remove(0);
        assert_eq!(d.attempt, Some(2), "a deferral does not");
        let gate = Gate::new(MemoryStore::new(), Plain::default());
        let o = gate.process(d).await;
        assert_eq!(o.kind(), OutcomeKind::Processed);
        assert!(o.settle_error().is_none(), "{o:?}");
        assert_eq!(redelivered(&name).await, 0, "no server redelivery");
        assert_eq!(
            common::drain(&mut stream, ACK_WAIT * 2).await.len(),
            0,
            "acked once, gone"
        );
    })
    .await;
}

/// The server's own limit stays as a backstop, for a delivery this process loses (a crash,
/// a dropped acker): its hits are observed (the `MAX_DELIVERIES` advisory) and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_s_max_deliver_hits_are_counted() {
    common::within(async {
        let name = fresh_name("nats-backstop");
        publish_raw(&url(), &name, &plain_bodies(&name, 1))
            .await
            .expect("publish");
        let config = NatsConfig::from_url(&url(), &name).expect("config");
        let mut stream = NatsConsumer::connect(&config).await.expect("connect");
        for want in 1..=MAX_DELIVER {
            let d = take(&mut stream, 1).await.remove(0);
            assert_eq!(d.attempt, Some(want));
            // Lost: the server redelivers it after the ack wait.
            drop(d);
        }
        let deadline = Instant::now() + ACK_WAIT * 3;
        while stream.max_deliveries() == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(stream.max_deliveries(), 1, "one MAX_DELIVERIES advisory");
    })
    .await;
}

/// A message that kills its consumer on every run (here the gate's future is dropped
/// with its delivery while the handler runs, as the process's death would) is
/// dead-lettered by the gate, unrun, once its recorded runs reach `max_attempts` — before
/// the server's own `max_deliver` ends it without a reason. With the gate's defaults:
/// each rerun is recorded in the store before it runs. Deferrals and delayed nacks are
/// held without a server delivery, so the server's count holds runs only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_its_consumer_is_dead_lettered_unrun_before_max_deliver() {
    common::within(async {
        let name = fresh_name("nats-killer");
        let body = plain_bodies(&name, 1).remove(0);
        publish_raw(&url(), &name, std::slice::from_ref(&body))
            .await
            .expect("publish");
        let config = NatsConfig::from_url(&url(), &name).expect("config");
        let store = MemoryStore::new();
        let limits = GateConfig::default().with_max_attempts(MAX_DELIVER - 1);
        let killer = Plain {
            slow: Duration::from_secs(3600),
            ..Plain::default()
        };
        for run in 1..MAX_DELIVER {
            // A process of its own, which dies while the handler runs.
            let gate = Gate::with_config(store.clone(), killer, limits.clone());
            let mut stream = NatsConsumer::connect(&config).await.expect("connect");
            let d = take(&mut stream, 1).await.remove(0);
            assert_eq!(d.attempt, Some(run));
            assert!(
                tokio::time::timeout(Duration::from_millis(300), gate.process(d))
                    .await
                    .is_err(),
                "the handler runs until the process dies"
            );
            drop(stream);
        }
        let gate = Gate::with_config(store.clone(), Plain::default(), limits);
        let mut stream = NatsConsumer::connect(&config).await.expect("connect");
        let d = take(&mut stream, 1).await.remove(0);
        assert_eq!(d.attempt, Some(MAX_DELIVER));
        let o = gate.process(d).await;
        assert_eq!(o.kind(), OutcomeKind::Rejected, "{o:?}");
        assert!(o.settle_error().is_none(), "{o:?}");
        assert!(store.rows("done").is_empty(), "the handler did not run");
        let mut letters = AnyConsumer::connect(&url(), &dead_letter_name(&name), 4)
            .await
            .expect("dead-letter consumer");
        let letter = take(&mut letters, 1).await.remove(0);
        assert_eq!(letter.payload, body);
        let reason = letter
            .header(idem_broker::DEAD_LETTER_REASON_HEADER)
            .unwrap_or_default()
            .to_owned();
        assert!(reason.contains("not run again"), "{reason}");
        tokio::time::sleep(ACK_WAIT * 2).await;
        assert_eq!(
            stream.max_deliveries(),
            0,
            "the server's limit was not reached"
        );
        assert_eq!(pending_count(&url(), &name).await.expect("pending"), 0);
    })
    .await;
}

/// A dead letter that the dead-letter stream refuses for good (its `max_msg_size` below
/// the message: "message size exceeds maximum allowed") stops the consumer with a
/// configuration error naming the setting, where the delivery was held alive and handed
/// back every few seconds for ever (no `max_deliver` ends a hand-back). Left unsettled,
/// the message is delivered again after the ack wait, and once the stream takes it, it
/// is dead-lettered, whole and once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_refused_for_good_stops_the_consumer_and_leaves_the_delivery_unsettled() {
    use async_nats::jetstream::stream;
    common::within(async {
        let url = url();
        let name = fresh_name("nats-dl-refused");
        let dl = dead_letter_name(&name);
        let js = async_nats::jetstream::new(async_nats::connect(server()).await.expect("connect"));
        let config = stream::Config {
            name: stream_name(&dl),
            subjects: vec![dl.clone()],
            max_message_size: 200,
            ..Default::default()
        };
        js.create_stream(config.clone())
            .await
            .expect("a small dead-letter stream");
        // Not UTF-8: poison to the test's handler, dead-lettered before any claim.
        let poison = vec![0xff; 1_000];
        publish_raw(&url, &name, std::slice::from_ref(&poison))
            .await
            .expect("publish");
        let deliveries = AnyConsumer::connect(&url, &name, 2)
            .await
            .expect("consumer");
        let stopped =
            common::stopped_by_a_refused_dead_letter(deliveries, Duration::from_secs(30)).await;
        assert!(
            stopped.to_string().contains("max_msg_size"),
            "names the setting: {stopped}"
        );
        let held = |js: async_nats::jetstream::Context, s: String| async move {
            js.get_stream(s)
                .await
                .expect("stream")
                .info()
                .await
                .expect("info")
                .state
                .messages
        };
        assert_eq!(
            held(js.clone(), stream_name(&dl)).await,
            0,
            "nothing dead-lettered"
        );

        // The operator raises the limit; the next run dead-letters the message once.
        js.update_stream(stream::Config {
            max_message_size: -1,
            ..config
        })
        .await
        .expect("limit raised");
        let deliveries = AnyConsumer::connect(&url, &name, 2)
            .await
            .expect("consumer");
        let gate = Gate::new(MemoryStore::new(), Plain::default());
        let stats = consumer::run(
            &gate,
            idem_broker::until_idle(deliveries, ACK_WAIT * 3),
            ConsumerConfig::new(1, 1),
            std::future::pending::<()>(),
            |_| {},
        )
        .await
        .expect("consumer run");
        assert_eq!(stats.rejected, 1, "{stats:?}");
        assert_eq!(
            held(js.clone(), stream_name(&dl)).await,
            1,
            "dead-lettered once"
        );
        let letter = js
            .get_stream(stream_name(&dl))
            .await
            .expect("stream")
            .get_raw_message(1)
            .await
            .expect("the dead letter");
        assert!(letter.payload == poison, "whole");
    })
    .await;
}
