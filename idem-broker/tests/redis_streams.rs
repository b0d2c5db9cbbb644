//! Redis Streams on the real server (`IDEM_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`) and the real Postgres store (`IDEM_TEST_POSTGRES_URL`). A
//! missing service fails the test.

mod common;

use std::time::Duration;

use common::Broker;

fn broker() -> Broker {
    Broker::from_env(
        "IDEM_TEST_REDIS_URL",
        "redis://127.0.0.1:6379",
        // A dead consumer's pending entries are taken over after half a second.
        "min_idle=500ms&block=200ms",
        Duration::from_secs(3),
        false,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_commit_before_ack_is_taken_over_and_skipped() {
    common::within(common::crash_after_commit_before_ack(broker())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_goes_to_the_dead_letter_stream_with_its_reason() {
    common::within(common::poison_is_dead_lettered(broker())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reason_on_several_lines_is_dead_lettered() {
    common::within(common::a_reason_on_several_lines_is_dead_lettered(broker())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_delivers_each_event_once_downstream() {
    common::within(common::relay_delivers_each_event_once(broker())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_crosses_the_broker_both_ways() {
    common::within(common::traceparent_crosses_the_broker(broker())).await;
}

mod lease {
    use std::collections::HashMap;
    use std::time::Duration;

    use fred::prelude::*;
    use idem_broker::redis_streams::{publish_raw, RedisStreamsConfig, RedisStreamsConsumer};

    use super::common::{self, drain, fresh_name, plain_bodies, take};

    fn url() -> String {
        std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
    }

    fn config(name: &str) -> RedisStreamsConfig {
        RedisStreamsConfig::new(url(), name)
            .with_min_idle(Duration::from_secs(1))
            .with_block(Duration::from_millis(100))
            .with_prefetch(8)
    }

    async fn client() -> Client {
        let c = Client::new(Config::from_url(&url()).expect("url"), None, None, None);
        c.init().await.expect("connect to Redis");
        c
    }

    /// min_idle 1 s; the handler takes 3.5 s on the first entry while three more wait in
    /// the consumer's hands, and a second consumer of the group polls (and `XAUTOCLAIM`s)
    /// all along: the owner's keep-alive keeps all four, nothing is taken over or
    /// delivered twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_slower_than_min_idle_causes_no_takeover() {
        common::within(async {
            let name = fresh_name("redis-slow");
            publish_raw(&url(), &name, &plain_bodies(&name, 4))
                .await
                .expect("publish");
            let mut owner = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("owner");
            let taken = take(&mut owner, 4).await;
            let mut other = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("other");
            let watcher = tokio::spawn(async move {
                let seen = drain(&mut other, Duration::from_secs(5)).await;
                common::bodies_of(&seen)
            });
            common::slow_handler_causes_no_redelivery(owner, taken, Duration::from_millis(3_500))
                .await;
            assert_eq!(
                watcher.await.expect("watcher"),
                Vec::<String>::new(),
                "taken over"
            );
        })
        .await;
    }

    /// A consumer that stopped (dropped with entries pending) has them taken over after
    /// min_idle, and the attempt is the pending entry's delivery count.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_taken_over_entry_carries_its_delivery_count() {
        common::within(async {
            let name = fresh_name("redis-attempt");
            publish_raw(&url(), &name, &plain_bodies(&name, 2))
                .await
                .expect("publish");
            let mut first = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("first");
            let taken = take(&mut first, 2).await;
            assert!(taken.iter().all(|d| d.attempt == Some(1)));
            drop(taken);
            drop(first);
            let mut second = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("second");
            let again = take(&mut second, 2).await;
            assert!(
                again.iter().all(|d| d.attempt == Some(2)),
                "{:?}",
                again.iter().map(|d| d.attempt).collect::<Vec<_>>()
            );
        })
        .await;
    }

    /// A new consumer removes the group's consumers that are idle past `forget_after`
    /// with nothing pending, and keeps one that still holds an entry.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_consumers_with_nothing_pending_are_removed_by_a_successor() {
        common::within(async {
            let name = fresh_name("redis-forget");
            publish_raw(&url(), &name, &plain_bodies(&name, 1))
                .await
                .expect("publish");
            let redis = client().await;
            let _: Value = redis
                .xgroup_create(name.as_str(), "idem", "0", true)
                .await
                .expect("group");
            let _: Value = redis
                .xgroup_createconsumer(name.as_str(), "idem", "ghost")
                .await
                .expect("ghost");
            let _: Value = redis
                .xreadgroup("idem", "holder", Some(1), None, false, name.as_str(), ">")
                .await
                .expect("holder reads one");
            tokio::time::sleep(Duration::from_millis(1_200)).await;
            let c = RedisStreamsConsumer::connect(
                &config(&name)
                    .with_consumer("successor")
                    .with_forget_after(Duration::from_secs(1)),
            )
            .await
            .expect("successor");
            let consumers: Vec<HashMap<String, Value>> = redis
                .xinfo_consumers(name.as_str(), "idem")
                .await
                .expect("XINFO CONSUMERS");
            let mut names: Vec<String> = consumers
                .iter()
                .filter_map(|c| c.get("name").and_then(Value::as_string))
                .collect();
            names.sort();
            assert!(!names.contains(&"ghost".to_owned()), "{names:?}");
            assert!(names.contains(&"holder".to_owned()), "{names:?}");
            drop(c);
        })
        .await;
    }
}
