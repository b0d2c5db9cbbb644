//! A zstd-compressed topic on a real protocol server (tansu; `IDEM_TEST_KAFKA_BROKERS`,
//! default `127.0.0.1:9092`, started by `scripts/ensure-kafka`): the adapter's publisher
//! with `compression.type=zstd` produces, and the adapter's consumer reads. tansu keeps a
//! produced record batch as it came (compressed) and serves it back as it is, so the
//! consumer decompresses what the producer compressed. A missing server fails the test.

use std::time::Duration;

use futures::StreamExt as _;
use idem_broker::any::BrokerUrl;
use idem_broker::kafka::{Compression, KafkaConfig, KafkaConsumer, KafkaPublisher};

fn brokers() -> String {
    std::env::var("IDEM_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_messages_round_trip_through_the_adapter() {
    let r = rand::random::<u32>();
    let topic = format!("idem-test-zstd-{r:08x}");
    // One message per record batch: tansu 0.6 cannot fetch from inside a batch.
    let url = format!(
        "kafka://{}?group=idem-test-{r:08x}&partitions=1&session_timeout=6s\
         &batch_messages=1&compression.type=zstd",
        brokers()
    );
    let zstd = KafkaConfig::from_url(
        &BrokerUrl::parse(&url).expect("IDEM_TEST_KAFKA_BROKERS"),
        &topic,
    )
    .expect("config");
    assert_eq!(zstd.compression, Some(Compression::Zstd));
    assert_eq!(zstd.producer_config().get("compression.type"), Some("zstd"));
    // Compressible and not: a quarter of a megabyte of one phrase, and short bodies.
    let big: Vec<u8> = b"idem reads zstd. "
        .iter()
        .cycle()
        .take(256 * 1024)
        .copied()
        .collect();
    let mut sent = vec![b"first".to_vec(), big, b"third".to_vec()];
    KafkaPublisher::connect_config(&zstd)
        .await
        .expect("zstd publisher")
        .publish_raw(&sent)
        .await
        .expect("publish zstd");
    // The same topic also holds a batch that is not compressed: both read.
    let plain = zstd.clone().with_compression(Compression::None);
    sent.push(b"uncompressed".to_vec());
    KafkaPublisher::connect_config(&plain)
        .await
        .expect("plain publisher")
        .publish_raw(&sent[3..])
        .await
        .expect("publish plain");

    let mut consumer = KafkaConsumer::connect(&zstd).await.expect("connect");
    let mut got = Vec::new();
    while got.len() < sent.len() {
        let d = tokio::time::timeout(Duration::from_secs(60), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("{} of {} within 60 s", got.len(), sent.len()))
            .expect("the stream goes on")
            .expect("a delivery, not an error");
        got.push(d.payload);
    }
    assert_eq!(got.len(), sent.len());
    for (i, (g, s)) in got.iter().zip(&sent).enumerate() {
        assert!(g == s, "message {i}: {} bytes, sent {}", g.len(), s.len());
    }
}
