//! Each adapter built from a client the application made itself (`from_client`,
//! `from_connection`, `from_sdk_config`): one event published through the publisher,
//! received through the consumer and acked by the gate, on the real servers (RabbitMQ
//! `IDEM_TEST_AMQP_URL`, NATS `IDEM_TEST_NATS_URL`, Redis `IDEM_TEST_REDIS_URL`, SQS
//! `IDEM_TEST_SQS_ENDPOINT`: moto, started by `scripts/ensure-sqs`). A missing server fails
//! the test. Each test needs its adapter's feature; with none, the module is left out.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{Stream, StreamExt};
use idem_engine::outbox::EVENT_ID_HEADER;
use idem_engine::{Acker, Delivery, Gate, IdempotencyKey, OutboxEvent, OutcomeKind, Publisher};
use idem_testkit::{encode_submission, EffectHandlerFor, MemoryStore};

/// How long the consumer may take to yield the published event.
const RECEIVE_WITHIN: Duration = Duration::from_secs(30);

fn env_or(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// A name no earlier run used.
fn unique(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("idem-{prefix}-{}-{nanos:x}", std::process::id())
}

/// An outbox event whose payload is a submission the test handler accepts.
fn event(subject: &str) -> OutboxEvent {
    let payload = encode_submission(subject, "2026-07-01T09:00:00Z", 125);
    let key = IdempotencyKey::derive(subject, "2026-07-01T09:00:00Z", &payload).expect("key");
    OutboxEvent::new(key, "grant.recorded", subject, payload)
}

/// Publishes one event through `publisher`, receives it from `deliveries` (its payload
/// and event id intact) and lets the gate process it, which acks it through the
/// consumer's acker: the outcome is `Processed` with the ack confirmed.
async fn publish_receive_ack<P, S, A>(publisher: &P, deliveries: &mut S, subject: &str)
where
    P: Publisher,
    S: Stream<Item = Result<Delivery<A>, idem_broker::BrokerError>> + Unpin,
    A: Acker,
{
    let ev = event(subject);
    publisher
        .publish(std::slice::from_ref(&ev))
        .await
        .expect("publish");
    let delivery = tokio::time::timeout(RECEIVE_WITHIN, deliveries.next())
        .await
        .expect("a delivery within the time")
        .expect("the stream goes on")
        .expect("a delivery, not an error");
    assert_eq!(delivery.payload, ev.payload);
    let id = ev.event_id.to_string();
    assert!(
        delivery
            .headers
            .iter()
            .any(|(k, v)| k == EVENT_ID_HEADER && *v == id),
        "the event id travels with the message: {:?}",
        delivery.headers
    );
    let gate = Gate::new(MemoryStore::new(), EffectHandlerFor::<MemoryStore>::new());
    let outcome = gate.process(delivery).await;
    assert_eq!(outcome.kind(), OutcomeKind::Processed, "{outcome:?}");
    assert!(
        outcome.settle_error().is_none(),
        "the ack failed: {outcome:?}"
    );
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_from_a_client_of_the_application() {
    use idem_broker::nats::{pending_count, NatsConfig, NatsConsumer, NatsPublisher};

    let url = env_or("IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222");
    let name = unique("own-client");
    // One client, as the application connected it, shared by both sides.
    let client = async_nats::ConnectOptions::new()
        .name("idem-own-client-test")
        .connect(url.as_str())
        .await
        .expect("NATS at IDEM_TEST_NATS_URL");
    let config = NatsConfig::new("nats://unused.invalid", &name);
    let publisher = NatsPublisher::from_client(client.clone(), &config)
        .await
        .expect("publisher");
    let mut deliveries = NatsConsumer::from_client(client, &config)
        .await
        .expect("consumer");
    publish_receive_ack(&publisher, &mut deliveries, "nats-subject").await;
    assert_eq!(
        pending_count(&url, &name, &config.durable)
            .await
            .expect("count"),
        0,
        "nothing left unacked"
    );
}

#[cfg(feature = "rabbitmq")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_from_connections_of_the_application() {
    use idem_broker::rabbitmq::{pending_count, RabbitConfig, RabbitConsumer, RabbitPublisher};
    use lapin::{Connection, ConnectionProperties};

    let url = env_or(
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    );
    let name = unique("own-client");
    let open = || async {
        Connection::connect(
            &url,
            ConnectionProperties::default().with_connection_name("idem-own-client-test".into()),
        )
        .await
        .expect("RabbitMQ at IDEM_TEST_AMQP_URL")
    };
    let config = RabbitConfig::new("amqp://unused.invalid", &name);
    let publisher = RabbitPublisher::from_connection(open().await, &config)
        .await
        .expect("publisher");
    let mut deliveries = RabbitConsumer::from_connection(open().await, open().await, &config)
        .await
        .expect("consumer");
    publish_receive_ack(&publisher, &mut deliveries, "rabbitmq-subject").await;
    // Closed, an unacked delivery would go back to the queue: it is empty.
    deliveries.close().await.expect("close");
    assert_eq!(pending_count(&url, &name).await.expect("count"), 0);
}

#[cfg(feature = "redis-streams")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_from_a_client_of_the_application() {
    use fred::prelude::{Builder, ClientLike, Config, KeysInterface};
    use idem_broker::redis_streams::{
        pending_count, RedisStreamsConfig, RedisStreamsConsumer, RedisStreamsPublisher,
    };

    let url = env_or("IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379");
    let name = unique("own-client");
    let client = Builder::from_config(Config::from_url(&url).expect("IDEM_TEST_REDIS_URL"))
        .with_connection_config(|c| c.connection_timeout = Duration::from_secs(3))
        .build()
        .expect("client");
    client.init().await.expect("Redis at IDEM_TEST_REDIS_URL");
    let config = RedisStreamsConfig::new("redis://unused.invalid", &name);
    let publisher = RedisStreamsPublisher::from_client(client.clone(), &config)
        .await
        .expect("publisher");
    let mut deliveries = RedisStreamsConsumer::from_client(client.clone(), &config)
        .await
        .expect("consumer");
    publish_receive_ack(&publisher, &mut deliveries, "redis-subject").await;
    assert_eq!(
        pending_count(&url, &name, &config.group)
            .await
            .expect("count"),
        0,
        "nothing left unacked"
    );
    // The application's client is still its own, and still works.
    let _: i64 = client
        .del(vec![name.clone(), idem_broker::dead_letter_name(&name)])
        .await
        .expect("DEL");
}

