//! Kafka on a real protocol server (tansu; `IDEM_TEST_KAFKA_BROKERS`, default
//! `127.0.0.1:9092`, started by `scripts/ensure-kafka`) and the real Postgres store
//! (`IDEM_TEST_POSTGRES_URL`). A missing server fails the test. Also: the low-water-mark
//! tracker against a model, and two group members with one killed (`SIGKILL`) mid-run
//! (the `kafka_member` example in a child process; a full `cargo test` / `cargo nextest
//! run` builds it).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Broker;
use idem_broker::any::{publish_raw, AnyConsumer, BrokerUrl};
use idem_broker::kafka::{KafkaConfig, LowWaterMark};
use idem_broker::until_idle;
use idem_core::{consumer, ConsumerConfig, Gate};
use idem_grant::GrantDb;
use idem_store_postgres::PgStore;
use proptest::prelude::*;

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

/// One step of a schedule: deliver the next offset, or settle one in flight.
#[derive(Debug, Clone)]
enum Step {
    Deliver,
    Settle(usize),
}

fn steps() -> impl Strategy<Value = (Vec<i64>, Vec<Step>)> {
    // Offsets with gaps (compacted or marker offsets), starting anywhere.
    (0i64..1_000, prop::collection::vec(1i64..4, 1..60)).prop_flat_map(|(start, gaps)| {
        let offsets: Vec<i64> = gaps
            .iter()
            .scan(start, |o, g| {
                *o += g;
                Some(*o)
            })
            .collect();
        let n = offsets.len();
        let schedule = prop::collection::vec(
            prop_oneof![Just(Step::Deliver), (0..n).prop_map(Step::Settle)],
            0..(4 * n),
        );
        (Just(offsets), schedule)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any delivery/settlement order: the mark (and every commit taken) is never past an
    /// unsettled offset, never goes back, and reaches one past the last offset once all
    /// settled.
    #[test]
    fn low_water_mark_matches_the_model((offsets, schedule) in steps()) {
        let mut lwm = LowWaterMark::new();
        // The model: each delivered offset and whether it settled.
        let mut delivered: Vec<(i64, bool)> = Vec::new();
        let mut last_commit: Option<i64> = None;
        let check = |lwm: &mut LowWaterMark, delivered: &[(i64, bool)], last: &mut Option<i64>| -> Result<(), TestCaseError> {
            let expected = delivered
                .iter()
                .find(|(_, s)| !s)
                .map(|(o, _)| *o)
                .or_else(|| delivered.last().map(|(o, _)| o + 1));
            prop_assert_eq!(lwm.mark(), expected);
            if let Some(c) = lwm.take_commit() {
                prop_assert_eq!(Some(c), expected);
                prop_assert!(last.is_none_or(|l| c > l), "commit went back: {:?} then {}", last, c);
                for (o, settled) in delivered {
                    prop_assert!(*settled || *o >= c, "commit {} passes unsettled {}", c, o);
                }
                *last = Some(c);
            }
            Ok(())
        };
        let settle = |lwm: &mut LowWaterMark, delivered: &mut Vec<(i64, bool)>, i: usize| {
            let open: Vec<usize> = (0..delivered.len()).filter(|&j| !delivered[j].1).collect();
            if !open.is_empty() {
                let j = open[i % open.len()];
                assert!(lwm.settle(delivered[j].0));
                delivered[j].1 = true;
            }
        };
        for step in schedule {
            match step {
                Step::Deliver if delivered.len() < offsets.len() => {
                    let o = offsets[delivered.len()];
                    prop_assert!(lwm.register(o));
                    delivered.push((o, false));
                }
                Step::Deliver => {}
                Step::Settle(i) => settle(&mut lwm, &mut delivered, i),
            }
            check(&mut lwm, &delivered, &mut last_commit)?;
        }
        // Then everything is delivered and settled, in whatever order remains.
        while delivered.len() < offsets.len() {
            let o = offsets[delivered.len()];
            prop_assert!(lwm.register(o));
            delivered.push((o, false));
            check(&mut lwm, &delivered, &mut last_commit)?;
        }
        let mut k = offsets.len();
        while delivered.iter().any(|(_, s)| !s) {
            k = k.wrapping_mul(31).wrapping_add(7);
            settle(&mut lwm, &mut delivered, k);
            check(&mut lwm, &delivered, &mut last_commit)?;
        }
        let end = offsets.last().map(|o| o + 1);
        prop_assert_eq!(lwm.mark(), end);
        prop_assert_eq!(lwm.committed(), end);
        prop_assert_eq!(lwm.in_flight(), 0);
        // A delivery that goes back is refused.
        prop_assert!(!lwm.register(offsets[0]));
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
         build (`--test kafka`) run `cargo build -p idem-broker --features kafka --example {name}`",
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

/// Two members of one group share a topic's partitions; one (a child process) is killed
/// with SIGKILL in the middle of its work: messages processed and committed to Postgres
/// but not to the group, others received and not processed. The survivor consumes until
/// it has been idle longer than the session timeout plus a rebalance, then leaves; a
/// replacement member joins the group and consumes until idle. End: exactly one
/// disbursement per submission, and nothing left uncommitted in the group.
///
/// On Kafka the survivor takes the dead member's partitions once its session times out
/// and the replacement finds nothing left. tansu 0.6 never gives them to the survivor
/// (seen with `IDEM_KAFKA_DEBUG=cgrp`): the survivor's heartbeat that finds the dead
/// member's session expired removes it and answers REBALANCE_IN_PROGRESS, but the group
/// stays "formed" with its generation and stored assignments, so the survivor's rejoin
/// gets the same generation, the dead member still named leader, and from SyncGroup its
/// old partitions (a formed group's SyncGroup returns the stored assignment). Only a join
/// or leave that changes the membership forms the group again; here the survivor leaves
/// when idle and, if it could not finish, the replacement joins, owns every partition
/// and resumes from the committed offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_members_one_killed_mid_run_exactly_once() {
    const N: usize = 400;
    const D: usize = 100;
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let broker = Broker {
        // Longer than the session timeout (6 s) plus a rebalance.
        idle: Duration::from_secs(12),
        ..broker_in(&group)
    };
    let name = common::fresh_name("killed");
    let store = common::fresh_pg().await;
    let (distinct, ledger) = common::submissions(&name, N);
    let mut bodies = distinct.clone();
    bodies.extend_from_slice(&distinct[..D]);
    publish_raw(&broker.url, &name, &bodies)
        .await
        .expect("publish");

    let mut child = spawn_member(&group, &name, &store, &["--delay-ms", "15"]);
    let count = |store: PgStore| async move { common::effects(&store).await.len() };
    // The child has joined and works.
    wait_for_disbursements(&store, &mut child, 10).await;
    // Kill it once the group has done a good part, while it is still busy.
    let killer_store = store.clone();
    let killer = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(180);
        while count(killer_store.clone()).await < 150 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        child.kill().expect("SIGKILL the child member");
        let _ = child.wait();
        count(killer_store).await
    });
    let survivor = common::consume_all(&broker, &name, &store, 1, 1).await;
    let at_kill = killer.await.expect("killer");
    assert!(
        at_kill < N,
        "the child was killed mid-run ({at_kill} of {N} done at the kill)"
    );
    assert_eq!((survivor.rejected, survivor.failed), (0, 0), "{survivor:?}");
    let after_survivor = count(store.clone()).await;
    eprintln!(
        "killed at {at_kill} disbursements; {after_survivor} of {N} when the survivor went idle"
    );

    // Where the survivor could not finish (tansu left the dead member's partitions
    // assigned to it), a replacement joins the same group and resumes from its committed
    // offsets. Where the survivor finished, tansu's group may stay formed around the dead
    // member for minutes and refuse a newcomer any partition: nothing is left for one.
    if after_survivor < N {
        let replacement = spawn_member(&group, &name, &store, &["--exit-when-idle", "15"])
            .wait_with_output()
            .expect("the replacement member");
        assert!(replacement.status.success(), "replacement: {replacement:?}");
    }
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert_eq!(
        common::wait_pending(&broker.url, &name, 0).await,
        0,
        "nothing left to settle"
    );
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
) -> idem_core::ConsumerStats {
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

/// Samples the group's committed offsets of `topic` until `stop`; returns every
/// backward move seen (partition, before, after) and the number of samples.
async fn watch_commits(
    group: String,
    topic: String,
    stop: Arc<AtomicBool>,
) -> (Vec<(i32, i64, i64)>, usize) {
    tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let c: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("watcher");
        let mut last: HashMap<i32, i64> = HashMap::new();
        let mut back = Vec::new();
        let mut samples = 0;
        while !stop.load(Ordering::SeqCst) {
            let mut tpl = rdkafka::TopicPartitionList::new();
            for p in 0..4 {
                tpl.add_partition(&topic, p);
            }
            if let Ok(got) = c.committed_offsets(tpl, Duration::from_secs(5)) {
                samples += 1;
                for e in got.elements_for_topic(&topic) {
                    if let rdkafka::Offset::Offset(o) = e.offset() {
                        let prev = last.insert(e.partition(), o);
                        if let Some(p) = prev.filter(|p| o < *p) {
                            back.push((e.partition(), p, o));
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        (back, samples)
    })
    .await
    .expect("watcher thread")
}

/// A rebalance with deliveries in flight: member A works through a 4-partition topic,
/// four deliveries at a time, each held 20 ms; once it has done a good part, member B
/// joins the group, the partitions are split between them (A's in-flight deliveries on
/// the partitions that move are dropped and B receives them again), both run until idle.
/// Meanwhile a watcher samples the group's committed offsets every 50 ms. End: B took
/// part, each submission has exactly one effect (nothing doubled, nothing lost), nothing
/// is left uncommitted, and no committed offset ever moved back (a mark A took before
/// the revoke and committed after it would move it back below B's).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_joining_mid_run_takes_partitions_with_deliveries_in_flight() {
    const N: usize = 400;
    const D: usize = 50;
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let url = BrokerUrl::parse(&format!(
        "{}&assignment={}",
        url_in(&group, 4),
        assignment()
    ))
    .expect("url");
    let name = common::fresh_name("rebalance");
    let store = common::fresh_pg().await;
    let (distinct, ledger) = common::submissions(&name, N);
    let mut bodies = distinct.clone();
    bodies.extend_from_slice(&distinct[..D]);
    publish_raw(&url, &name, &bodies).await.expect("publish");

    let stop = Arc::new(AtomicBool::new(false));
    let watcher = tokio::spawn(watch_commits(
        group.clone(),
        name.clone(),
        Arc::clone(&stop),
    ));
    let idle = Duration::from_secs(12);
    let a = tokio::spawn(member(
        url.clone(),
        name.clone(),
        store.clone(),
        Duration::from_millis(20),
        idle,
    ));
    let deadline = Instant::now() + Duration::from_secs(60);
    while common::effects(&store).await.len() < N / 4 {
        assert!(Instant::now() < deadline, "member A processed too little");
        assert!(!a.is_finished(), "member A ended early");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let at_join = common::effects(&store).await.len();
    let b = tokio::spawn(member(
        url.clone(),
        name.clone(),
        store.clone(),
        Duration::from_millis(20),
        idle,
    ));
    let (a, b) = (a.await.expect("A"), b.await.expect("B"));
    stop.store(true, Ordering::SeqCst);
    let (back, samples) = watcher.await.expect("watcher");
    eprintln!("B joined at {at_join} of {N}; A {a:?}; B {b:?}; {samples} commit samples");
    assert!(at_join < N, "B joined mid-run");
    assert!(b.processed > 0, "B took partitions and processed: {b:?}");
    assert_eq!(a.processed + b.processed, N as u64, "A {a:?} B {b:?}");
    assert_eq!((a.rejected + b.rejected, a.failed + b.failed), (0, 0));
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert!(samples > 10, "the watcher sampled the commits ({samples})");
    assert!(back.is_empty(), "committed offsets moved back: {back:?}");
    assert_eq!(
        common::wait_pending(&url, &name, 0).await,
        0,
        "nothing left uncommitted"
    );
}

/// The rebalance strategy under test: `IDEM_TEST_KAFKA_ASSIGNMENT`, default
/// `cooperative-sticky`.
fn assignment() -> String {
    std::env::var("IDEM_TEST_KAFKA_ASSIGNMENT").unwrap_or_else(|_| "cooperative-sticky".to_owned())
}

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

/// The next item of `stream` within `within`; `None` when none came in time.
async fn next_within<S>(stream: &mut S, within: Duration) -> Option<Option<S::Item>>
where
    S: futures::Stream + Unpin,
{
    use futures::StreamExt as _;
    tokio::time::timeout(within, stream.next()).await.ok()
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
    idem_core::Delivery<idem_broker::kafka::KafkaAcker>,
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
    use idem_core::Acker as _;
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
            &idem_core::RejectReason::new("test", "settled before the restart"),
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

/// `topic` in a group of its own, one partition, a short session timeout.
fn one_partition(topic: &str) -> KafkaConfig {
    KafkaConfig::new(brokers(), topic)
        .with_group(format!("idem-test-{:08x}", rand::random::<u32>()))
        .with_partitions(1)
        .with_session_timeout(Duration::from_secs(6))
        .with_batch_messages(1)
}

/// A member that dies holding a delivery (dropped without settling it, as a crash
/// leaves it) N times: each new member of the group sees the count one higher, read from
/// `NAME.attempts`, where it was written before the delivery was handed out. A deferral
/// hands it back without raising the count; a nack raises it, and that count too
/// survives the member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_whose_member_dies_counts_on_in_the_next_member() {
    use idem_broker::kafka::{KafkaConsumer, KafkaPublisher};
    use idem_core::Acker as _;
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

/// Publishes `bodies` to `config`'s topic.
async fn publish_all(config: &KafkaConfig, bodies: &[Vec<u8>]) {
    idem_broker::kafka::KafkaPublisher::connect_config(config)
        .await
        .expect("publisher")
        .publish_raw(bodies)
        .await
        .expect("publish");
}

/// The next `n` deliveries of `consumer`, each within `within`.
async fn take_n(
    consumer: &mut idem_broker::kafka::KafkaConsumer,
    n: usize,
    within: Duration,
) -> Vec<idem_core::Delivery<idem_broker::kafka::KafkaAcker>> {
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
    use idem_core::Acker as _;
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

/// The test URL of `group` with the positions kept in the store (`?positions=store`).
fn positions_url(group: &str, partitions: u32) -> BrokerUrl {
    BrokerUrl::parse(&format!("{}&positions=store", url_in(group, partitions))).expect("URL")
}

/// Consumes `name` in `url`'s group into `store` until idle for `idle`, the positions
/// kept in `store` where the URL asks; `concurrency` batches of up to `batch`.
async fn consume_positioned(
    url: &BrokerUrl,
    name: &str,
    store: &PgStore,
    (concurrency, batch): (usize, usize),
    idle: Duration,
) -> idem_core::ConsumerStats {
    let positions: Arc<dyn idem_core::PositionStore> = Arc::new(store.clone());
    let deliveries = AnyConsumer::connect_with(url, name, 2 * concurrency * batch, Some(positions))
        .await
        .expect("connect consumer");
    let gate = Gate::new(store.clone(), store.grant_handler());
    consumer::run(
        &gate,
        until_idle(deliveries, idle),
        ConsumerConfig::new(concurrency, batch),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("consumer run")
}

/// A member (child process, batches of 10, four at once) is killed with SIGKILL mid-run;
/// a new member of the group then consumes the rest. Returns the disbursements made
/// when it was killed and the new member's stats. Exactly once either way.
async fn killed_and_succeeded(positions: bool) -> (usize, idem_core::ConsumerStats) {
    const N: usize = 400;
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let name = common::fresh_name(if positions { "pos-kill" } else { "lwm-kill" });
    let store = common::fresh_pg().await;
    let (bodies, ledger) = common::submissions(&name, N);
    let url = if positions {
        positions_url(&group, 4)
    } else {
        BrokerUrl::parse(&url_in(&group, 4)).expect("URL")
    };
    publish_raw(&url, &name, &bodies).await.expect("publish");
    let flag = if positions { "1" } else { "0" };
    let args = [
        "--delay-ms",
        "2",
        "--batch",
        "10",
        "--concurrency",
        "4",
        "--positions",
        flag,
    ];
    let mut child = spawn_member(&group, &name, &store, &args);
    wait_for_disbursements(&store, &mut child, 150).await;
    child.kill().expect("SIGKILL the child member");
    let _ = child.wait();
    let at_kill = common::effects(&store).await.len();
    assert!(at_kill < N, "killed mid-run ({at_kill} of {N})");
    let stats = consume_positioned(&url, &name, &store, (4, 10), Duration::from_secs(12)).await;
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert_eq!((stats.rejected, stats.failed), (0, 0), "{stats:?}");
    (at_kill, stats)
}

/// With positions stored, a member killed mid-batch leaves nothing for its successor to
/// read again: every transaction it committed moved the partition's stored position in
/// the same commit, and the successor starts there (skipping what finished out of
/// order), so the gate meets no duplicate. With broker commits only, the successor
/// re-reads from the last offset committed to the group (printed for comparison).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_positions_stored_a_killed_members_successor_replays_nothing() {
    let (at_kill, stored) = killed_and_succeeded(true).await;
    eprintln!("positions in the store: killed at {at_kill}; successor {stored:?}");
    assert_eq!(
        stored.duplicates, 0,
        "replayed below the stored position: {stored:?}"
    );
    let (at_kill, broker) = killed_and_succeeded(false).await;
    eprintln!("positions in the broker: killed at {at_kill}; successor {broker:?}");
}

/// A member holds deliveries of its partition when another member takes the partition
/// (a new epoch in the store): its transactions for them are fenced — rolled back, the
/// deliveries left unsettled (no disbursement, no ack, no dead letter) — and the
/// partition's new owner processes each exactly once. Returns how many of the stale
/// member's transactions committed (0 unless fencing is off).
async fn stale_member_commits(held: usize) -> usize {
    use idem_broker::kafka::KafkaConsumer;
    use idem_core::{Outcome, PositionStore as _};
    let store = common::fresh_pg().await;
    let position_store: Arc<dyn idem_core::PositionStore> = Arc::new(store.clone());
    let config = one_partition(&common::fresh_name("fenced"))
        .with_position_store(Arc::clone(&position_store));
    let (bodies, ledger) = common::submissions(&config.name, held);
    let url = BrokerUrl::parse(&url_in(&config.group, 1)).expect("URL");
    publish_raw(&url, &config.name, &bodies)
        .await
        .expect("publish");
    let mut stale = KafkaConsumer::connect(&config).await.expect("connect");
    let in_hand = common::take(&mut stale, held).await;
    // Another member takes the partition: the epoch moves on.
    let taken = store
        .take_position(&config.position_source(), 0)
        .await
        .expect("take");
    assert_eq!(taken.epoch, 2, "the stale member took epoch 1");
    let gate = Gate::new(store.clone(), store.grant_handler());
    let mut landed = 0;
    for d in in_hand {
        match gate.process(d).await {
            Outcome::Failed { error, settle, .. } => {
                assert!(
                    matches!(error, idem_core::Error::Store(ref e) if e.is_fenced()),
                    "{error}"
                );
                assert!(settle.is_ok());
            }
            Outcome::Processed { .. } => landed += 1,
            other => panic!("{other:?}"),
        }
    }
    if landed == 0 {
        assert!(common::effects(&store).await.is_empty());
    }
    drop(stale);
    // The new owner (after the stale member left) processes every one exactly once.
    let stats = next_member(&config, &store).await;
    if landed == 0 {
        assert_eq!(stats.processed, u64::try_from(held).unwrap(), "{stats:?}");
        ledger.assert_exactly_once(&common::effects(&store).await);
    }
    landed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_partition_was_taken_commits_nothing_for_it() {
    assert_eq!(
        stale_member_commits(5).await,
        0,
        "a stale member's commit landed"
    );
}

/// The test above with the epoch check off (mutant `UnfencedPositions`): the stale
/// member's transactions land, which the test above refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fencing_a_stale_members_commits_land() {
    idem_core::mutant::set(Some(idem_core::mutant::Mutant::UnfencedPositions));
    let landed = stale_member_commits(5).await;
    idem_core::mutant::set(None);
    assert_eq!(landed, 5, "the mutant should let every stale commit land");
}

/// Three members with positions stored, two of them killed (SIGKILL) at different
/// points while the group rebalances around them; a replacement consumes the rest.
/// Exactly one disbursement per submission, nothing left to settle, and the
/// replacement meets no duplicate: every partition's successor started at its stored
/// position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_two_killed_with_positions_stored_exactly_once() {
    const N: usize = 600;
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let name = common::fresh_name("pos-three");
    let store = common::fresh_pg().await;
    let (bodies, ledger) = common::submissions(&name, N);
    let url = positions_url(&group, 4);
    publish_raw(&url, &name, &bodies).await.expect("publish");
    let args = [
        "--delay-ms",
        "5",
        "--batch",
        "5",
        "--concurrency",
        "2",
        "--positions",
        "1",
    ];
    let mut first = spawn_member(&group, &name, &store, &args);
    let mut second = spawn_member(&group, &name, &store, &args);
    let survivor = {
        let (url, name, store) = (url.clone(), name.clone(), store.clone());
        tokio::spawn(async move {
            consume_positioned(&url, &name, &store, (2, 5), Duration::from_secs(15)).await
        })
    };
    let count = |store: PgStore| async move { common::effects(&store).await.len() };
    let deadline = Instant::now() + Duration::from_secs(240);
    for (child, at) in [(&mut first, 120), (&mut second, 300)] {
        while count(store.clone()).await < at {
            assert!(Instant::now() < deadline, "the group never got to {at}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        child.kill().expect("SIGKILL a member");
        let _ = child.wait();
    }
    let survivor = survivor.await.expect("survivor");
    // A delivery the survivor held when its partition moved on is fenced (failed,
    // unsettled), never dead-lettered.
    eprintln!("survivor: {survivor:?}");
    assert_eq!(
        (survivor.rejected, survivor.duplicates),
        (0, 0),
        "{survivor:?}"
    );
    if count(store.clone()).await < N {
        // tansu hands a dead member's partitions on only when the membership changes.
        let replacement =
            consume_positioned(&url, &name, &store, (2, 5), Duration::from_secs(15)).await;
        eprintln!("replacement: {replacement:?}");
        assert_eq!(replacement.duplicates, 0, "{replacement:?}");
    }
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert_eq!(
        common::wait_pending(&url, &name, 0).await,
        0,
        "nothing left to settle"
    );
}

/// A new member of `config`'s group, one delivery at a time into `store`, until idle
/// for 8 s.
async fn next_member(config: &KafkaConfig, store: &PgStore) -> idem_core::ConsumerStats {
    let next = idem_broker::kafka::KafkaConsumer::connect(config)
        .await
        .expect("connect the next member");
    let gate = Gate::new(store.clone(), store.grant_handler());
    consumer::run(
        &gate,
        until_idle(next, Duration::from_secs(8)),
        ConsumerConfig::new(1, 1),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("the next member")
}

/// A member commits offsets 1..=9 of its partition while offset 0 is still in hand (a
/// slow delivery), then dies holding 0. The group's committed offset cannot pass 0, so
/// with broker commits only the successor reads 1..=9 again (nine duplicates); with
/// positions stored, the store holds 1..=9 done and the successor skips them: the gate
/// sees offset 0 alone. Returns the successor's (processed, duplicates).
async fn successor_after_a_slow_first(positions: bool) -> (u64, u64) {
    use idem_broker::kafka::KafkaConsumer;
    const N: usize = 10;
    let store = common::fresh_pg().await;
    let mut config = one_partition(&common::fresh_name("slow-first"));
    if positions {
        config = config.with_position_store(Arc::new(store.clone()));
    }
    let (bodies, ledger) = common::submissions(&config.name, N);
    let url = BrokerUrl::parse(&url_in(&config.group, 1)).expect("URL");
    publish_raw(&url, &config.name, &bodies)
        .await
        .expect("publish");
    let gate = Gate::new(store.clone(), store.grant_handler());
    let mut first = KafkaConsumer::connect(&config).await.expect("connect");
    let mut in_hand = common::take(&mut first, N).await.into_iter();
    let slow = in_hand.next().expect("offset 0");
    assert_eq!(slow.acker.offset(), 0);
    for d in in_hand {
        let o = gate.process(d).await;
        assert_eq!(o.kind(), idem_core::OutcomeKind::Processed, "{o:?}");
    }
    // The member dies holding offset 0.
    drop(slow);
    drop(first);
    let stats = next_member(&config, &store).await;
    ledger.assert_exactly_once(&common::effects(&store).await);
    (stats.processed, stats.duplicates)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_positions_stored_a_successor_reads_again_only_what_is_not_done() {
    assert_eq!(successor_after_a_slow_first(true).await, (1, 0));
    assert_eq!(successor_after_a_slow_first(false).await, (1, 9));
}

/// A stored position past the end of the partition's log (the topic was deleted and
/// created again; the store kept the old topic's position) would skip records no one
/// processed: the member refuses it, ending its stream with a configuration error, and
/// hands out nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_position_past_the_end_of_the_log_stops_the_member() {
    use idem_broker::kafka::KafkaConsumer;
    use idem_core::{ClaimStore as _, ClaimTx as _, PositionMove, PositionStore as _};
    let store = common::fresh_pg().await;
    let config =
        one_partition(&common::fresh_name("past-end")).with_position_store(Arc::new(store.clone()));
    let url = BrokerUrl::parse(&url_in(&config.group, 1)).expect("URL");
    let (bodies, _) = common::submissions(&config.name, 3);
    publish_raw(&url, &config.name, &bodies)
        .await
        .expect("publish");
    // The old topic's position: everything below 1000 done.
    let source = config.position_source();
    let epoch = store.take_position(&source, 0).await.expect("take").epoch;
    let mut tx = store.begin().await.expect("begin");
    tx.advance_positions(&[PositionMove {
        source: source.as_str().into(),
        partition: 0,
        offset: 999,
        settled_below: 999,
        epoch,
    }])
    .await
    .expect("advance");
    tx.commit().await.expect("commit");
    let mut consumer = KafkaConsumer::connect(&config).await.expect("connect");
    let first = next_within(&mut consumer, Duration::from_secs(120))
        .await
        .expect("an answer within 120 s")
        .expect("the stream's first item");
    match first {
        Err(idem_broker::BrokerError::Config { detail, .. }) => {
            assert!(detail.contains("past the end of the log"), "{detail}");
        }
        Err(e) => panic!("another error: {e}"),
        Ok(d) => panic!("a delivery was handed out: offset {}", d.acker.offset()),
    }
    assert!(common::effects(&store).await.is_empty());
}

/// With positions stored, the store is the authority: a group offset ahead of the stored
/// position (an operator's offset reset, or another client committing in the group)
/// skips nothing. A positioned member processes offsets 0..3; another consumer of the
/// group, which keeps no positions (its own store), settles 3..8, moving the group's
/// offset to 8; the next positioned member seeks back to the stored position 3 and
/// processes 3..10 into the first store: every submission exactly once there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_forward_commit_skips_nothing_with_positions_stored() {
    use idem_broker::kafka::KafkaConsumer;
    const N: usize = 10;
    let store = common::fresh_pg().await;
    let config = one_partition(&common::fresh_name("foreign-commit"));
    let positioned = config.clone().with_position_store(Arc::new(store.clone()));
    let (bodies, ledger) = common::submissions(&config.name, N);
    publish_all(&config, &bodies).await;
    let gate = Gate::new(store.clone(), store.grant_handler());
    let mut first = KafkaConsumer::connect(&positioned.clone().with_prefetch(3))
        .await
        .expect("connect");
    for d in common::take(&mut first, 3).await {
        let o = gate.process(d).await;
        assert_eq!(o.kind(), idem_core::OutcomeKind::Processed, "{o:?}");
    }
    drop(first);
    let stored = |store: PgStore, source: String| async move {
        use idem_core::PositionStore as _;
        store.positions(&source).await.expect("positions")[0].next
    };
    assert_eq!(
        stored(store.clone(), positioned.position_source()).await,
        Some(3)
    );
    // Another consumer in the group, without positions and with a store of its own.
    let foreign_store = common::fresh_pg().await;
    let foreign_gate = Gate::new(foreign_store.clone(), foreign_store.grant_handler());
    let mut foreign = KafkaConsumer::connect(&config.clone().with_prefetch(5))
        .await
        .expect("connect the foreign consumer");
    for d in common::take(&mut foreign, 5).await {
        let offset = d.acker.offset();
        assert!((3..8).contains(&offset), "offset {offset}");
        let o = foreign_gate.process(d).await;
        assert_eq!(o.kind(), idem_core::OutcomeKind::Processed, "{o:?}");
    }
    assert_eq!(
        common::wait_pending(
            &BrokerUrl::parse(&url_in(&config.group, 1)).expect("URL"),
            &config.name,
            2
        )
        .await,
        2,
        "the group's offset moved to 8"
    );
    drop(foreign);
    let stats = next_member(&positioned, &store).await;
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert_eq!((stats.processed, stats.duplicates), (7, 0), "{stats:?}");
    assert_eq!(
        stored(store.clone(), positioned.position_source()).await,
        Some(10)
    );
}

/// A member that lost the partition took it from the store late, after its new owner had
/// (its take was still in flight at the revoke): the epoch is past the owner's, and every
/// transaction of the owner for the partition is fenced. The owner starts the partition
/// over — takes it again (fencing the late member, which no longer reads it) and reads
/// again from its mark — and processes every submission exactly once in the same run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_fenced_by_a_late_take_takes_the_partition_again() {
    use idem_broker::kafka::KafkaConsumer;
    use idem_core::PositionStore as _;
    const N: usize = 10;
    let store = common::fresh_pg().await;
    let config = one_partition(&common::fresh_name("late-take"))
        .with_position_store(Arc::new(store.clone()))
        .with_prefetch(2);
    let (bodies, ledger) = common::submissions(&config.name, N);
    publish_all(&config, &bodies).await;
    let gate = Gate::new(store.clone(), store.grant_handler());
    let mut owner = KafkaConsumer::connect(&config).await.expect("connect");
    for d in common::take(&mut owner, 3).await {
        let o = gate.process(d).await;
        assert_eq!(o.kind(), idem_core::OutcomeKind::Processed, "{o:?}");
    }
    // The late take of a member that lost the partition.
    let source = config.position_source();
    let late = store.take_position(&source, 0).await.expect("take");
    assert_eq!(late.epoch, 2, "the owner took epoch 1");
    let stats = consumer::run(
        &gate,
        until_idle(owner, Duration::from_secs(8)),
        ConsumerConfig::new(1, 1),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("the owner's run");
    eprintln!("{stats:?}");
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert!(stats.failed >= 1, "no transaction was fenced: {stats:?}");
    assert_eq!(stats.processed, 7, "{stats:?}");
    let row = &store.positions(&source).await.expect("positions")[0];
    assert_eq!((row.next, row.epoch), (Some(10), 3), "{row:?}");
}

/// A member that lost its partition in a rebalance does not dead-letter a delivery it
/// received before: member A holds a delivery; member B joins the group (an eager
/// protocol, so every partition is revoked and assigned again); once one of them has
/// received the message again, A's dead letter of its old delivery is refused and the
/// dead-letter topic stays empty — its new owner decides (before, A's dead letter went
/// out beside the new owner's processing).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_that_lost_its_partition_does_not_dead_letter_its_delivery() {
    use idem_core::{Acker as _, RejectReason};
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let url = BrokerUrl::parse(&format!("{}&assignment=range", url_in(&group, 1))).expect("url");
    let name = common::fresh_name("stale-dead-letter");
    publish_raw(&url, &name, &[b"held".to_vec()])
        .await
        .expect("publish");
    let mut a = AnyConsumer::connect(&url, &name, 8).await.expect("A");
    let d = next_within(&mut a, Duration::from_secs(60))
        .await
        .expect("A's delivery within 60 s")
        .expect("A's stream goes on")
        .expect("A's delivery");
    let mut b = AnyConsumer::connect(&url, &name, 8).await.expect("B");
    // The rebalance: the message comes again, to A (a new ownership) or to B.
    let again = tokio::time::timeout(Duration::from_secs(90), async {
        use futures::StreamExt as _;
        tokio::select! {
            Some(r) = a.next() => r,
            Some(r) = b.next() => r,
        }
    })
    .await
    .expect("the message delivered again within 90 s of B's join")
    .expect("a delivery");
    assert_eq!(again.payload, b"held");
    let refused = d
        .acker
        .dead_letter(
            &d.payload,
            &d.headers,
            &RejectReason::new("test", "dead-lettered by a member that lost the partition"),
        )
        .await;
    assert!(refused.is_err(), "a stale member's dead letter is refused");
    // A reader in a group of its own (a member of the test's group would rebalance it).
    let reader = BrokerUrl::parse(&url_in(&format!("{group}-letters"), 1)).expect("url");
    let mut letters = AnyConsumer::connect(&reader, &idem_broker::dead_letter_name(&name), 8)
        .await
        .expect("dead-letter consumer");
    let letters = common::drain(&mut letters, Duration::from_secs(8)).await;
    assert!(
        letters.is_empty(),
        "nothing dead-lettered: {} letters",
        letters.len()
    );
    drop(again);
}
