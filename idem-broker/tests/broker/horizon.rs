//! Redelivery horizons read from the real brokers: SQS (moto, `IDEM_TEST_SQS_ENDPOINT`,
//! default `http://127.0.0.1:5000`), NATS JetStream (`IDEM_TEST_NATS_URL`), Redis Streams
//! (`IDEM_TEST_REDIS_URL`) and RabbitMQ (`IDEM_TEST_AMQP_URL`). Each source is set up
//! with the broker's own client and a retention of its own, then read back through
//! `idem_broker::horizon`. A missing service fails the test.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_broker::any::BrokerUrl;
use idem_broker::horizon::{redelivery_horizon, Retention};
use idem_broker::BrokerError;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn tag() -> String {
    format!("{}-{:08x}", std::process::id(), rand::random::<u32>())
}

const HOUR: Duration = Duration::from_secs(3600);

#[tokio::test]
async fn sqs_horizon_is_the_queue_message_retention_period() {
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    use aws_sdk_sqs::types::QueueAttributeName;
    let endpoint = env("IDEM_TEST_SQS_ENDPOINT", "http://127.0.0.1:5000");
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .http_client(idem_broker::sqs::http_client())
        .region(Region::new("us-east-1"))
        .endpoint_url(&endpoint)
        .credentials_provider(Credentials::new("t", "t", None, None, "test"))
        .build();
    let client = aws_sdk_sqs::Client::from_conf(config);
    let name = format!("horizon-{}", tag());
    client
        .create_queue()
        .queue_name(&name)
        .attributes(QueueAttributeName::MessageRetentionPeriod, "7200")
        .send()
        .await
        .expect("create the queue on moto (scripts/ensure-sqs)");
    let url = BrokerUrl::parse(&format!("sqs://{}", endpoint.trim_start_matches("http://")))
        .expect("url");
    let h = redelivery_horizon(&url, &name).await.expect("horizon");
    assert_eq!(h.retention, Retention::Limited(2 * HOUR), "{h}");
    assert_eq!(h.horizon(), Some(2 * HOUR));
    assert!(h.detail.contains("MessageRetentionPeriod"), "{h}");

    // A change of the queue's retention is what the next read says.
    let queue_url = client
        .get_queue_url()
        .queue_name(&name)
        .send()
        .await
        .expect("queue url")
        .queue_url
        .expect("url");
    client
        .set_queue_attributes()
        .queue_url(&queue_url)
        .attributes(QueueAttributeName::MessageRetentionPeriod, "1209600")
        .send()
        .await
        .expect("set retention");
    let h = redelivery_horizon(&url, &name).await.expect("horizon");
    assert_eq!(h.horizon(), Some(Duration::from_secs(1_209_600)), "{h}");

    // A missing queue is an error, not a horizon of zero (and is not created).
    let missing = format!("horizon-missing-{}", tag());
    let e = redelivery_horizon(&url, &missing).await.unwrap_err();
    assert!(matches!(e, BrokerError::InvalidName { .. }), "{e}");
    assert!(client
        .get_queue_url()
        .queue_name(&missing)
        .send()
        .await
        .is_err());
}

/// The horizon of a queue in another region is read in the URL's `region=` (moto keeps
/// each region's queues apart): before, the horizon's client ignored it and found no queue.
#[tokio::test]
async fn sqs_horizon_reads_the_queue_in_the_url_s_region() {
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    use aws_sdk_sqs::types::QueueAttributeName;
    let endpoint = env("IDEM_TEST_SQS_ENDPOINT", "http://127.0.0.1:5000");
    let client = aws_sdk_sqs::Client::from_conf(
        aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .http_client(idem_broker::sqs::http_client())
            .region(Region::new("eu-west-3"))
            .endpoint_url(&endpoint)
            .credentials_provider(Credentials::new("t", "t", None, None, "test"))
            .build(),
    );
    let name = format!("horizon-region-{}", tag());
    client
        .create_queue()
        .queue_name(&name)
        .attributes(QueueAttributeName::MessageRetentionPeriod, "3600")
        .send()
        .await
        .expect("create the queue on moto (scripts/ensure-sqs)");
    let host = endpoint.trim_start_matches("http://");
    let url = BrokerUrl::parse(&format!("sqs://{host}?region=eu-west-3")).expect("url");
    let h = redelivery_horizon(&url, &name).await.expect("horizon");
    assert_eq!(h.horizon(), Some(HOUR), "{h}");
    // Another region holds no such queue.
    let other = BrokerUrl::parse(&format!("sqs://{host}?region=ap-south-1")).expect("url");
    let e = redelivery_horizon(&other, &name).await.unwrap_err();
    assert!(matches!(e, BrokerError::InvalidName { .. }), "{e}");
}

