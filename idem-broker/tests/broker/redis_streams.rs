//! Redis Streams on the real server (`IDEM_TEST_REDIS_URL`, default
//! `redis://127.0.0.1:6379`) and the real Postgres store (`IDEM_TEST_POSTGRES_URL`). A
//! missing service fails the test.

use crate::common;

use std::time::Duration;

use common::Broker;

fn broker() -> Broker {
    Broker::from_env(
        "IDEM_TEST_REDIS_URL",
        "redis://127.0.0.1:6379",
        // A dead consumer's pending entries are taken over after a second (the lease the
        // slow-handler scenario outlasts; shorter, a loaded machine's late keep-alive
        // would look like a takeover).
        "min_idle=1s&block=200ms",
        Duration::from_secs(3),
        false,
    )
}

common::conformance!(broker, lease = Duration::from_secs(1));

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

    /// A dead letter Redis refuses for good (the dead-letter key holds a string:
    /// `WRONGTYPE`) stops the consumer with a configuration error naming the key, where
    /// the entry was left pending and came back after `min_idle` for ever. Left pending,
    /// it is taken over by the next consumer once the key is fixed, and dead-lettered
    /// once, whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_letter_refused_for_good_stops_the_consumer_and_leaves_the_entry_pending() {
        use idem_engine::{consumer, ConsumerConfig, Gate};
        common::within(async {
            let name = fresh_name("redis-dl-refused");
            let dl = idem_broker::dead_letter_name(&name);
            let redis = client().await;
            let _: () = redis
                .set(&dl, "not a stream", None, None, false)
                .await
                .expect("SET");
            // Not UTF-8: poison to the test's handler, dead-lettered before any claim.
            let poison = vec![0xff; 100];
            publish_raw(&url(), &name, std::slice::from_ref(&poison))
                .await
                .expect("publish");
            let deliveries = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("consumer");
            let stopped =
                common::stopped_by_a_refused_dead_letter(deliveries, Duration::from_secs(30)).await;
            assert!(
                stopped.to_string().contains(&dl),
                "names the key: {stopped}"
            );

            // The operator removes the key; the next consumer takes the entry over.
            let _: i64 = redis.del(&dl).await.expect("DEL");
            let deliveries = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("consumer");
            let gate = Gate::new(idem_testkit::MemoryStore::new(), common::Plain::default());
            let stats = consumer::run(
                &gate,
                idem_broker::until_idle(deliveries, Duration::from_secs(4)),
                ConsumerConfig::new(1, 1),
                std::future::pending::<()>(),
                |_| {},
            )
            .await
            .expect("consumer run");
            assert_eq!(stats.rejected, 1, "{stats:?}");
            let letters: Vec<(String, HashMap<String, Value>)> =
                redis.xrange(&dl, "-", "+", None).await.expect("XRANGE");
            assert_eq!(letters.len(), 1, "dead-lettered once");
            let body = letters[0]
                .1
                .get(idem_broker::redis_streams::PAYLOAD_FIELD)
                .and_then(Value::as_bytes)
                .map(<[u8]>::to_vec);
            assert_eq!(body, Some(poison), "whole");
        })
        .await;
    }

    /// The delivery count of entry `id` in the group `idem` of stream `name`.
    async fn delivery_count(redis: &Client, name: &str, id: &str) -> u64 {
        let pending: Vec<(String, String, u64, u64)> = redis
            .xpending(name, "idem", (id, id, 1))
            .await
            .expect("XPENDING");
        pending.first().map_or(0, |p| p.3)
    }

    /// A deferral (a key held by another transaction, a store outage) is held by the
    /// consumer, alive past `min_idle`, and comes back with the same attempt: the group
    /// counts no delivery and no other consumer takes it over. A nack is an attempt: the
    /// entry is released and taken again with its count plus one. (Before, a deferral was
    /// a release: every wait on a held key cost a delivery, so a message that waited was
    /// dead-lettered early at its first failure, and a killer's runs could not be told
    /// from waits.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deferral_is_held_alive_and_comes_back_with_its_attempt() {
        common::within(async {
            use idem_engine::Acker;
            let name = fresh_name("redis-defer");
            publish_raw(&url(), &name, &plain_bodies(&name, 1))
                .await
                .expect("publish");
            let redis = client().await;
            let mut owner = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("owner");
            let d = take(&mut owner, 1).await.remove(0);
            assert_eq!(d.attempt, Some(1));
            let body = d.payload.clone();
            let id = d.acker.entry_id().to_owned();
            assert!(d.acker.attempt_counts_runs());
            // Held past min_idle (1 s) while another consumer of the group looks for
            // idle entries all along.
            d.acker
                .defer(Duration::from_millis(2_500))
                .await
                .expect("defer");
            let mut other = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("other");
            let watcher = tokio::spawn(async move {
                let seen = drain(&mut other, Duration::from_secs(4)).await;
                common::bodies_of(&seen)
            });
            let d = take(&mut owner, 1).await.remove(0);
            assert_eq!(d.payload, body);
            assert_eq!(d.acker.entry_id(), id);
            assert_eq!(d.attempt, Some(1), "a deferral is not an attempt");
            assert_eq!(
                delivery_count(&redis, &name, &id).await,
                1,
                "no delivery counted"
            );
            assert_eq!(
                watcher.await.expect("watcher"),
                Vec::<String>::new(),
                "taken over while held"
            );
            d.acker
                .nack(Some(Duration::from_millis(100)))
                .await
                .expect("nack");
            let d = take(&mut owner, 1).await.remove(0);
            assert_eq!(d.payload, body);
            assert_eq!(d.attempt, Some(2), "a nack is an attempt");
            assert_eq!(delivery_count(&redis, &name, &id).await, 2);
        })
        .await;
    }

    /// A failing message is charged its own runs, not the takeovers it met unrun: its
    /// handler fails (a transient error) once, then two consumers die holding it before
    /// it runs again (an `XAUTOCLAIM` of a dead consumer's entries takes it beside the
    /// one that kills them), so its next delivery carries count 4. With `max_attempts`
    /// 3 its handler still runs 3 times before it is dead-lettered `attempts_exhausted`.
    /// Before, the failure was numbered by the delivery count: dead-lettered after 2
    /// runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn takeovers_unrun_do_not_count_as_attempts() {
        use idem_engine::{consumer, ConsumerConfig, Gate, GateConfig, OutcomeKind, RetryPolicy};
        use std::sync::Mutex;
        common::within(async {
            let name = fresh_name("redis-unrun");
            publish_raw(&url(), &name, &plain_bodies(&name, 1))
                .await
                .expect("publish");
            let gate = Gate::with_config(
                idem_testkit::MemoryStore::new(),
                common::Plain {
                    fail: true,
                    ..Default::default()
                },
                GateConfig::default()
                    .with_max_attempts(3)
                    .with_retry(RetryPolicy::fixed(Duration::from_millis(100))),
            );
            let mut first = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("first");
            let d = take(&mut first, 1).await.remove(0);
            assert_eq!(gate.process(d).await.kind(), OutcomeKind::Failed);
            drop(first);
            // Two processes die of another message while holding it: taken, never run.
            for died in 2..=3 {
                let mut process = RedisStreamsConsumer::connect(&config(&name))
                    .await
                    .expect("process");
                let held = take(&mut process, 1).await;
                assert_eq!(held[0].attempt, Some(died), "its delivery count");
                drop(process);
                drop(held);
            }
            let outcomes = Mutex::new(Vec::new());
            let deliveries = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("last");
            consumer::run(
                &gate,
                idem_broker::until_idle(deliveries, Duration::from_secs(4)),
                ConsumerConfig::new(1, 1),
                std::future::pending::<()>(),
                |o| {
                    let reason = match o {
                        idem_engine::Outcome::Rejected { reason, .. } => Some(reason.clone()),
                        _ => None,
                    };
                    outcomes.lock().expect("outcomes").push((o.kind(), reason));
                },
            )
            .await
            .expect("consumer run");
            let outcomes = outcomes.into_inner().expect("outcomes");
            let kinds: Vec<OutcomeKind> = outcomes.iter().map(|o| o.0).collect();
            assert_eq!(
                kinds,
                [OutcomeKind::Failed, OutcomeKind::Rejected],
                "two more runs, the last dead-lettered: {outcomes:?}"
            );
            let reason = outcomes[1].1.as_ref().expect("a reason");
            assert_eq!(reason.code, idem_engine::gate::ATTEMPTS_EXHAUSTED);
            assert!(reason.detail.starts_with("3 attempts"), "{reason:?}");
        })
        .await;
    }

    /// Deferrals that fill the prefetch stop the reads: nothing new is read (memory stays
    /// bounded however long the store makes them wait) until they come back with their
    /// attempt; then the rest follow. Before, held deferrals did not count and the
    /// consumer went on reading.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deferrals_that_fill_the_prefetch_stop_the_reads() {
        common::within(async {
            let name = fresh_name("redis-defer-full");
            publish_raw(&url(), &name, &plain_bodies(&name, 20))
                .await
                .expect("publish");
            let mut owner = RedisStreamsConsumer::connect(&config(&name))
                .await
                .expect("owner");
            common::deferrals_that_fill_the_prefetch_stop_taking(&mut owner).await;
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
