//! RabbitMQ in a resource alarm, on a real RabbitMQ node of the test's own
//! (`rabbitmq-server` and `rabbitmqctl` on this host, as for the TLS tests).
//!
//! The alarm is raised for a whole node (`rabbitmqctl set_vm_memory_high_watermark 0`
//! blocks every publishing connection), so it is never raised on the shared node that the
//! other tests use: nextest runs test binaries beside each other, and an alarm there
//! blocks their publishers too (it did: every RabbitMQ test running beside this one timed
//! out). The private node is stopped, its files removed, when the test ends.

use crate::common;

use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{fresh_name, plain_bodies, take, Plain};
use idem_broker::dead_letter_name;
use idem_broker::rabbitmq::{publish_raw, RabbitConfig, RabbitConsumer};
use idem_engine::{Acker, Gate, OutcomeKind, RejectReason};
use idem_test_support::tls::TlsServer;
use idem_testkit::MemoryStore;

/// The port and node name of the test's own node, which the test holds (and stops when it
/// ends).
static NODE: OnceLock<(u16, String)> = OnceLock::new();

/// Starts the test's own node; it stops when the returned server is dropped.
fn start_node() -> TlsServer {
    let server = TlsServer::rabbitmq_without_tls();
    let name = server.node().expect("a RabbitMQ node").to_owned();
    NODE.set((server.port, name)).expect("one node per process");
    server
}

fn node() -> &'static str {
    &NODE.get().expect("the node is started").1
}

fn url() -> String {
    format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        NODE.get().expect("the node is started").0
    )
}

/// `rabbitmqctl -n NODE ARGS` on the test's node, its output; a failure fails the test.
fn rabbitmqctl(args: &[&str]) -> String {
    let out = Command::new("rabbitmqctl")
        .args(["-n", node()])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("rabbitmqctl {args:?}: {e}"));
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A memory alarm on the node while it lives: the watermark set to 0, and put back as
/// it was when dropped (a panicking test included).
struct MemoryAlarm {
    /// The `set_vm_memory_high_watermark` arguments that restore the setting.
    restore: Vec<String>,
}

impl MemoryAlarm {
    fn raise() -> Self {
        let was = rabbitmqctl(&["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."]);
        let was = was.trim();
        // A fraction (`0.4`) or `{absolute,Bytes}`.
        let restore = match was.strip_prefix("{absolute,") {
            Some(rest) => vec![
                "absolute".to_owned(),
                rest.trim_end_matches('}').trim().to_owned(),
            ],
            None => vec![was.to_owned()],
        };
        assert!(
            !restore.iter().any(String::is_empty),
            "unreadable watermark {was:?}"
        );
        let alarm = Self { restore };
        rabbitmqctl(&["set_vm_memory_high_watermark", "0"]);
        alarm
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        let mut args = vec!["set_vm_memory_high_watermark"];
        args.extend(self.restore.iter().map(String::as_str));
        let ok = Command::new("rabbitmqctl")
            .args(["-n", node()])
            .args(&args)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("could not restore the memory watermark: rabbitmqctl {args:?}");
        }
    }
}

/// Whether the node reports a memory alarm.
fn memory_alarm_on() -> bool {
    rabbitmqctl(&["eval", "rabbit_alarm:get_alarms()."]).contains("memory")
}

/// Whether any connection of the node is blocked (has published under the alarm).
fn a_connection_is_blocked() -> bool {
    rabbitmqctl(&["list_connections", "-q", "state"])
        .lines()
        .any(|l| l.trim() == "blocked")
}