#[tokio::test]
async fn nats_horizon_is_max_age_or_the_oldest_message() {
    use async_nats::jetstream::stream;
    let nats = env("IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222");
    let js = async_nats::jetstream::new(async_nats::connect(&nats).await.expect("NATS"));
    let url = BrokerUrl::parse(&nats).expect("url");

    let limited = format!("horizon-max-age-{}", tag());
    js.create_stream(stream::Config {
        name: limited.clone(),
        subjects: vec![limited.clone()],
        max_age: 3 * HOUR,
        ..Default::default()
    })
    .await
    .expect("create stream");
    let h = redelivery_horizon(&url, &limited).await.expect("horizon");
    assert_eq!(h.retention, Retention::Limited(3 * HOUR), "{h}");

    // No max_age: kept until removed; the oldest message bounds it, an empty stream is 0.
    let kept = format!("horizon-kept-{}", tag());
    js.create_stream(stream::Config {
        name: kept.clone(),
        subjects: vec![kept.clone()],
        ..Default::default()
    })
    .await
    .expect("create stream");
    let h = redelivery_horizon(&url, &kept).await.expect("horizon");
    assert_eq!(h.retention, Retention::UntilRemoved { oldest: None }, "{h}");
    assert_eq!(h.horizon(), Some(Duration::ZERO));
    js.publish(kept.clone(), "x".into())
        .await
        .expect("publish")
        .await
        .expect("ack");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let h = redelivery_horizon(&url, &kept).await.expect("horizon");
    let age = h.horizon().expect("bounded");
    assert!(
        age >= Duration::from_secs(1) && age < Duration::from_secs(120),
        "{h}"
    );
    assert!(h.detail.contains("no max_age"), "{h}");

    let e = redelivery_horizon(&url, &format!("horizon-missing-{}", tag()))
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::InvalidName { .. }), "{e}");
    for s in [limited, kept] {
        let _ = js.delete_stream(s).await;
    }
}

#[tokio::test]
async fn redis_stream_horizon_is_the_age_of_its_oldest_entry() {
    use fred::prelude::*;
    let redis = env("IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379");
    let client = Builder::from_config(Config::from_url(&redis).expect("url"))
        .build()
        .expect("client");
    client.init().await.expect("Redis");
    let key = format!("idem-horizon-{}", tag());
    // An entry stored two hours ago (an explicit id: its milliseconds are its time).
    let two_hours_ago = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis()
        - 2 * 3600 * 1000;
    let _: String = client
        .xadd(
            &key,
            false,
            None,
            format!("{two_hours_ago}-0"),
            ("payload", "x"),
        )
        .await
        .expect("XADD");
    let _: String = client
        .xadd(&key, false, None, "*", ("payload", "y"))
        .await
        .expect("XADD");
    let url = BrokerUrl::parse(&redis).expect("url");
    let h = redelivery_horizon(&url, &key).await.expect("horizon");
    let age = h.horizon().expect("bounded");
    assert!(
        age >= 2 * HOUR && age < 2 * HOUR + Duration::from_secs(60),
        "{h}"
    );
    assert!(h.detail.contains("unbounded unless trimmed"), "{h}");
    // Trimming the old entry shortens the horizon.
    let _: u64 = client.xtrim(&key, ("MAXLEN", "=", 1)).await.expect("XTRIM");
    let h = redelivery_horizon(&url, &key).await.expect("horizon");
    assert!(
        h.horizon().expect("bounded") < Duration::from_secs(60),
        "{h}"
    );

    let e = redelivery_horizon(&url, &format!("idem-horizon-missing-{}", tag()))
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::InvalidName { .. }), "{e}");
    let _: u64 = client.del(&key).await.expect("DEL");
}

#[tokio::test]
async fn rabbitmq_horizon_is_unknown_and_a_missing_queue_is_an_error() {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    let amqp = env(
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    );
    let conn = lapin::Connection::connect(&amqp, lapin::ConnectionProperties::default())
        .await
        .expect("RabbitMQ");
    let ch = conn.create_channel().await.expect("channel");
    let name = format!("idem-horizon-{}", tag());
    ch.queue_declare(
        name.as_str().into(),
        QueueDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("declare");
    let url = BrokerUrl::parse(&amqp).expect("url");
    let h = redelivery_horizon(&url, &name).await.expect("horizon");
    assert_eq!(h.retention, Retention::Unknown, "{h}");
    assert_eq!(h.horizon(), None);
    let e = redelivery_horizon(&url, &format!("idem-horizon-missing-{}", tag()))
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::InvalidName { .. }), "{e}");
    let _ = conn.close(200, "done".into()).await;
}