#[cfg(feature = "sqs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_from_a_client_and_an_sdk_config_of_the_application() {
    use aws_config::BehaviorVersion;
    use aws_sdk_sqs::config::{Credentials, Region};
    use idem_broker::sqs::{pending_count, SqsConfig, SqsConsumer, SqsPublisher};

    let endpoint = env_or("IDEM_TEST_SQS_ENDPOINT", "http://127.0.0.1:5000");
    let name = unique("own-client");
    // The application's own AWS configuration (here: moto's endpoint, test credentials).
    let sdk = aws_config::defaults(BehaviorVersion::latest())
        .endpoint_url(&endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "test"))
        .load()
        .await;
    let client = aws_sdk_sqs::Client::new(&sdk);
    // The endpoint and region of the SqsConfig are not used: the client's are.
    let config = SqsConfig::new(None, &name)
        .with_wait(Duration::from_secs(1))
        .with_visibility_timeout(Duration::from_secs(5));
    let publisher = SqsPublisher::from_client(client, &config)
        .await
        .expect("publisher (moto at IDEM_TEST_SQS_ENDPOINT: scripts/ensure-sqs)");
    let mut deliveries = SqsConsumer::from_sdk_config(&sdk, &config)
        .await
        .expect("consumer");
    publish_receive_ack(&publisher, &mut deliveries, "sqs-subject").await;
    assert_eq!(
        pending_count(Some(&endpoint), &name).await.expect("count"),
        0,
        "nothing left undeleted"
    );
}
