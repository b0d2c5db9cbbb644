//! NATS JetStream on the real server (`IDEM_TEST_NATS_URL`, default
//! `nats://127.0.0.1:4222`) and the real Postgres store (`IDEM_TEST_POSTGRES_URL`). A
//! missing service fails the test.

use crate::common;

use std::time::Duration;

use common::Broker;

/// The server's URL, without the test's settings.
fn url() -> String {
    std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

fn broker() -> Broker {
    Broker::from_env(
        "IDEM_TEST_NATS_URL",
        "nats://127.0.0.1:4222",
        // An unacked delivery comes back after the ack wait.
        "ack_wait=1s",
        Duration::from_secs(3),
        // The stream's duplicate window drops a republished Nats-Msg-Id.
        true,
    )
}

common::conformance!(broker, lease = Duration::from_secs(1));

mod lease {
    use std::time::Duration;

    use idem_broker::nats::{publish_raw, NatsConfig, NatsConsumer};
    use idem_broker::BrokerError;
    use idem_engine::{Gate, GateConfig, OutcomeKind};
    use idem_testkit::MemoryStore;

    use super::common::{self, drain, fresh_name, plain_bodies, take, Plain};
    use super::url;

    fn config(name: &str) -> NatsConfig {
        NatsConfig::new(url(), name)
            .with_ack_wait(Duration::from_secs(1))
            .with_prefetch(8)
    }

    /// The attempt is the server's delivery count; `max_deliver` stops a message that
    /// keeps failing (here 2), and the nak is confirmed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn attempts_come_from_the_server_and_max_deliver_applies() {
        common::within(async {
            let name = fresh_name("nats-attempts");
            publish_raw(&url(), &name, &plain_bodies(&name, 1))
                .await
                .expect("publish");
            let mut stream = NatsConsumer::connect(&config(&name).with_max_deliver(2))
                .await
                .expect("connect");
            let failing = Gate::with_config(
                MemoryStore::new(),
                Plain {
                    fail: true,
                    ..Plain::default()
                },
                GateConfig::default().with_retry_delay(None),
            );
            for want in 1..=2 {
                let d = take(&mut stream, 1).await.pop().expect("one");
                assert_eq!(d.attempt, Some(want));
                let o = failing.process(d).await;
                assert_eq!(o.kind(), OutcomeKind::Failed);
                assert!(o.settle_error().is_none(), "{o:?}");
            }
            assert!(
                drain(&mut stream, Duration::from_secs(3)).await.is_empty(),
                "max_deliver 2: no third delivery"
            );
        })
        .await;
    }

    /// Deferrals that fill the prefetch stop the pulls: nothing new is pulled (memory
    /// stays bounded however long the store makes them wait) until they come back with
    /// their attempt; then the rest follow. Before, held deferrals did not count and the
    /// consumer went on pulling up to the server's `max_ack_pending`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deferrals_that_fill_the_prefetch_stop_the_pulls() {
        common::within(async {
            let name = fresh_name("nats-defer-full");
            publish_raw(&url(), &name, &plain_bodies(&name, 20))
                .await
                .expect("publish");
            let mut stream =
                NatsConsumer::connect(&config(&name).with_ack_wait(Duration::from_secs(10)))
                    .await
                    .expect("connect");
            common::deferrals_that_fill_the_prefetch_stop_taking(&mut stream).await;
        })
        .await;
    }

    /// A later process never rewrites the shared durable: other settings that matter are
    /// a configuration error naming them; the same settings join it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_existing_durable_with_other_settings_is_a_config_error() {
        common::within(async {
            let name = fresh_name("nats-durable");
            let first = NatsConsumer::connect(&config(&name)).await.expect("first");
            let err = NatsConsumer::connect(&config(&name).with_ack_wait(Duration::from_secs(2)))
                .await
                .expect_err("another ack wait");
            assert!(matches!(err, BrokerError::Config { .. }), "{err:?}");
            assert!(!err.is_retryable());
            assert!(err.to_string().contains("ack_wait"), "{err}");
            let err = NatsConsumer::connect(&config(&name).with_max_deliver(5))
                .await
                .expect_err("another max_deliver");
            assert!(err.to_string().contains("max_deliver"), "{err}");
            NatsConsumer::connect(&config(&name))
                .await
                .expect("same settings");
            drop(first);
        })
        .await;
    }

    /// An ack is confirmed by the server: on a closed connection it is an error, and the
    /// message is redelivered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_ack_on_a_closed_connection_is_an_error() {
        common::within(async {
            let name = fresh_name("nats-dead");
            publish_raw(&url(), &name, &plain_bodies(&name, 1))
                .await
                .expect("publish");
            let mut stream = NatsConsumer::connect(&config(&name))
                .await
                .expect("connect");
            let d = take(&mut stream, 1).await.pop().expect("one");
            stream.close().await.expect("close");
            let gate = Gate::new(MemoryStore::new(), Plain::default());
            let o = gate.process(d).await;
            assert_eq!(o.kind(), OutcomeKind::Processed);
            assert!(
                o.settle_error().is_some(),
                "acked on a closed connection: {o:?}"
            );
            let mut next = NatsConsumer::connect(&config(&name))
                .await
                .expect("reconnect");
            let again = take(&mut next, 1).await;
            assert_eq!(again[0].attempt, Some(2));
        })
        .await;
    }
}