/// Creates Kafka topic `name` with `configs` on the test broker (tansu,
/// `IDEM_TEST_KAFKA_BROKERS`, default `127.0.0.1:9092`).
#[cfg(feature = "kafka")]
async fn kafka_topic(brokers: &str, name: &str, configs: &[(&str, &str)]) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let mut topic = NewTopic::new(name, 1, TopicReplication::Fixed(1));
    for (k, v) in configs {
        topic = topic.set(k, v);
    }
    for r in admin
        .create_topics([&topic], &AdminOptions::new())
        .await
        .expect("CreateTopics on the test broker (scripts/ensure-kafka)")
    {
        r.unwrap_or_else(|(t, e)| panic!("create {t}: {e}"));
    }
}

/// Kafka: `retention.ms + segment.ms` (a segment is deleted once its newest record is
/// past retention.ms, and takes records for up to segment.ms); a compacted topic keeps
/// records for ever, so its horizon is unknown; the dead-letter topic counts when it
/// keeps longer; a topic without the settings (tansu reports only those set on the
/// topic) is unknown; a missing topic is an error.
#[cfg(feature = "kafka")]
#[tokio::test]
async fn kafka_horizon_is_retention_plus_segment_and_compaction_is_unknown() {
    let brokers = env("IDEM_TEST_KAFKA_BROKERS", "127.0.0.1:9092");
    let url = BrokerUrl::parse(&format!("kafka://{brokers}")).expect("url");
    let hour = "3600000";
    let ten_minutes = "600000";
    let minutes = |m: u64| Duration::from_secs(60 * m);

    let plain = format!("horizon-{}", tag());
    kafka_topic(
        &brokers,
        &plain,
        &[("retention.ms", hour), ("segment.ms", ten_minutes)],
    )
    .await;
    let h = redelivery_horizon(&url, &plain).await.expect("horizon");
    assert_eq!(h.retention, Retention::Limited(minutes(70)), "{h}");
    assert!(h.detail.contains("segment.ms"), "{h}");

    let compacted = format!("horizon-compacted-{}", tag());
    kafka_topic(
        &brokers,
        &compacted,
        &[
            ("cleanup.policy", "compact,delete"),
            ("retention.ms", hour),
            ("segment.ms", ten_minutes),
        ],
    )
    .await;
    let h = redelivery_horizon(&url, &compacted).await.expect("horizon");
    assert_eq!(h.retention, Retention::Unknown, "{h}");
    assert_eq!(h.horizon(), None);
    assert!(h.detail.contains("compact"), "{h}");

    // Dead letters kept five hours: they bound the source's horizon.
    let with_dead_letters = format!("horizon-dl-{}", tag());
    kafka_topic(
        &brokers,
        &with_dead_letters,
        &[("retention.ms", hour), ("segment.ms", ten_minutes)],
    )
    .await;
    kafka_topic(
        &brokers,
        &format!("{with_dead_letters}.dead-letter"),
        &[("retention.ms", "18000000"), ("segment.ms", ten_minutes)],
    )
    .await;
    let h = redelivery_horizon(&url, &with_dead_letters)
        .await
        .expect("horizon");
    assert_eq!(h.retention, Retention::Limited(minutes(310)), "{h}");
    assert!(h.detail.contains("dead letters keep longer"), "{h}");
    // A compacted dead-letter topic makes the source's horizon unknown.
    let compacted_dl = format!("horizon-dl-compacted-{}", tag());
    kafka_topic(
        &brokers,
        &compacted_dl,
        &[("retention.ms", hour), ("segment.ms", ten_minutes)],
    )
    .await;
    kafka_topic(
        &brokers,
        &format!("{compacted_dl}.dead-letter"),
        &[("cleanup.policy", "compact")],
    )
    .await;
    let h = redelivery_horizon(&url, &compacted_dl)
        .await
        .expect("horizon");
    assert_eq!(h.retention, Retention::Unknown, "{h}");

    // No retention settings on the topic: tansu reports none, nothing bounds it.
    let bare = format!("horizon-bare-{}", tag());
    kafka_topic(&brokers, &bare, &[]).await;
    let h = redelivery_horizon(&url, &bare).await.expect("horizon");
    assert_eq!(h.retention, Retention::Unknown, "{h}");

    let e = redelivery_horizon(&url, &format!("horizon-missing-{}", tag()))
        .await
        .unwrap_err();
    assert!(matches!(e, BrokerError::InvalidName { .. }), "{e}");
}

