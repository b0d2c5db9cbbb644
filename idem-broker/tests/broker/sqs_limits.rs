//! No SQS limit ends a message the gate only waited on, and no silent endpoint hangs the
//! adapter: on the real server (moto; `IDEM_TEST_SQS_ENDPOINT`, default
//! `http://127.0.0.1:5000`) and the real Postgres store (`IDEM_TEST_POSTGRES_URL`). A
//! missing service fails the test.
//!
//! The silent endpoints are local TCP listeners: one that accepts connections and never
//! answers, and a proxy to moto that stops passing bytes on when it is frozen (its
//! connections stay open).

use crate::common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use idem_broker::any::{pending_count, publish_raw, AnyConsumer, AnyPublisher, BrokerUrl};
use idem_broker::{dead_letter_name, BrokerError};
use idem_engine::{
    consumer, Acker as _, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, ConsumerConfig, Gate,
    IdempotencyKey, Outcome, OutcomeKind,
};
use idem_grant::GrantDb;
use idem_store_postgres::PgStore;
use idem_testkit::MemoryStore;

use common::{effects, fresh_name, plain_bodies, submissions, take, Plain};

/// moto's `HOST:PORT`.
fn moto() -> String {
    std::env::var("IDEM_TEST_SQS_ENDPOINT")
        .unwrap_or_else(|_| "http://127.0.0.1:5000".to_owned())
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned()
}

fn sqs_url(host: &str, settings: &str) -> BrokerUrl {
    BrokerUrl::parse(&format!("sqs://{host}?{settings}")).expect("sqs URL")
}

/// The `maxReceiveCount` of the deferral test's queue.
const MAX_RECEIVE_COUNT: u32 = 2;

/// A migrated grant store on a new schema whose claims give up on a held key after
/// 200 ms (`InProgress`: the gate defers the delivery).
async fn fresh_pg() -> PgStore {
    common::fresh_pg_with(|c| c.with_lock_timeout(Some(Duration::from_millis(200)))).await
}

/// A key held by another transaction while the gate defers its delivery more often than
/// the queue's redrive policy allows receives (`maxReceiveCount` 2, four deferrals):
/// every deferral is held by the consumer, its visibility extended, and handed back
/// without a new receive, so every delivery is attempt 1 (`ApproximateReceiveCount`),
/// SQS never moves the message to the dead-letter queue, and once the holder rolls back
/// the message is processed, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_deferred_more_often_than_max_receive_count_is_processed_once() {
    const DEFERRALS: u64 = MAX_RECEIVE_COUNT as u64 + 2;
    common::within(async {
        let url = sqs_url(
            &moto(),
            &format!("visibility_timeout=2s&wait=1s&max_receive_count={MAX_RECEIVE_COUNT}"),
        );
        let name = fresh_name("sqs-held");
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
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&attempts);
        let deliveries = AnyConsumer::connect(&url, &name, 2)
            .await
            .expect("consumer")
            .inspect(move |d| {
                if let Ok(d) = d {
                    seen.lock().expect("lock").push(d.attempt);
                }
            });

        // (deferred, processed) so far.
        let (counts, mut watch) = tokio::sync::watch::channel((0u64, 0u64));
        let stop = async move {
            let deferred = tokio::time::timeout(
                Duration::from_secs(40),
                watch.wait_for(|(deferred, _)| *deferred >= DEFERRALS),
            )
            .await
            .map(|r| r.map(|c| c.0).unwrap_or_default());
            holder.rollback().await.expect("the holder rolls back");
            if deferred.is_ok() {
                let _ = tokio::time::timeout(
                    Duration::from_secs(20),
                    watch.wait_for(|(_, processed)| *processed >= 1),
                )
                .await;
            }
            deferred
        };
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let stopper = tokio::spawn(async move {
            let deferred = stop.await;
            let _ = stop_tx.send(());
            deferred
        });
        let gate = Gate::new(store.clone(), store.grant_handler());
        let stats = consumer::run(
            &gate,
            deliveries,
            ConsumerConfig::new(1, 1),
            async {
                let _ = stop_rx.await;
            },
            |o| {
                counts.send_modify(|(deferred, processed)| match o.kind() {
                    OutcomeKind::Deferred => *deferred += 1,
                    OutcomeKind::Processed => *processed += 1,
                    _ => {}
                });
            },
        )
        .await
        .expect("consumer run");
        let reached = stopper.await.expect("stopper");
        let attempts = attempts.lock().expect("lock").clone();
        assert!(
            reached.is_ok(),
            "the delivery stopped coming back after {} deferrals (attempts {attempts:?}); stats {stats:?}",
            stats.deferred
        );
        assert_eq!(stats.processed, 1, "processed once: {stats:?}");
        assert!(stats.deferred >= DEFERRALS, "{stats:?}");
        assert_eq!((stats.rejected, stats.failed), (0, 0), "{stats:?}");
        assert!(
            attempts.iter().all(|a| *a == Some(1)),
            "a deferral cost a receive: {attempts:?}"
        );
        assert_eq!(attempts.len() as u64, stats.deferred + 1, "{attempts:?}");
        ledger.assert_exactly_once(&effects(&store).await);
        assert_eq!(
            pending_count(&url, &dead_letter_name(&name))
                .await
                .expect("count"),
            0,
            "nothing dead-lettered"
        );
        assert_eq!(common::wait_pending(&url, &name, 0).await, 0, "settled");
    })
    .await;
}

