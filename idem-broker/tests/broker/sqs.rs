//! SQS on a real protocol server (moto; `IDEM_TEST_SQS_ENDPOINT`, default
//! `http://127.0.0.1:5000`, started by `scripts/ensure-sqs`) and the real Postgres store
//! (`IDEM_TEST_POSTGRES_URL`). A missing server fails the test.

use crate::common;

use std::time::Duration;

use aws_sdk_sqs::types::QueueAttributeName;
use common::Broker;
use futures::StreamExt;
use idem_broker::any::{publish_raw, AnyConsumer, AnyPublisher, BrokerUrl};
use idem_broker::{until_idle, BrokerError};
use idem_engine::Acker;

/// The test server's `host:port` (`IDEM_TEST_SQS_ENDPOINT`, default moto's).
fn host() -> String {
    let endpoint = std::env::var("IDEM_TEST_SQS_ENDPOINT")
        .unwrap_or_else(|_| "http://127.0.0.1:5000".to_owned());
    endpoint
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .to_owned()
}

fn broker() -> Broker {
    let host = host();
    // A received, unsettled message comes back after two seconds; short long polls.
    let url = format!("sqs://{host}?visibility_timeout=2s&wait=1s");
    Broker {
        url: BrokerUrl::parse(&url).unwrap_or_else(|e| panic!("IDEM_TEST_SQS_ENDPOINT: {e}")),
        // Longer than the visibility timeout plus a long poll.
        idle: Duration::from_secs(5),
        // A standard queue does not drop a republished event id.
        dedups_event_ids: false,
    }
}

common::conformance!(broker, lease = Duration::from_secs(2));

/// The test endpoint (`http://HOST:PORT`).
fn endpoint() -> String {
    std::env::var("IDEM_TEST_SQS_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:5000".to_owned())
}

/// An SDK client for the test endpoint, to read what the adapter created.
async fn sdk() -> aws_sdk_sqs::Client {
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    let conf = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .http_client(idem_broker::sqs::http_client())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint())
        .credentials_provider(Credentials::new(
            "idem-local",
            "idem-local",
            None,
            None,
            "t",
        ))
        .build();
    aws_sdk_sqs::Client::from_conf(conf)
}

async fn attributes(
    sqs: &aws_sdk_sqs::Client,
    queue: &str,
) -> std::collections::HashMap<QueueAttributeName, String> {
    let url = sqs
        .get_queue_url()
        .queue_name(queue)
        .send()
        .await
        .expect("queue exists")
        .queue_url
        .expect("url");
    sqs.get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .expect("attributes")
        .attributes
        .unwrap_or_default()
}

/// The consumer creates `NAME.dead-letter` keeping messages 14 days, and `NAME` with the
/// retention asked for and a redrive policy to it with `maxReceiveCount` 20 (twice the
/// gate's default `max_attempts`) — read back from the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_are_created_with_dead_letter_retention_and_a_redrive_policy() {
    let name = common::fresh_name("created");
    let url = BrokerUrl::parse(&format!(
        "sqs://{}?visibility_timeout=2s&wait=1s&retention=48h",
        endpoint().trim_start_matches("http://")
    ))
    .expect("url");
    let _consumer = AnyConsumer::connect(&url, &name, 4).await.expect("connect");
    let sqs = sdk().await;
    let dead = attributes(&sqs, &format!("{name}-dead-letter")).await;
    assert_eq!(
        dead.get(&QueueAttributeName::MessageRetentionPeriod)
            .map(String::as_str),
        Some("1209600"),
        "{dead:?}"
    );
    let source = attributes(&sqs, &name).await;
    assert_eq!(
        source
            .get(&QueueAttributeName::MessageRetentionPeriod)
            .map(String::as_str),
        Some("172800"),
        "{source:?}"
    );
    let policy = source
        .get(&QueueAttributeName::RedrivePolicy)
        .unwrap_or_else(|| panic!("no redrive policy: {source:?}"));
    let dead_arn = dead.get(&QueueAttributeName::QueueArn).expect("arn");
    assert!(policy.contains(dead_arn.as_str()), "{policy}");
    assert_eq!(max_receive_count(policy), Some(20), "{policy}");

    // Connecting again reads the queues and accepts them; asking for another retention
    // is a configuration error, and nothing is changed.
    AnyConsumer::connect(&url, &name, 4)
        .await
        .expect("reconnect");
    let other = BrokerUrl::parse(&format!(
        "sqs://{}?retention=72h",
        endpoint().trim_start_matches("http://")
    ))
    .expect("url");
    let err = AnyConsumer::connect(&other, &name, 4)
        .await
        .expect_err("a retention mismatch");
    assert!(matches!(err, BrokerError::Config { .. }), "{err}");
    assert!(!err.is_retryable());
    assert_eq!(
        attributes(&sqs, &name)
            .await
            .get(&QueueAttributeName::MessageRetentionPeriod)
            .map(String::as_str),
        Some("172800")
    );
}

