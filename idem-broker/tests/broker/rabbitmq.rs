//! RabbitMQ on the real broker (`IDEM_TEST_AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`) and the real Postgres store
//! (`IDEM_TEST_POSTGRES_URL`). A missing service fails the test.

use crate::common;

use std::time::Duration;

use common::Broker;

/// The server's URL, without the test's settings.
fn url() -> String {
    std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn broker() -> Broker {
    Broker::from_env(
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        "",
        // An unacked delivery is requeued as soon as its channel closes.
        Duration::from_secs(2),
        false,
    )
}

common::conformance!(broker);

mod settle {
    use std::sync::Arc;
    use std::time::Duration;

    use futures::StreamExt as _;
    use idem_broker::rabbitmq::{
        publish_raw, QueueType, RabbitAcker, RabbitConfig, RabbitConsumer,
    };
    use idem_broker::BrokerError;
    use idem_engine::{Acker, Delivery, Gate, GateConfig, OutcomeKind};
    use idem_testkit::MemoryStore;

    use super::common::{self, bodies_of, drain, fresh_name, plain_bodies, take, Plain};
    use super::url;

    async fn consumer(name: &str, prefetch: usize) -> RabbitConsumer {
        RabbitConsumer::connect(&RabbitConfig::new(url(), name).with_prefetch(prefetch))
            .await
            .expect("connect consumer")
    }

    /// 8 tasks at once, each holding a non-contiguous batch of the channel's deliveries
    /// (tags i, i+8, i+16, …): each nacks one delivery from the middle of its batch while
    /// acking the rest as one batch (`ack_all`). Over several rounds, every nacked
    /// delivery — and only those — comes back, with its quorum delivery count; none is
    /// covered by a neighbour's multiple-ack.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn multiple_ack_under_concurrency_8_never_covers_a_nacked_delivery() {
        common::within(async {
            const TASKS: usize = 8;
            const PER_TASK: usize = 8;
            const N: usize = TASKS * PER_TASK;
            const ROUNDS: usize = 4;
            let name = fresh_name("rabbit-multi");
            let mut stream = consumer(&name, N).await;
            let ok = Arc::new(Gate::new(MemoryStore::new(), Plain::default()));
            let failing = Arc::new(Gate::with_config(
                MemoryStore::new(),
                Plain {
                    fail: true,
                    ..Plain::default()
                },
                GateConfig::default().with_retry_delay(None),
            ));
            for round in 0..ROUNDS {
                let bodies = plain_bodies(&format!("{name}-r{round}"), N);
                publish_raw(&url(), &name, &bodies).await.expect("publish");
                let mut taken: Vec<Delivery<RabbitAcker>> = take(&mut stream, N).await;
                assert!(taken.iter().all(|d| d.attempt == Some(1)));
                taken.sort_by_key(|d| d.acker.delivery_tag());
                let mut batches: Vec<Vec<Delivery<RabbitAcker>>> =
                    (0..TASKS).map(|_| Vec::new()).collect();
                for (i, d) in taken.into_iter().enumerate() {
                    batches[i % TASKS].push(d);
                }
                let start = Arc::new(tokio::sync::Barrier::new(TASKS));
                let mut nacked = Vec::new();
                let mut tasks = Vec::new();
                for mut batch in batches {
                    let victim = batch.remove(PER_TASK / 2);
                    nacked.push(String::from_utf8_lossy(&victim.payload).into_owned());
                    let (ok, failing, start) = (ok.clone(), failing.clone(), start.clone());
                    tasks.push(tokio::spawn(async move {
                        start.wait().await;
                        let (n, acked) =
                            tokio::join!(failing.process(victim), ok.process_batch(batch));
                        assert_eq!(n.kind(), OutcomeKind::Failed, "{n:?}");
                        assert!(n.settle_error().is_none(), "{n:?}");
                        for o in acked {
                            assert_eq!(o.kind(), OutcomeKind::Processed, "{o:?}");
                            assert!(o.settle_error().is_none(), "{o:?}");
                        }
                    }));
                }
                for t in tasks {
                    t.await.expect("task");
                }
                nacked.sort();
                // They come back one at a time (each a rerun: the next comes once it
                // is settled), each settled for good before the next round.
                let (mut back, mut attempts) = (Vec::new(), Vec::new());
                while let Ok(Some(d)) =
                    tokio::time::timeout(Duration::from_secs(2), stream.next()).await
                {
                    let d = d.expect("delivery");
                    back.push(String::from_utf8_lossy(&d.payload).into_owned());
                    attempts.push(d.attempt);
                    let o = ok.process(d).await;
                    assert!(o.settle_error().is_none(), "{o:?}");
                }
                back.sort();
                assert_eq!(back, nacked, "round {round}: exactly the nacked come back");
                assert!(
                    attempts.iter().all(|a| *a == Some(2)),
                    "x-delivery-count + 1: {attempts:?}"
                );
                assert_eq!(stream.unsettled(), 0, "no tag left outstanding");
            }
            assert!(drain(&mut stream, Duration::from_secs(2)).await.is_empty());
        })
        .await;
    }

    /// A delivery dropped unsettled (its task cancelled) is requeued — not leaked: it
    /// comes back with its delivery count, and the channel's bookkeeping lets go of it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_delivery_dropped_unsettled_is_requeued() {
        common::within(async {
            let name = fresh_name("rabbit-drop");
            publish_raw(&url(), &name, &plain_bodies(&name, 3))
                .await
                .expect("publish");
            let mut stream = consumer(&name, 8).await;
            let taken = take(&mut stream, 3).await;
            let mut it = taken.into_iter();
            let dropped = it.next().expect("first");
            let dropped_body = String::from_utf8_lossy(&dropped.payload).into_owned();
            drop(dropped);
            let back = take(&mut stream, 1).await;
            assert_eq!(bodies_of(&back), vec![dropped_body]);
            assert_eq!(back[0].attempt, Some(2));
            let gate = Gate::new(MemoryStore::new(), Plain::default());
            let rest: Vec<_> = it.chain(back).collect();
            for o in gate.process_batch(rest).await {
                assert!(o.settle_error().is_none(), "{o:?}");
            }
            assert_eq!(stream.unsettled(), 0);
            assert!(drain(&mut stream, Duration::from_secs(2)).await.is_empty());
        })
        .await;
    }

    /// A delayed nack holds the delivery for the delay, then requeues it; when half the
    /// prefetch is already held, a delayed nack requeues at once instead.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_delayed_nack_is_held_then_requeued_and_holding_is_bounded() {
        common::within(async {
            let name = fresh_name("rabbit-hold");
            publish_raw(&url(), &name, &plain_bodies(&name, 4))
                .await
                .expect("publish");
            // Prefetch 4: at most 2 held.
            let mut stream = consumer(&name, 4).await;
            let taken = take(&mut stream, 4).await;
            let gate = Gate::with_config(
                MemoryStore::new(),
                Plain {
                    fail: true,
                    ..Plain::default()
                },
                GateConfig::default().with_retry_delay(Some(Duration::from_secs(3))),
            );
            let started = std::time::Instant::now();
            for o in gate.process_batch(taken).await {
                assert_eq!(o.kind(), OutcomeKind::Failed, "{o:?}");
            }
            assert_eq!(stream.held(), 2, "half the prefetch is held");
            // The two not held come back at once; the held two after the delay (each a
            // rerun: the next comes once it is settled).
            let ok = Gate::new(MemoryStore::new(), Plain::default());
            for back in 0..4 {
                let d = take(&mut stream, 1).await.pop().expect("one");
                if back < 2 {
                    assert!(started.elapsed() < Duration::from_secs(3));
                } else {
                    assert!(started.elapsed() >= Duration::from_secs(3));
                }
                let o = ok.process(d).await;
                assert!(o.settle_error().is_none(), "{o:?}");
            }
            assert_eq!(stream.held(), 0);
        })
        .await;
    }

    /// A deferral (its key held by another transaction) is not the message's fault and
    /// costs no delivery: deferred 30 times — past the default delivery limit of 20 — the
    /// delivery comes back through the consumer's stream each time with its attempt and
    /// `x-delivery-count` unchanged, without a round trip through the broker. Dropped
    /// unsettled afterwards, it comes back from the broker with `x-delivery-count` 1: the
    /// broker counted that one requeue, none of the 30 deferrals. It is processed once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_delivery_deferred_30_times_keeps_its_delivery_count() {
        common::within(async {
            let name = fresh_name("rabbit-defer");
            publish_raw(&url(), &name, &plain_bodies(&name, 1))
                .await
                .expect("publish");
            let mut stream = consumer(&name, 4).await;
            let mut d = take(&mut stream, 1).await.pop().expect("one");
            let body = d.payload.clone();
            let count = d.header("x-delivery-count").map(str::to_owned);
            assert_eq!(d.attempt, Some(1));
            for i in 1..=30 {
                d.acker
                    .defer(Duration::from_millis(10))
                    .await
                    .expect("defer");
                d = take(&mut stream, 1).await.pop().expect("handed back");
                assert_eq!(d.payload, body, "deferral {i}");
                assert_eq!(d.attempt, Some(1), "deferral {i}: the attempt is unchanged");
                assert_eq!(
                    d.header("x-delivery-count").map(str::to_owned),
                    count,
                    "deferral {i}: x-delivery-count is unchanged"
                );
            }
            assert_eq!(stream.held(), 0);
            // The broker's own count: one requeue.
            drop(d);
            let d = take(&mut stream, 1).await.pop().expect("requeued");
            assert_eq!(d.payload, body);
            assert_eq!(d.header("x-delivery-count"), Some("1"));
            assert_eq!(d.attempt, Some(2));
            let gate = Gate::new(MemoryStore::new(), Plain::default());
            let o = gate.process(d).await;
            assert_eq!(o.kind(), OutcomeKind::Processed, "{o:?}");
            assert!(o.settle_error().is_none(), "{o:?}");
            assert!(drain(&mut stream, Duration::from_secs(2)).await.is_empty());
            assert_eq!(stream.unsettled(), 0);
        })
        .await;
    }

    /// Deferrals that fill the prefetch are all held, none requeued (3.x and 4.0–4.2 count
    /// a `basic.nack` towards the delivery limit): the broker sends nothing more until
    /// they come back through the stream after the delay, their count unchanged; then the
    /// rest follow. Before, past half the prefetch a deferral was requeued at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deferrals_that_fill_the_prefetch_are_held_and_stop_the_sending() {
        common::within(async {
            let name = fresh_name("rabbit-defer-full");
            let mut stream = consumer(&name, 4).await;
            // A first message takes the consumer from its solo start (prefetch 1) to its
            // prefetch of 4; settled, and the change given time to complete, the solo
            // consumer holds nothing that would count beside the 4.
            publish_raw(&url(), &name, &plain_bodies(&format!("{name}-first"), 1))
                .await
                .expect("publish");
            let ok = Gate::new(MemoryStore::new(), Plain::default());
            let first = take(&mut stream, 1).await.pop().expect("the first");
            assert!(ok.process(first).await.settle_error().is_none());
            tokio::time::sleep(Duration::from_secs(2)).await;
            publish_raw(&url(), &name, &plain_bodies(&name, 6))
                .await
                .expect("publish");
            let taken = take(&mut stream, 4).await;
            let started = std::time::Instant::now();
            for d in taken {
                d.acker.defer(Duration::from_secs(3)).await.expect("defer");
            }
            assert_eq!(stream.held(), 4, "every deferral is held");
            let back = take(&mut stream, 4).await;
            assert!(
                started.elapsed() >= Duration::from_secs(3),
                "nothing came while the deferrals filled the prefetch"
            );
            assert!(
                back.iter().all(|d| d.attempt == Some(1)),
                "held and handed back, uncounted: {:?}",
                back.iter().map(|d| d.attempt).collect::<Vec<_>>()
            );
            assert_eq!(stream.held(), 0);
            for o in ok.process_batch(back).await {
                assert!(o.settle_error().is_none(), "{o:?}");
            }
            let rest = take(&mut stream, 2).await;
            assert!(rest.iter().all(|d| d.attempt == Some(1)));
            for o in ok.process_batch(rest).await {
                assert!(o.settle_error().is_none(), "{o:?}");
            }
            assert!(drain(&mut stream, Duration::from_secs(2)).await.is_empty());
        })
        .await;
    }

    /// `delivery_limit` 0 ("none") is refused before anything is declared: RabbitMQ 4.x
    /// gives a quorum queue declared without `x-delivery-limit` its default of 20, and
    /// with 0 no dead-letter target was declared either, so messages past 20 deliveries
    /// were dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_delivery_limit_of_zero_is_refused() {
        common::within(async {
            let name = fresh_name("rabbit-limit0");
            let config = RabbitConfig::new(url(), &name).with_delivery_limit(0);
            let err = RabbitConsumer::connect(&config)
                .await
                .expect_err("delivery limit 0");
            assert!(!err.is_retryable(), "{err:?}");
            assert!(err.to_string().contains("delivery_limit"), "{err}");
            let err = idem_broker::rabbitmq::RabbitPublisher::connect_with(&config)
                .await
                .expect_err("delivery limit 0");
            assert!(err.to_string().contains("delivery_limit"), "{err}");
            // Nothing was declared: a consumer with the default settings creates the
            // queue with them.
            RabbitConsumer::connect(&RabbitConfig::new(url(), &name))
                .await
                .expect("the default settings");
        })
        .await;
    }

    /// An ack on a connection that is gone is an error, never a success, and the
    /// delivery is redelivered to the next consumer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_ack_on_a_closed_connection_is_an_error() {
        common::within(async {
            let name = fresh_name("rabbit-dead");
            publish_raw(&url(), &name, &plain_bodies(&name, 1))
                .await
                .expect("publish");
            let mut stream = consumer(&name, 4).await;
            let d = take(&mut stream, 1).await.pop().expect("one");
            stream.close().await.expect("close");
            let gate = Gate::new(MemoryStore::new(), Plain::default());
            let o = gate.process(d).await;
            assert_eq!(o.kind(), OutcomeKind::Processed);
            assert!(
                o.settle_error().is_some(),
                "acked on a closed connection: {o:?}"
            );
            let mut next = consumer(&name, 4).await;
            let again = take(&mut next, 1).await;
            assert_eq!(again[0].attempt, Some(2));
        })
        .await;
    }

    /// Queues are quorum queues by default; a queue that exists as a classic queue is a
    /// configuration error naming the difference, not silently used or redeclared.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_existing_queue_with_other_arguments_is_a_config_error() {
        common::within(async {
            let name = fresh_name("rabbit-classic");
            let classic = RabbitConfig::new(url(), &name).with_queue_type(QueueType::Classic);
            let c = RabbitConsumer::connect(&classic)
                .await
                .expect("classic queue");
            drop(c);
            let err = RabbitConsumer::connect(&RabbitConfig::new(url(), &name))
                .await
                .expect_err("a quorum consumer of a classic queue");
            assert!(matches!(err, BrokerError::Config { .. }), "{err:?}");
            assert!(!err.is_retryable());
            let text = err.to_string();
            assert!(
                text.contains("x-queue-type") && text.contains(&name),
                "{text}"
            );
            // Asking for what exists works; a classic queue keeps no delivery count.
            let mut c = RabbitConsumer::connect(&classic)
                .await
                .expect("same settings");
            idem_broker::rabbitmq::RabbitPublisher::connect_with(&classic)
                .await
                .expect("publisher with the same settings")
                .publish_raw(&plain_bodies(&name, 1))
                .await
                .expect("publish");
            assert_eq!(take(&mut c, 1).await[0].attempt, None);
            // A quorum queue keeps one.
            let q = fresh_name("rabbit-quorum");
            publish_raw(&url(), &q, &plain_bodies(&q, 1))
                .await
                .expect("publish");
            let mut s = consumer(&q, 2).await;
            assert_eq!(take(&mut s, 1).await[0].attempt, Some(1));
        })
        .await;
    }
}