/// `HOST:PORT` of a listener that accepts every connection and never answers nor
/// closes it.
fn silent_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming().flatten() {
            held.push(s);
        }
    });
    addr.to_string()
}

/// An endpoint that accepts connections and never answers: connecting a consumer or a
/// publisher fails with a timeout error after the request timeout (and the SDK's
/// retries), instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_never_answers_is_a_timeout_not_a_hang() {
    let url = sqs_url(
        &silent_endpoint(),
        "connect_timeout=1s&request_timeout=500ms",
    );
    let name = fresh_name("sqs-silent");
    let consumer = tokio::time::timeout(
        Duration::from_secs(30),
        AnyConsumer::connect(&url, &name, 4),
    )
    .await
    .expect("connecting hung on an endpoint that never answers");
    match consumer {
        Err(e @ BrokerError::Timeout { .. }) => {
            assert!(e.is_retryable(), "{e}");
            let BrokerError::Timeout {
                broker,
                action,
                after,
            } = e
            else {
                unreachable!()
            };
            assert_eq!(
                (broker, action, after),
                ("sqs", "GetQueueUrl", Duration::from_millis(500))
            );
        }
        Err(e) => panic!("not a timeout: {e:?}"),
        Ok(_) => panic!("connected to an endpoint that never answers"),
    }
    let publisher =
        tokio::time::timeout(Duration::from_secs(30), AnyPublisher::connect(&url, &name))
            .await
            .expect("connecting a publisher hung");
    assert!(
        matches!(publisher, Err(BrokerError::Timeout { .. })),
        "{:?}",
        publisher.err()
    );
}

/// A proxy to `upstream` that passes bytes both ways until it is frozen; from then on it
/// passes nothing more and answers no new connection, keeping every connection open.
struct Proxy {
    addr: String,
    frozen: Arc<AtomicBool>,
}