/// The `maxReceiveCount` of a redrive policy as the server gives it back (a number or a
/// numeric string).
fn max_receive_count(policy: &str) -> Option<u32> {
    let v: serde_json::Value = serde_json::from_str(policy).ok()?;
    match &v["maxReceiveCount"] {
        serde_json::Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        serde_json::Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// A source queue that already exists with `maxReceiveCount` 10 (the gate's default
/// `max_attempts`) is used under the defaults, which give a new queue 20, and left as it
/// is; asking for 20 is a configuration error (a count asked for is held), and a count
/// below 10 is refused under the defaults.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_queue_receiving_ten_times_is_used_unless_more_is_asked() {
    let host = endpoint().trim_start_matches("http://").to_owned();
    let url = |query: &str| BrokerUrl::parse(&format!("sqs://{host}{query}")).expect("url");
    let name = common::fresh_name("old-redrive");
    AnyConsumer::connect(&url("?max_receive_count=10"), &name, 4)
        .await
        .expect("a queue with 10");
    AnyConsumer::connect(&url(""), &name, 4)
        .await
        .expect("used under the defaults");
    let sqs = sdk().await;
    let policy = attributes(&sqs, &name)
        .await
        .get(&QueueAttributeName::RedrivePolicy)
        .cloned()
        .expect("a redrive policy");
    assert_eq!(
        max_receive_count(&policy),
        Some(10),
        "left as it is: {policy}"
    );
    let err = AnyConsumer::connect(&url("?max_receive_count=20"), &name, 4)
        .await
        .expect_err("20 asked for");
    assert!(matches!(err, BrokerError::Config { .. }), "{err}");
    assert!(err.to_string().contains("after 10 receives"), "{err}");

    let low = common::fresh_name("low-redrive");
    AnyConsumer::connect(&url("?max_receive_count=5"), &low, 4)
        .await
        .expect("a queue with 5");
    let err = AnyConsumer::connect(&url(""), &low, 4)
        .await
        .expect_err("5 is below the gate's default attempts");
    assert!(matches!(err, BrokerError::Config { .. }), "{err}");
}

/// A dead-letter queue that already exists and keeps messages 4 days (SQS's default) is
/// refused with a configuration error naming it, not silently used or changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_dead_letter_queue_keeping_less_than_14_days_is_a_config_error() {
    let name = common::fresh_name("short-dlq");
    let sqs = sdk().await;
    sqs.create_queue()
        .queue_name(format!("{name}-dead-letter"))
        .send()
        .await
        .expect("create a 4-day dead-letter queue");
    let err = AnyConsumer::connect(&broker().url, &name, 4)
        .await
        .expect_err("refused");
    assert!(matches!(err, BrokerError::Config { .. }), "{err}");
    assert!(err.to_string().contains("dead-letter"), "{err}");
    let dead = attributes(&sqs, &format!("{name}-dead-letter")).await;
    assert_eq!(
        dead.get(&QueueAttributeName::MessageRetentionPeriod)
            .map(String::as_str),
        Some("345600"),
        "left as it was"
    );
}