/// How many messages (ready and unacked) queue `name` holds.
fn messages_in(name: &str) -> u64 {
    rabbitmqctl(&["list_queues", "-q", "name", "messages"])
        .lines()
        .find_map(|l| {
            let mut parts = l.split_whitespace();
            (parts.next() == Some(name)).then(|| parts.next()?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("queue {name} not listed"))
}

/// Polls `check` (each call takes a `rabbitmqctl` run) until it holds, for up to `within`.
async fn eventually(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// While a memory alarm blocks publishers, the consumer keeps acking: dead letters go on
/// a connection of their own, which the broker blocks when they are published, and the
/// consumer's connection, which never publishes, is not blocked. A dead letter that gets
/// no confirm within the confirm timeout is a retryable error, and its delivery is not
/// acked: it comes back, and is dead-lettered once the alarm is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_flow_while_dead_letters_wait_for_an_alarm() {
    let _node = start_node();
    common::within(async {
        let name = fresh_name("rabbit-alarm");
        publish_raw(&url(), &name, &plain_bodies(&name, 3))
            .await
            .expect("publish");
        let config = RabbitConfig::new(url(), &name)
            .with_prefetch(8)
            .with_confirm_timeout(Duration::from_secs(2));
        let mut stream = RabbitConsumer::connect(&config).await.expect("connect");
        let mut taken = take(&mut stream, 3).await.into_iter();
        let (a, poison, c) = (
            taken.next().expect("a"),
            taken.next().expect("poison"),
            taken.next().expect("c"),
        );
        let poison_body = poison.payload.clone();
        let gate = Gate::new(MemoryStore::new(), Plain::default());

        let alarm = MemoryAlarm::raise();
        eventually(Duration::from_secs(10), "a memory alarm", memory_alarm_on).await;
        let dead_letter = tokio::spawn(async move {
            let started = Instant::now();
            let r = poison
                .acker
                .dead_letter(
                    &poison.payload,
                    &poison.headers,
                    &RejectReason::new("test_poison", "dead-lettered under an alarm"),
                )
                .await;
            (r, started.elapsed())
        });
        eventually(
            Duration::from_secs(10),
            "the dead letters' connection blocked",
            a_connection_is_blocked,
        )
        .await;

        // The consumer's connection still acks: the broker removes `a`.
        let o = tokio::time::timeout(Duration::from_secs(10), gate.process(a))
            .await
            .expect("an ack under the alarm did not complete");
        assert_eq!(o.kind(), OutcomeKind::Processed, "{o:?}");
        assert!(o.settle_error().is_none(), "{o:?}");
        eventually(
            Duration::from_secs(10),
            "the ack reached the broker under the alarm",
            || messages_in(&name) == 2,
        )
        .await;

        // The dead letter gets no confirm: a retryable error after the confirm timeout,
        // and the delivery is not acked.
        let (r, waited) = tokio::time::timeout(Duration::from_secs(20), dead_letter)
            .await
            .expect("the dead letter waited past its confirm timeout")
            .expect("task");
        let err = r.expect_err("no confirm under the alarm");
        assert!(err.retryable, "{err:?}");
        assert!(err.message.contains("confirm"), "{}", err.message);
        assert!(waited >= Duration::from_secs(2), "{waited:?}");
        let o = tokio::time::timeout(Duration::from_secs(10), gate.process(c))
            .await
            .expect("an ack under the alarm did not complete");
        assert!(o.settle_error().is_none(), "{o:?}");
        eventually(Duration::from_secs(10), "c acked", || {
            messages_in(&name) == 1
        })
        .await;

        drop(alarm);
        eventually(Duration::from_secs(10), "the alarm cleared", || {
            !memory_alarm_on()
        })
        .await;
        // The poison comes back (rejected after its pause: a counted attempt), and is
        // dead-lettered now.
        let again = take(&mut stream, 1).await.pop().expect("the poison again");
        assert_eq!(again.payload, poison_body);
        assert_eq!(again.attempt, Some(2));
        again
            .acker
            .dead_letter(
                &again.payload,
                &again.headers,
                &RejectReason::new("test_poison", "dead-lettered after the alarm"),
            )
            .await
            .expect("dead-lettered");
        eventually(Duration::from_secs(10), "the source queue empty", || {
            messages_in(&name) == 0
        })
        .await;
        // At least once: the dead letter given up on under the alarm may arrive too.
        let dead = messages_in(&dead_letter_name(&name));
        assert!((1..=2).contains(&dead), "{dead} dead letters");
    })
    .await;
}