impl Proxy {
    fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address").to_string();
        let frozen = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&frozen);
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for client in listener.incoming().flatten() {
                if flag.load(Ordering::SeqCst) {
                    held.push(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                for (from, to) in [
                    (client.try_clone(), server.try_clone()),
                    (server.try_clone(), client.try_clone()),
                ] {
                    if let (Ok(from), Ok(to)) = (from, to) {
                        let flag = Arc::clone(&flag);
                        std::thread::spawn(move || pump(from, to, &flag));
                    }
                }
            }
        });
        Self { addr, frozen }
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to`; once frozen, holds both open and passes nothing.
fn pump(mut from: TcpStream, mut to: TcpStream, frozen: &AtomicBool) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            loop {
                std::thread::park();
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// An endpoint that stops answering while the consumer runs (connections open, nothing
/// comes back): the ack of a delivery taken before fails with a retryable error, and the
/// stream ends with a timeout of `ReceiveMessage` — whose attempts wait the long poll
/// plus the request timeout — instead of hanging for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_stops_answering_fails_the_ack_and_ends_the_stream() {
    let proxy = Proxy::start(moto());
    let name = fresh_name("sqs-frozen");
    let direct = sqs_url(&moto(), "wait=1s");
    publish_raw(&direct, &name, &plain_bodies(&name, 1))
        .await
        .expect("publish");
    let url = sqs_url(
        &proxy.addr,
        "visibility_timeout=30s&wait=1s&connect_timeout=1s&request_timeout=1s",
    );
    let mut deliveries = AnyConsumer::connect(&url, &name, 1)
        .await
        .expect("connect through the proxy");
    let d = take(&mut deliveries, 1).await.remove(0);
    proxy.freeze();

    let gate = Gate::new(MemoryStore::new(), Plain::default());
    let outcome = tokio::time::timeout(Duration::from_secs(40), gate.process(d))
        .await
        .expect("the ack hung on an endpoint that stopped answering");
    match outcome {
        Outcome::Processed { settle: Err(e), .. } => {
            assert!(e.is_retryable(), "{e}");
            assert!(e.to_string().contains("no answer"), "{e}");
        }
        other => panic!("{other:?}"),
    }

    let next = tokio::time::timeout(Duration::from_secs(40), deliveries.next())
        .await
        .expect("the stream hung on an endpoint that stopped answering");
    match next {
        Some(Err(e @ BrokerError::Timeout { .. })) => {
            assert!(e.is_retryable(), "{e}");
            let BrokerError::Timeout { action, after, .. } = e else {
                unreachable!()
            };
            assert_eq!(
                (action, after),
                ("ReceiveMessage", Duration::from_secs(2)),
                "the long poll plus the request timeout"
            );
        }
        Some(Err(e)) => panic!("not a timeout: {e:?}"),
        Some(Ok(d)) => panic!("a delivery through a frozen endpoint: {:?}", d.attempt),
        None => panic!("the stream ended without an error"),
    }
}

/// Deferrals that fill the prefetch stop the receives: nothing more is taken from the
/// queue (memory stays bounded however long the store makes them wait) until they come
/// back through the stream, uncounted; then the rest follow. Before, held deferrals did
/// not count against the prefetch and the consumer went on receiving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferrals_that_fill_the_prefetch_stop_the_receives() {
    common::within(async {
        let url = sqs_url(&moto(), "visibility_timeout=30s&wait=1s");
        let name = fresh_name("sqs-defer-full");
        publish_raw(&url, &name, &plain_bodies(&name, 25))
            .await
            .expect("publish");
        let mut stream = AnyConsumer::connect(&url, &name, 10)
            .await
            .expect("consumer");
        let taken = take(&mut stream, 10).await;
        let started = std::time::Instant::now();
        for d in taken {
            d.acker.defer(Duration::from_secs(3)).await.expect("defer");
        }
        let back = take(&mut stream, 10).await;
        assert!(
            started.elapsed() >= Duration::from_secs(3),
            "a receive ran while the deferrals filled the prefetch"
        );
        assert!(
            back.iter().all(|d| d.attempt == Some(1)),
            "handed back, uncounted: {:?}",
            back.iter().map(|d| d.attempt).collect::<Vec<_>>()
        );
        let gate = Gate::new(MemoryStore::new(), Plain::default());
        for o in gate.process_batch(back).await {
            assert!(o.settle_error().is_none(), "{o:?}");
        }
        let rest = take(&mut stream, 15).await;
        for o in gate.process_batch(rest).await {
            assert!(o.settle_error().is_none(), "{o:?}");
        }
        assert_eq!(pending_count(&url, &name).await.expect("count"), 0);
    })
    .await;
}

/// The first bytes a client sends to a listener on a loopback port when it is reached as
/// `sqs://HOST:PORT` (`HOST` a name or an address): a TLS `ClientHello` begins with the
/// handshake record type 0x16, plain HTTP with its method.
async fn first_bytes(host: &str, settings: &str) -> Vec<u8> {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let seen = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut first = [0u8; 4];
        s.read_exact(&mut first).expect("the client's first bytes");
        let _ = s.shutdown(Shutdown::Both);
        first.to_vec()
    });
    let url = sqs_url(
        &format!("{host}:{port}"),
        &format!("connect_timeout=2s&request_timeout=2s{settings}"),
    );
    // Fails (the listener speaks no SQS): only what it sent first matters.
    let _ = tokio::time::timeout(Duration::from_secs(20), pending_count(&url, "tls-probe")).await;
    tokio::task::spawn_blocking(move || seen.join().expect("listener"))
        .await
        .expect("join")
}

/// `sqs://NAME:PORT` speaks TLS first: a VPC or FIPS endpoint by name got the AWS
/// signatures, the session token and every message body in clear (`http://`), and its
/// answers could be forged. A loopback address stays plain HTTP (a stand-in on the same
/// machine), and `tls=false` asks for it by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_endpoint_is_reached_over_tls() {
    let by_name = first_bytes("localhost", "").await;
    assert_eq!(
        by_name[0], 0x16,
        "a TLS handshake record first: {by_name:?}"
    );
    let by_address = first_bytes("127.0.0.1", "").await;
    assert_eq!(&by_address, b"POST", "plain HTTP to a loopback address");
    let asked = first_bytes("localhost", "&tls=false").await;
    assert_eq!(&asked, b"POST", "plain HTTP when the URL asks for it");
}
