//! Delivery counts across members, deferrals, keyed order, and refusals.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idem_broker::any::BrokerUrl;
use idem_broker::kafka::KafkaConfig;
use idem_engine::Gate;

use super::{brokers, next_within, one_partition, publish_all, url_in};
use crate::common;

/// An event Kafka refuses for good (over librdkafka's `message.max.bytes`, 1,000,000 by
/// default) is a refusal that no retry helps — the relay moves it aside — where it was a
/// retryable error and the relay retried its batch forever; the next event goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_too_large_for_kafka_is_refused_for_good() {
    let topic = common::fresh_name("too-large");
    let publisher = idem_broker::kafka::KafkaPublisher::connect(&brokers(), &topic)
        .await
        .expect("connect");
    common::an_oversized_event_is_refused_for_good(&publisher, 1_100_000).await;
}

/// A member that dies holding a delivery (dropped without settling it, as a crash
/// leaves it) N times: each new member of the group sees the count one higher, read from
/// `NAME.attempts`, where it was written before the delivery was handed out. A deferral
/// hands it back without raising the count; a nack raises it, and that count too
/// survives the member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_member_dies_counts_on_in_the_next_member() {
    use idem_broker::kafka::{KafkaConsumer, KafkaPublisher};
    use idem_engine::Acker as _;
    const N: u32 = 3;
    let config = one_partition(&common::fresh_name("attempts"));
    KafkaPublisher::connect_config(&config)
        .await
        .expect("publisher")
        .publish_raw(&[b"killer".to_vec()])
        .await
        .expect("publish");
    let take = |config: KafkaConfig| async move {
        let mut consumer = KafkaConsumer::connect(&config).await.expect("connect");
        let d = next_within(&mut consumer, Duration::from_secs(120))
            .await
            .expect("a delivery within 120 s")
            .expect("the stream goes on")
            .expect("a delivery");
        assert_eq!(d.payload, b"killer");
        (consumer, d)
    };
    for run in 1..=N {
        let (consumer, d) = take(config.clone()).await;
        assert_eq!(d.attempt, Some(run), "member {run}");
        // The member dies holding it.
        drop(d);
        drop(consumer);
    }
    let (mut consumer, d) = take(config.clone()).await;
    assert_eq!(d.attempt, Some(N + 1), "after {N} members died holding it");
    assert!(d.acker.attempt_counts_runs());
    d.acker.defer(Duration::ZERO).await.expect("defer");
    let d = next_within(&mut consumer, Duration::from_secs(30))
        .await
        .expect("deferred delivery back")
        .expect("stream")
        .expect("delivery");
    assert_eq!(d.attempt, Some(N + 1), "a deferral is not a delivery");
    d.acker.nack(None).await.expect("nack");
    let d = next_within(&mut consumer, Duration::from_secs(30))
        .await
        .expect("nacked delivery back")
        .expect("stream")
        .expect("delivery");
    assert_eq!(d.attempt, Some(N + 2), "a nack is");
    drop(d);
    drop(consumer);
    let (_consumer, d) = take(config.clone()).await;
    assert_eq!(d.attempt, Some(N + 3), "the nacked run survives the member");
}

/// The next `n` deliveries of `consumer`, each within `within`.
async fn take_n(
    consumer: &mut idem_broker::kafka::KafkaConsumer,
    n: usize,
    within: Duration,
) -> Vec<idem_engine::Delivery<idem_broker::kafka::KafkaAcker>> {
    let mut got = Vec::new();
    for _ in 0..n {
        got.push(
            next_within(consumer, within)
                .await
                .expect("a delivery in time")
                .expect("the stream goes on")
                .expect("a delivery"),
        );
    }
    got
}

