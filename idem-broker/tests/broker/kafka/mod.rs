//! Kafka on a real protocol server (tansu; `IDEM_TEST_KAFKA_BROKERS`, default
//! `127.0.0.1:9092`, started by `scripts/ensure-kafka`) and the real Postgres store
//! (`IDEM_TEST_POSTGRES_URL`). A missing server fails the test. Also: the low-water-mark
//! tracker against a model, and two group members with one killed (`SIGKILL`) mid-run
//! (the `kafka_member` example in a child process; a full `cargo test` / `cargo nextest
//! run` builds it).

use crate::common;

mod attempts;
mod lwm;
mod members;
mod positions;
mod restart;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Broker;
use idem_broker::any::{AnyConsumer, BrokerUrl};
use idem_broker::kafka::KafkaConfig;
use idem_broker::until_idle;
use idem_engine::{consumer, ConsumerConfig, Gate};
use idem_grant::GrantDb;
use idem_store_postgres::PgStore;

fn brokers() -> String {
    std::env::var("IDEM_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

fn broker_in(group: &str) -> Broker {
    broker_with(group, 4)
}

/// The test URL of `group`.
fn url_in(group: &str, partitions: u32) -> String {
    format!(
        // One message per record batch: tansu 0.6 cannot fetch from inside a batch.
        "kafka://{}?group={group}&partitions={partitions}&session_timeout=6s&batch_messages=1",
        brokers()
    )
}

/// The test broker with its own consumer group, so concurrent tests do not rebalance
/// one another, and one partition (the crash scenario counts on the published order,
/// duplicates last).
fn broker() -> Broker {
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    broker_with(&group, 1)
}

common::conformance!(broker);

fn broker_with(group: &str, partitions: u32) -> Broker {
    let url = url_in(group, partitions);
    Broker {
        url: BrokerUrl::parse(&url).unwrap_or_else(|e| panic!("IDEM_TEST_KAFKA_BROKERS: {e}")),
        // A group member only gets its partitions after the (re)join.
        idle: Duration::from_secs(5),
        // The idempotent producer dedups retries of one producer session, not a
        // republished event.
        dedups_event_ids: false,
    }
}

/// The example binary `name` of idem-broker, which `cargo test` / `cargo nextest run`
/// build with the other targets: `target/<profile>/examples/<name>`, next to the
/// `deps` directory that holds this test binary.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let path = exe
        .parent()
        .and_then(Path::parent)
        .map(|profile| profile.join("examples").join(name))
        .expect("target/<profile>/deps/<test binary>");
    assert!(
        path.is_file(),
        "{} is missing: a full `cargo test`/`cargo nextest run` builds it; after a narrower \
         build (`--test broker`) run `cargo build -p idem-broker --features kafka --example {name}`",
        path.display()
    );
    path
}

/// A member of `group` (the `kafka_member` example) in a child process, writing into
/// `store`'s schema.
fn spawn_member(group: &str, name: &str, store: &PgStore, args: &[&str]) -> Child {
    Command::new(example("kafka_member"))
        .arg(url_in(group, 4))
        .args([name, store.schema()])
        .args(args)
        .env("IDEM_TEST_POSTGRES_URL", common::pg_url())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the kafka_member example")
}

/// Waits until `store` holds `n` disbursements, failing the test if the `child` member
/// ends first or it takes 180 s. (tansu, after the rest of the suite has filled it with
/// topics and groups, can take tens of seconds to serve a new group's first fetch: the
/// deadline is generous, and costs nothing when it is quick.)
async fn wait_for_disbursements(store: &PgStore, child: &mut Child, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(180);
    while common::effects(store).await.len() < n {
        assert!(
            Instant::now() < deadline,
            "the child member never got to {n}"
        );
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the child member ended: {status}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One in-process member of `url`'s group: `concurrency` deliveries at a time, each held
/// `delay` before the gate (in flight, unsettled), until idle for `idle`.
async fn member(
    url: BrokerUrl,
    name: String,
    store: PgStore,
    delay: Duration,
    idle: Duration,
) -> idem_engine::ConsumerStats {
    use futures::StreamExt as _;
    let deliveries = AnyConsumer::connect(&url, &name, 8)
        .await
        .expect("connect member");
    let slow = Box::pin(deliveries.then(move |d| async move {
        tokio::time::sleep(delay).await;
        d
    }));
    let gate = Gate::new(store.clone(), store.grant_handler());
    consumer::run(
        &gate,
        until_idle(slow, idle),
        ConsumerConfig::new(4, 1),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("member run")
}

/// The next item of `stream` within `within`; `None` when none came in time.
async fn next_within<S>(stream: &mut S, within: Duration) -> Option<Option<S::Item>>
where
    S: futures::Stream + Unpin,
{
    use futures::StreamExt as _;
    tokio::time::timeout(within, stream.next()).await.ok()
}

/// `topic` in a group of its own, one partition, a short session timeout.
fn one_partition(topic: &str) -> KafkaConfig {
    KafkaConfig::new(brokers(), topic)
        .with_group(format!("idem-test-{:08x}", rand::random::<u32>()))
        .with_partitions(1)
        .with_session_timeout(Duration::from_secs(6))
        .with_batch_messages(1)
}

/// Publishes `bodies` to `config`'s topic.
async fn publish_all(config: &KafkaConfig, bodies: &[Vec<u8>]) {
    idem_broker::kafka::KafkaPublisher::connect_config(config)
        .await
        .expect("publisher")
        .publish_raw(bodies)
        .await
        .expect("publish");
}