/// An event over the broker's `max_message_size` (128 MiB on RabbitMQ 3.10, 16 MiB from
/// 4.0) is refused for good — the relay moves it aside — where it was a retryable error
/// and the relay retried it forever. The broker closes the channel: a new publisher (the
/// runtime's reconnecting one, in a relay) publishes the next event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_max_message_size_is_refused_for_good() {
    use idem_broker::rabbitmq::RabbitPublisher;
    use idem_engine::{IdempotencyKey, OutboxEvent, Publisher};
    common::within(async {
        let url = url();
        let name = common::fresh_name("too-large");
        let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").expect("key");
        let big = vec![b'x'; (128 << 20) + 1024];
        let err = RabbitPublisher::connect(&url, &name)
            .await
            .expect("connect")
            .publish(&[OutboxEvent::new(key, "recorded", "A-1", big)])
            .await
            .expect_err("refused");
        assert!(!err.is_retryable(), "{err}");
        RabbitPublisher::connect(&url, &name)
            .await
            .expect("connect")
            .publish(&[OutboxEvent::new(key, "recorded", "A-1", "{}")])
            .await
            .expect("the next event goes");
    })
    .await;
}

/// A TCP hop to the test RabbitMQ that goes dead right after the AMQP handshake: it
/// passes both directions until the server's `connection.open-ok` has gone to the
/// client, then forwards nothing more from the client (every connection stays open), so
/// the client's `channel.open` is never answered. Returns the hop's port.
fn hop_dead_after_the_handshake() -> u16 {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let upstream = url()
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or("127.0.0.1:5672")
        .to_owned();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(&upstream) else {
                return;
            };
            let dead = Arc::new(AtomicBool::new(false));
            let (mut from_client, mut to_server) = (
                client.try_clone().expect("clone"),
                server.try_clone().expect("clone"),
            );
            let client_dead = Arc::clone(&dead);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = from_client.read(&mut buf) {
                    if n == 0 || client_dead.load(Ordering::SeqCst) {
                        // Swallowed: the path is dead from here on (held open).
                        if n == 0 {
                            return;
                        }
                        continue;
                    }
                    if to_server.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
            let (mut from_server, mut to_client) = (server, client);
            std::thread::spawn(move || {
                // Frames: type (1), channel (2), size (4), payload, 0xCE; a method's payload
                // starts with its class and method ids: connection.open-ok is 10, 41.
                let mut pending: Vec<u8> = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n) = from_server.read(&mut buf) {
                    if n == 0 || to_client.write_all(&buf[..n]).is_err() {
                        return;
                    }
                    pending.extend_from_slice(&buf[..n]);
                    while pending.len() >= 7 {
                        let size =
                            u32::from_be_bytes([pending[3], pending[4], pending[5], pending[6]])
                                as usize;
                        if pending.len() < 7 + size + 1 {
                            break;
                        }
                        if pending[0] == 1 && size >= 4 && pending[7..11] == [0, 10, 0, 41] {
                            dead.store(true, Ordering::SeqCst);
                        }
                        pending.drain(..7 + size + 1);
                    }
                }
            });
        }
    });
    port
}