/// Deferred deliveries that fill the prefetch stop the stream from taking new ones until
/// they come back (the poller's channel fills and it pauses the partition): however long
/// the store makes them wait, what the member holds stays bounded, and a deferral is not
/// a delivery (each comes back with the attempt it had).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferrals_that_fill_the_prefetch_stop_the_fetching() {
    use idem_broker::kafka::KafkaConsumer;
    use idem_engine::Acker as _;
    let config = one_partition(&common::fresh_name("defer-full")).with_prefetch(8);
    let bodies: Vec<Vec<u8>> = (0..20).map(|i| format!("m-{i:02}").into_bytes()).collect();
    publish_all(&config, &bodies).await;
    let mut consumer = KafkaConsumer::connect(&config).await.expect("connect");
    let first = take_n(&mut consumer, 8, Duration::from_secs(120)).await;
    let started = Instant::now();
    for d in first {
        d.acker.defer(Duration::from_secs(3)).await.expect("defer");
    }
    let back = take_n(&mut consumer, 8, Duration::from_secs(30)).await;
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "took new deliveries while the deferrals filled the prefetch"
    );
    let mut payloads: Vec<&[u8]> = back.iter().map(|d| d.payload.as_slice()).collect();
    payloads.sort_unstable();
    let want: Vec<&[u8]> = bodies[..8].iter().map(Vec::as_slice).collect();
    assert_eq!(payloads, want, "the deferred ones come back first");
    assert!(
        back.iter().all(|d| d.attempt == Some(1)),
        "a deferral is not a delivery"
    );
    let gate = Gate::new(idem_testkit::MemoryStore::new(), common::Plain::default());
    for o in gate.process_batch(back).await {
        assert!(o.settle_error().is_none(), "{o:?}");
    }
    let rest = take_n(&mut consumer, 12, Duration::from_secs(30)).await;
    let mut payloads: Vec<&[u8]> = rest.iter().map(|d| d.payload.as_slice()).collect();
    payloads.sort_unstable();
    let want: Vec<&[u8]> = bodies[8..].iter().map(Vec::as_slice).collect();
    assert_eq!(payloads, want);
    for o in gate.process_batch(rest).await {
        assert!(o.settle_error().is_none(), "{o:?}");
    }
}

/// A dead letter over librdkafka's default `message.max.bytes` (1,000,000, below Kafka's
/// own limit for a topic, 1,048,588) is produced whole: the consumer's producer takes any
/// record the consumer can receive, where it refused such a dead letter before sending it
/// and the delivery came back once a second for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_over_librdkafkas_default_size_is_produced_whole() {
    use idem_broker::kafka::KafkaConsumer;
    use idem_engine::{Acker as _, RejectReason};
    let config = one_partition(&common::fresh_name("dl-large"));
    publish_all(&config, &[b"m-0".to_vec()]).await;
    let mut consumer = KafkaConsumer::connect(&config).await.expect("connect");
    let d = take_n(&mut consumer, 1, Duration::from_secs(120))
        .await
        .remove(0);
    let large: Vec<u8> = (0..1_040_000u32).map(|i| (i % 251) as u8).collect();
    d.acker
        .dead_letter(
            &large,
            &d.headers,
            &RejectReason::new("test", "a dead letter of 1,040,000 bytes"),
        )
        .await
        .expect("dead-lettered");
    let letters = one_partition(&idem_broker::dead_letter_name(&config.name));
    let mut letters = KafkaConsumer::connect(&letters).await.expect("letters");
    let got = take_n(&mut letters, 1, Duration::from_secs(60)).await;
    assert!(got[0].payload == large, "the dead letter whole");
    let reason = got[0]
        .headers
        .iter()
        .find(|(k, _)| k == idem_broker::DEAD_LETTER_REASON_HEADER)
        .map(|(_, v)| v.as_str());
    assert_eq!(reason, Some("test: a dead letter of 1,040,000 bytes"));
}

/// A dead letter Kafka refuses for good (here over a `message.max.bytes` the application
/// set as a client setting; a dead-letter topic whose `max.message.bytes` is below the
/// source's is another) stops the consumer with a configuration error, where the
/// delivery came back once a second for ever and held the partition's commit: no retry
/// helps. The delivery is left unsettled, so nothing after it is taken, its offset stays
/// uncommitted, and the next member of the group receives it again, first, and
/// dead-letters it once the limit is raised.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_refused_for_good_stops_the_consumer_and_leaves_the_delivery_unsettled() {
    use idem_broker::kafka::KafkaConsumer;
    let config = one_partition(&common::fresh_name("dl-refused"));
    // Not UTF-8: poison to the test's handler, dead-lettered before any claim.
    let poison = vec![0xff; 30_000];
    publish_all(&config, &[poison.clone(), b"m-1".to_vec()]).await;
    let small = config
        .clone()
        .with_client_setting("message.max.bytes", "20000");
    let stream = KafkaConsumer::connect(&small).await.expect("connect");
    let started = Instant::now();
    let stopped = common::stopped_by_a_refused_dead_letter(stream, Duration::from_secs(120)).await;
    let text = stopped.to_string();
    assert!(
        text.contains(".dead-letter")
            && text.contains("offset 0")
            && text.contains("max.message.bytes"),
        "names the topic, the offset and the setting: {text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "at once, not after retries"
    );
    // The next member (the limit raised) receives the poison again, first.
    let mut next = KafkaConsumer::connect(&config).await.expect("connect");
    let got = take_n(&mut next, 2, Duration::from_secs(60)).await;
    assert!(got[0].payload == poison, "the refused delivery comes first");
    assert_eq!(got[1].payload, b"m-1");
    let gate = Gate::new(idem_testkit::MemoryStore::new(), common::Plain::default());
    for o in gate.process_batch(got).await {
        assert!(o.settle_error().is_none(), "{o:?}");
    }
    let letters = one_partition(&idem_broker::dead_letter_name(&config.name));
    let mut letters = KafkaConsumer::connect(&letters).await.expect("letters");
    let got = take_n(&mut letters, 1, Duration::from_secs(60)).await;
    assert!(
        got[0].payload == poison,
        "dead-lettered whole once the limit allows"
    );
    assert!(
        next_within(&mut letters, Duration::from_secs(3))
            .await
            .is_none(),
        "dead-lettered once"
    );
}