/// The dead-letter place is part of a source's horizon on SQS, NATS and Redis too: the
/// longer of the two.
#[tokio::test]
async fn dead_letters_that_keep_longer_bound_the_horizon() {
    use async_nats::jetstream::stream;
    use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
    use aws_sdk_sqs::types::QueueAttributeName;

    // SQS: the source keeps 2 h, its dead-letter queue 5 h.
    let endpoint = env("IDEM_TEST_SQS_ENDPOINT", "http://127.0.0.1:5000");
    let client = aws_sdk_sqs::Client::from_conf(
        aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .http_client(idem_broker::sqs::http_client())
            .region(Region::new("us-east-1"))
            .endpoint_url(&endpoint)
            .credentials_provider(Credentials::new("t", "t", None, None, "test"))
            .build(),
    );
    let name = format!("horizon-dl-{}", tag());
    for (queue, secs) in [
        (name.clone(), "7200"),
        (format!("{name}-dead-letter"), "18000"),
    ] {
        client
            .create_queue()
            .queue_name(&queue)
            .attributes(QueueAttributeName::MessageRetentionPeriod, secs)
            .send()
            .await
            .expect("create the queue on moto (scripts/ensure-sqs)");
    }
    let url = BrokerUrl::parse(&format!("sqs://{}", endpoint.trim_start_matches("http://")))
        .expect("url");
    let h = redelivery_horizon(&url, &name).await.expect("horizon");
    assert_eq!(h.retention, Retention::Limited(5 * HOUR), "{h}");
    assert!(h.detail.contains("dead letters keep longer"), "{h}");
    // The dead-letter queue read as a source: its own retention only.
    let h = redelivery_horizon(&url, &format!("{name}.dead-letter"))
        .await
        .expect("horizon");
    assert_eq!(h.retention, Retention::Limited(5 * HOUR), "{h}");

    // NATS: the source keeps 3 h, the dead-letter stream 6 h.
    let nats = env("IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222");
    let js = async_nats::jetstream::new(async_nats::connect(&nats).await.expect("NATS"));
    let source = format!("horizon-dl-{}", tag());
    let dead_letter = format!("{source}.dead-letter");
    for (subject, max_age) in [(&source, 3 * HOUR), (&dead_letter, 6 * HOUR)] {
        js.create_stream(stream::Config {
            name: idem_broker::nats::stream_name(subject),
            subjects: vec![subject.clone()],
            max_age,
            ..Default::default()
        })
        .await
        .expect("create stream");
    }
    let nats_url = BrokerUrl::parse(&nats).expect("url");
    let h = redelivery_horizon(&nats_url, &source)
        .await
        .expect("horizon");
    assert_eq!(h.retention, Retention::Limited(6 * HOUR), "{h}");
    for s in [&source, &dead_letter] {
        let _ = js.delete_stream(idem_broker::nats::stream_name(s)).await;
    }

    // Redis: a dead letter two hours old outlives the source's fresh entry.
    use fred::prelude::*;
    let redis = env("IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379");
    let client = Builder::from_config(Config::from_url(&redis).expect("url"))
        .build()
        .expect("client");
    client.init().await.expect("Redis");
    let key = format!("idem-horizon-dl-{}", tag());
    let dl_key = format!("{key}.dead-letter");
    let two_hours_ago = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis()
        - 2 * 3600 * 1000;
    let _: String = client
        .xadd(&key, false, None, "*", ("payload", "y"))
        .await
        .expect("XADD");
    let _: String = client
        .xadd(
            &dl_key,
            false,
            None,
            format!("{two_hours_ago}-0"),
            ("payload", "x"),
        )
        .await
        .expect("XADD");
    let redis_url = BrokerUrl::parse(&redis).expect("url");
    let h = redelivery_horizon(&redis_url, &key).await.expect("horizon");
    let age = h.horizon().expect("bounded");
    assert!(
        age >= 2 * HOUR && age < 2 * HOUR + Duration::from_secs(60),
        "{h}"
    );
    let _: u64 = client.del(vec![key, dl_key]).await.expect("DEL");
}