/// Every delivery of a fresh message is attempt 1 (`ApproximateReceiveCount`); nacked, it
/// comes back as attempt 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_come_from_the_receive_count() {
    let b = broker();
    let name = common::fresh_name("attempts");
    publish_raw(&b.url, &name, &[b"one".to_vec()])
        .await
        .expect("publish");
    let mut c = AnyConsumer::connect(&b.url, &name, 4)
        .await
        .expect("connect");
    let d = c.next().await.expect("a delivery").expect("ok");
    assert_eq!(d.attempt, Some(1));
    d.acker.nack(None).await.expect("nack");
    let again = c.next().await.expect("redelivered").expect("ok");
    assert_eq!(again.payload, b"one");
    assert_eq!(again.attempt, Some(2));
}

/// `--exit-when-idle` does not count a receive still outstanding as idleness: with
/// long polls of 6 s and an idle limit of 1 s, a message published 1.5 s in arrives
/// through the outstanding long poll (a plain idle timer would have ended the stream
/// at 1 s and left it), and the stream ends only after a receive came back empty.
///
/// The publisher connects before the clock starts and the poll leaves 4.5 s for the
/// publish to land, so a slow moto (CI runs hundreds of tests beside it) still sees it
/// inside the first poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_exit_never_ends_a_stream_while_a_receive_is_outstanding() {
    const WAIT: Duration = Duration::from_secs(6);
    let name = common::fresh_name("idle");
    let url = BrokerUrl::parse(&format!(
        "sqs://{}?visibility_timeout=10s&wait={}s",
        endpoint().trim_start_matches("http://"),
        WAIT.as_secs()
    ))
    .expect("url");
    let deliveries = AnyConsumer::connect(&url, &name, 4).await.expect("connect");
    let late = AnyPublisher::connect(&url, &name).await.expect("publisher");
    let t0 = std::time::Instant::now();
    let publisher = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        late.publish_raw(&[b"late".to_vec()])
            .await
            .expect("publish");
        std::time::Instant::now()
    });
    let mut s = until_idle(deliveries, Duration::from_secs(1));
    let first = s
        .next()
        .await
        .expect("the message published during the long poll")
        .expect("ok");
    assert_eq!(first.payload, b"late");
    drop(first);
    let published = publisher.await.expect("publisher");
    assert!(
        published.duration_since(t0) < WAIT,
        "the publish itself took longer than the poll: {:?}",
        published.duration_since(t0)
    );
    assert!(s.next().await.is_none(), "ends once idle");
    // The next long poll had to come back empty first.
    assert!(
        t0.elapsed() >= WAIT + Duration::from_millis(1_500),
        "{:?}",
        t0.elapsed()
    );
}

/// Messages lost by a dead process that come visible again after a first delivery still
/// come one at a time, even with long polls of 5 s: only a receive of one message waits
/// for messages (a first delivery opens the prefetch with receives that do not wait).
/// Before, the receives a first delivery opened long-polled until something came, and
/// took the lost messages together as they came visible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reruns_that_come_due_behind_a_first_delivery_come_one_at_a_time() {
    let url =
        BrokerUrl::parse(&format!("sqs://{}?visibility_timeout=2s&wait=5s", host())).expect("URL");
    common::within(common::reruns_that_come_due_behind_a_first_delivery_come_one_at_a_time(&url))
        .await;
}

/// Three killers in one window of ten, the redrive policy's `maxReceiveCount` twice the
/// gate's limit: no neighbour reaches it (the consumer receives one at a time while a
/// rerun is held), so none is moved to the dead-letter queue without a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_killers_in_one_window_strand_no_neighbour() {
    let url = BrokerUrl::parse(&format!(
        "sqs://{}?visibility_timeout=1s&wait=1s&max_receive_count=6",
        host()
    ))
    .expect("URL");
    common::within(common::killers_in_one_window_strand_no_neighbour(&url)).await;
}