/// Keyed publishing (`idem publish` keys each record by its subject): the bodies of one
/// key land on one partition in the order given, each delivery carrying its key, so a
/// group delivers a subject's payloads in publish order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_bodies_of_one_subject_share_a_partition_in_order() {
    use idem_broker::any::AnyPublisher;
    use idem_broker::kafka::KafkaConsumer;
    let topic = common::fresh_name("keyed");
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let url = BrokerUrl::parse(&url_in(&group, 4)).expect("URL");
    let bodies: Vec<Vec<u8>> = (0..12).map(|i| format!("{i:02}").into_bytes()).collect();
    let keys: Vec<Option<Vec<u8>>> = (0..12)
        .map(|i| Some(format!("subject-{}", i % 3).into_bytes()))
        .collect();
    AnyPublisher::connect(&url, &topic)
        .await
        .expect("publisher")
        .publish_keyed(&bodies, &keys, &[])
        .await
        .expect("publish");
    let config = KafkaConfig::from_url(&url, &topic).expect("config");
    let mut consumer = KafkaConsumer::connect(&config).await.expect("connect");
    let got = take_n(&mut consumer, 12, Duration::from_secs(120)).await;
    let mut by_key: HashMap<String, Vec<(i32, String)>> = HashMap::new();
    for d in &got {
        let key = d
            .headers
            .iter()
            .find(|(k, _)| k == idem_broker::kafka::KEY_HEADER)
            .map(|(_, v)| v.clone())
            .expect("each delivery carries its key");
        by_key.entry(key).or_default().push((
            d.acker.partition(),
            String::from_utf8(d.payload.clone()).expect("text"),
        ));
    }
    assert_eq!(by_key.len(), 3, "{by_key:?}");
    for (key, seen) in by_key {
        let n: usize = key.trim_start_matches("subject-").parse().expect("n");
        let want: Vec<String> = (0..12)
            .filter(|i| i % 3 == n)
            .map(|i| format!("{i:02}"))
            .collect();
        let got: Vec<String> = seen.iter().map(|(_, b)| b.clone()).collect();
        assert_eq!(got, want, "{key}: in publish order");
        assert!(
            seen.iter().all(|(p, _)| *p == seen[0].0),
            "{key}: on one partition: {seen:?}"
        );
    }
}

/// A message fetched behind the first delivery of its member's ownership, whose member
/// dies while it runs before any commit of its neighbours landed (they are held
/// unsettled): each next member counts it one higher — the record in `NAME.attempts`
/// says how far the dead member may have handed out deliveries — instead of counting it
/// as a first delivery for ever (the gate's check before the handler never saw a rerun,
/// and the message killed every member).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_fetched_behind_the_first_counts_on_when_its_member_dies() {
    use idem_broker::kafka::KafkaConsumer;
    const N: u32 = 3;
    let config = one_partition(&common::fresh_name("behind"));
    let bodies: Vec<Vec<u8>> = ["ok-0", "ok-1", "ok-2", "killer"]
        .iter()
        .map(|b| b.as_bytes().to_vec())
        .collect();
    publish_all(&config, &bodies).await;
    for run in 1..=N {
        let mut consumer = KafkaConsumer::connect(&config).await.expect("connect");
        let mut held = Vec::new();
        for body in &bodies {
            let d = next_within(&mut consumer, Duration::from_secs(120))
                .await
                .expect("a delivery within 120 s")
                .expect("the stream goes on")
                .expect("a delivery");
            assert_eq!(&d.payload, body, "member {run}: in offset order");
            held.push(d);
        }
        let killer = held.last().expect("four deliveries");
        assert_eq!(
            killer.attempt,
            Some(run),
            "member {run}: the killer behind the first delivery counts on"
        );
        // The member dies running the killer, its neighbours unsettled.
        drop(held);
        drop(consumer);
    }
}