/// An event whose header would not fit on one line (an event type with a CR or LF,
/// written by a handler or another program) is refused, not retryable — the relay then
/// moves it aside — where async-nats panicked and took the relay down on every restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_whose_header_has_a_line_break_is_refused_not_a_panic() {
    use idem_engine::{IdempotencyKey, OutboxEvent, Publisher};
    let url = url();
    let name = common::fresh_name("header-lines");
    let publisher = idem_broker::nats::NatsPublisher::connect(&url, &name)
        .await
        .expect("connect");
    let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").expect("key");
    let bad = OutboxEvent::new(key, "recorded\r\nNats-Msg-Id: forged", "A-1", "{}");
    let err = publisher.publish(&[bad]).await.expect_err("refused");
    assert!(!err.is_retryable(), "{err}");
    let mut chain = err.to_string();
    let mut cur = std::error::Error::source(&err);
    while let Some(e) = cur {
        chain = format!("{chain}: {e}");
        cur = e.source();
    }
    assert!(chain.contains("CR or LF"), "{chain}");
    let good = OutboxEvent::new(key, "recorded", "A-1", "{}");
    publisher
        .publish(&[good])
        .await
        .expect("the next event goes");
}

/// An event over the server's `max_payload` (1 MiB by default) is refused for good — the
/// relay moves it aside — where it was a retryable error and the relay retried its batch
/// forever; the next event goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_max_payload_is_refused_for_good() {
    let url = url();
    let name = common::fresh_name("too-large");
    let publisher = idem_broker::nats::NatsPublisher::connect(&url, &name)
        .await
        .expect("connect");
    common::an_oversized_event_is_refused_for_good(&publisher, 1_100_000).await;
}

/// A delivery as large as the server takes is still dead-lettered, byte for byte: its
/// reason header is cut to fit `max_payload` (here there is no room: it is only logged).
/// Before, the publish of the dead letter failed, and the delivery was handed back every
/// 5 s until `max_deliver`, never dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_at_max_payload_is_dead_lettered_whole() {
    use futures::StreamExt;
    use idem_broker::{dead_letter_name, until_idle};
    use idem_engine::{Acker, RejectReason};
    common::within(async {
        let b = broker();
        let name = common::fresh_name("at-max");
        let url = url();
        let max = idem_broker::nats::NatsPublisher::connect(&url, &name)
            .await
            .expect("connect")
            .max_payload();
        let body = vec![b'x'; max - 10];
        idem_broker::any::publish_raw(&b.url, &name, std::slice::from_ref(&body))
            .await
            .expect("publish");
        let mut deliveries = idem_broker::any::AnyConsumer::connect(&b.url, &name, 1)
            .await
            .expect("consumer");
        let d = common::take(&mut deliveries, 1).await.remove(0);
        d.acker
            .dead_letter(
                &d.payload,
                &d.headers,
                &RejectReason::new("not_json", "not JSON"),
            )
            .await
            .expect("dead-lettered");
        drop(deliveries);
        assert_eq!(common::wait_pending(&b.url, &name, 0).await, 0, "settled");
        let mut letters = until_idle(
            idem_broker::any::AnyConsumer::connect(&b.url, &dead_letter_name(&name), 1)
                .await
                .expect("dead-letter consumer"),
            std::time::Duration::from_secs(5),
        );
        let letter = letters
            .next()
            .await
            .expect("a dead letter")
            .expect("delivery");
        assert!(letter.payload == body, "the payload, byte for byte");
    })
    .await;
}

/// Deliveries lost by a dead process that come due after a first delivery still come one
/// at a time: no pull request stays open for them (a first delivery opens the prefetch
/// with `no_wait` requests). Before, the one it opened stayed open for 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reruns_that_come_due_behind_a_first_delivery_come_one_at_a_time() {
    let url = idem_broker::any::BrokerUrl::parse(&format!("{}?ack_wait=1s", url())).expect("URL");
    common::within(common::reruns_that_come_due_behind_a_first_delivery_come_one_at_a_time(&url))
        .await;
}

/// Three killers in one window of ten, `max_deliver` twice the gate's limit: no neighbour
/// is stranded (the consumer pulls one at a time while a rerun is held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_killers_in_one_window_strand_no_neighbour() {
    let url = idem_broker::any::BrokerUrl::parse(&format!("{}?ack_wait=1s&max_deliver=6", url()))
        .expect("URL");
    common::within(common::killers_in_one_window_strand_no_neighbour(&url)).await;
}