/// A server that completes the AMQP handshake and then answers nothing (a dead path, a
/// stuck node): the publisher's and the consumer's `channel.open` (then confirm mode,
/// the queue's declaration, the consumer's start) are bounded by the URL's
/// `connection_timeout` with the handshake, and fail with a retryable connect error
/// after it. Only the handshake was bounded: the relay's reconnect waited for ever with
/// its leased outbox batch held open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_silent_after_the_handshake_is_a_connect_error_after_connection_timeout() {
    use idem_broker::rabbitmq::{RabbitConfig, RabbitConsumer, RabbitPublisher};
    let port = hop_dead_after_the_handshake();
    let silent = format!("amqp://guest:guest@127.0.0.1:{port}/%2f?connection_timeout=1500");
    let name = common::fresh_name("silent-after-handshake");
    let config = RabbitConfig::new(&silent, &name);
    let started = std::time::Instant::now();
    let publisher = tokio::time::timeout(
        Duration::from_secs(20),
        RabbitPublisher::connect_with(&config),
    )
    .await
    .expect("the publisher's connect ends within 20 s");
    let e = publisher.map(drop).expect_err("no channel, no publisher");
    assert!(
        matches!(e, idem_broker::BrokerError::Connect { .. }) && e.is_retryable(),
        "{e:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    let consumer = tokio::time::timeout(Duration::from_secs(20), RabbitConsumer::connect(&config))
        .await
        .expect("the consumer's connect ends within 20 s");
    let e = consumer.map(drop).expect_err("no channel, no consumer");
    assert!(
        matches!(e, idem_broker::BrokerError::Connect { .. }),
        "{e:?}"
    );
}

/// Three killers in one window of ten on a quorum queue whose delivery limit is twice the
/// gate's: no neighbour reaches the limit (dead-lettered by RabbitMQ without a reason),
/// because the consumer starts taking one message at a time (prefetch 1) and goes to its
/// full prefetch only at a first delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_killers_in_one_window_strand_no_neighbour() {
    let url =
        idem_broker::any::BrokerUrl::parse(&format!("{}?delivery_limit=6", url())).expect("URL");
    common::within(common::killers_in_one_window_strand_no_neighbour(&url)).await;
}
