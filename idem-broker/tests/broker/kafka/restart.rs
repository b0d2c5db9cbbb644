//! A broker of the test's own, restarted or gone for good under a running consumer.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_broker::kafka::KafkaConfig;

use super::next_within;
use crate::common;

/// A tansu broker of the test's own on a free local port, killed when dropped. It keeps
/// its data in an S3 bucket of its own on moto (`IDEM_TEST_SQS_ENDPOINT`, default
/// `http://127.0.0.1:5000`, which serves S3 too), so a restart keeps its topics, their
/// ids, records and committed offsets, as a Kafka broker does. (With tansu's `memory://`
/// storage a restarted broker starts empty and gives a recreated topic a new id; a
/// consumer's fetch under the old id then got an answer with an empty topic id, on which
/// librdkafka 2.12 crashes: `rd_kafka_metadata_update_op` compares a null topic name.)
struct OwnTansu {
    port: u16,
    bucket: String,
    child: Option<Child>,
}

impl OwnTansu {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let bucket = format!("idem-tansu-{port}-{:08x}", rand::random::<u32>());
        // Create the bucket (moto takes any credentials).
        let status = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT"])
            .arg(format!("{}/{bucket}", s3_endpoint()))
            .output()
            .expect("curl");
        assert_eq!(
            String::from_utf8_lossy(&status.stdout),
            "200",
            "create bucket {bucket} on moto (scripts/ensure-sqs)"
        );
        let mut t = Self {
            port,
            bucket,
            child: None,
        };
        t.restart();
        t
    }

    fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the broker (again) and waits until it accepts connections.
    fn restart(&mut self) {
        assert!(self.child.is_none(), "already running");
        let tansu = std::env::var("IDEM_TEST_TANSU").unwrap_or_else(|_| {
            let home = std::env::var("HOME").unwrap_or_default();
            let installed = Path::new(&home).join(".cargo/bin/tansu");
            if installed.is_file() {
                installed.display().to_string()
            } else {
                "tansu".to_owned()
            }
        });
        let listener = format!("tcp://127.0.0.1:{}", self.port);
        let child = Command::new(&tansu)
            .args(["broker", "--listener-url", &listener])
            .args(["--advertised-listener-url", &listener])
            .args(["--storage-engine", &format!("s3://{}/", self.bucket)])
            .env("AWS_ENDPOINT", s3_endpoint())
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_DEFAULT_REGION", "us-east-1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {tansu} (scripts/ensure-kafka installs it): {e}"));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "tansu did not listen on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills the broker (SIGKILL) and waits for it to be gone.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for OwnTansu {
    fn drop(&mut self) {
        self.kill();
    }
}

/// moto's endpoint, which serves S3 beside SQS.
fn s3_endpoint() -> String {
    std::env::var("IDEM_TEST_SQS_ENDPOINT")
        .unwrap_or_else(|_| "http://127.0.0.1:5000".to_owned())
        .trim_end_matches('/')
        .to_owned()
}

/// A tansu of the test's own with one message (`first`) in a new one-partition topic, and
/// a member (session timeout `session`) that has received it.
async fn own_member(
    prefix: &str,
    session: Duration,
    first: &[u8],
) -> (
    OwnTansu,
    KafkaConfig,
    idem_broker::kafka::KafkaConsumer,
    idem_engine::Delivery<idem_broker::kafka::KafkaAcker>,
) {
    use idem_broker::kafka::{KafkaConsumer, KafkaPublisher};
    let tansu = OwnTansu::start();
    let config = KafkaConfig::new(tansu.brokers(), common::fresh_name(prefix))
        .with_group(format!("idem-test-{:08x}", rand::random::<u32>()))
        .with_partitions(1)
        .with_session_timeout(session)
        .with_batch_messages(1);
    KafkaPublisher::connect_config(&config)
        .await
        .expect("publisher")
        .publish_raw(&[first.to_vec()])
        .await
        .expect("publish");
    let mut consumer = KafkaConsumer::connect(&config).await.expect("connect");
    let d = next_within(&mut consumer, Duration::from_secs(60))
        .await
        .expect("a delivery")
        .expect("the stream goes on")
        .expect("a delivery");
    assert_eq!(d.payload, first);
    (tansu, config, consumer, d)
}

/// The broker restarts under a running consumer: librdkafka reports the lost connection
/// and the brokers being down as errors from the poll, and recovers by itself. The stream
/// goes on through them (they are counted), and a message published after the restart
/// is delivered on the same stream. The broker keeps its data (in S3, see [`OwnTansu`]),
/// so the first message, settled before the restart, is not delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_does_not_end_the_stream() {
    use idem_broker::kafka::KafkaPublisher;
    use idem_engine::Acker as _;
    // A session longer than the restart takes: a cluster silent for the whole session
    // ends the stream (`a_cluster_gone_for_good_ends_the_stream`).
    let (mut tansu, config, mut consumer, d) =
        own_member("restart", Duration::from_secs(60), b"before").await;
    // Settled (dead-lettered: a settlement without a gate) and committed before the
    // restart.
    d.acker
        .dead_letter(
            b"before",
            &Vec::new(),
            &idem_engine::RejectReason::new("test", "settled before the restart"),
        )
        .await
        .expect("settle before the restart");

    tansu.kill();
    // librdkafka notices: errors from the poll, which must not end the stream.
    let deadline = Instant::now() + Duration::from_secs(60);
    while consumer.transient_errors() == 0 {
        assert!(
            Instant::now() < deadline,
            "no error reported for the broker going down"
        );
        if let Some(item) = next_within(&mut consumer, Duration::from_millis(200)).await {
            panic!("the stream yielded while the broker was down: {item:?}");
        }
    }
    let seen_down = consumer.transient_errors();

    tansu.restart();
    let publisher = KafkaPublisher::connect_config(&config)
        .await
        .expect("publisher after the restart");
    publisher
        .publish_raw(&[b"after".to_vec()])
        .await
        .expect("publish after");
    let item = next_within(&mut consumer, Duration::from_secs(120))
        .await
        .expect("a delivery after the restart within 120 s");
    let d = item
        .expect("the stream did not end")
        .expect("a delivery, not an error");
    assert_eq!(d.payload, b"after");
    eprintln!(
        "transient errors: {seen_down} while down, {} in all",
        consumer.transient_errors()
    );
}

/// A cluster that goes away for good after the member joined: librdkafka reconnects for
/// ever and reports only transient errors, so the stream went on and `idem consume` never
/// applied `--reconnect-timeout` (it still ran 90 s after its Kafka was killed). Once no
/// broker has answered for the session timeout (6 s here) the stream ends with a connect
/// error, which the supervisor's reconnect timeout then bounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_gone_for_good_ends_the_stream() {
    let (mut tansu, _, mut consumer, d) = own_member("gone", Duration::from_secs(6), b"one").await;
    drop(d);
    tansu.kill();
    let killed = Instant::now();
    let item = next_within(&mut consumer, Duration::from_secs(60))
        .await
        .expect("the stream ends within 60 s of the cluster going away")
        .expect("an error, then the end");
    let e = item.expect_err("an error, not a delivery");
    assert!(
        matches!(e, idem_broker::BrokerError::Connect { .. }),
        "{e:?}"
    );
    let took = killed.elapsed();
    assert!(
        took >= Duration::from_secs(5),
        "ended after {took:?}, before the session timeout"
    );
}
