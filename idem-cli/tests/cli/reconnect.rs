//! `--reconnect-timeout`: a broker or store that cannot be had ends the command with a
//! one-line error and exit 1 — never a silent hang. `--exit-when-idle`: a drain ends
//! only when the source is empty for it (SQS: moto at `IDEM_TEST_SQS_ENDPOINT`, default
//! `http://127.0.0.1:5000`; a missing service fails the test).

use std::net::TcpListener;
use std::process::Output;
use std::time::{Duration, Instant};

use crate::common;

/// A local port with nothing listening on it.
fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}

fn idem(args: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let out = common::idem(args);
    (out, started.elapsed())
}

/// A SQLite store in a new directory, which is kept as long as the returned guard lives.
fn sqlite_store() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = format!("sqlite://{}", dir.path().join("db.sqlite").display());
    (dir, store)
}

/// `idem consume` from `broker` into `store`, given `reconnect` seconds.
fn consume(broker: &str, store: &str, reconnect: &str) -> (Output, Duration) {
    idem(&[
        "consume",
        "--broker",
        broker,
        "--source",
        "q",
        "--store",
        store,
        "--reconnect-timeout",
        reconnect,
    ])
}

/// `idem relay` from `store` to `broker`, given `reconnect` seconds.
fn relay(store: &str, broker: &str, destination: &str, reconnect: &str) -> (Output, Duration) {
    idem(&[
        "relay",
        "--store",
        store,
        "--broker",
        broker,
        "--destination",
        destination,
        "--reconnect-timeout",
        reconnect,
    ])
}

fn assert_gave_up(out: &Output, took: Duration) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    // The command's own last word: log records of a driver's thread (lapin's I/O thread
    // reporting the socket idem shut down as it gave up) may be written after it.
    let last = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("idem: "))
        .unwrap_or_default();
    assert!(last.contains("--reconnect-timeout"), "stderr: {stderr}");
    assert!(
        took >= Duration::from_millis(900),
        "gave up too soon: {took:?}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

/// A URL of each broker kind at `port` on loopback.
fn every_kind(port: u16) -> [String; 5] {
    [
        format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
        format!("nats://127.0.0.1:{port}"),
        format!("redis://127.0.0.1:{port}"),
        format!("sqs://127.0.0.1:{port}"),
        format!("kafka://127.0.0.1:{port}"),
    ]
}

/// Every adapter: nothing listening is a failed try, retried until the reconnect
/// timeout, then exit 1 naming it.
#[test]
fn consume_gives_up_on_an_unreachable_broker() {
    for broker in every_kind(closed_port()) {
        let (_dir, store) = sqlite_store();
        let (out, took) = consume(&broker, &store, "1");
        assert_gave_up(&out, took);
    }
}

/// The same for the relay's publisher, on every adapter.
#[test]
fn relay_gives_up_on_an_unreachable_broker() {
    for broker in every_kind(closed_port()) {
        let (_dir, store) = sqlite_store();
        let (out, took) = relay(&store, &broker, "events", "1");
        assert_gave_up(&out, took);
    }
}

#[test]
fn consume_gives_up_on_an_unreachable_store() {
    let store = format!("postgres://postgres@127.0.0.1:{}/test", closed_port());
    let (out, took) = consume("amqp://guest:guest@127.0.0.1:1/%2f", &store, "1");
    assert_gave_up(&out, took);
}

#[test]
fn relay_gives_up_on_an_unreachable_store() {
    let store = format!("postgres://postgres@127.0.0.1:{}/test", closed_port());
    let destination = "idem-reconnect-test-events";
    let (out, took) = relay(&store, "redis://127.0.0.1:6379", destination, "1");
    assert_gave_up(&out, took);
}

/// A local port whose server accepts connections and never says a word (a broker stuck on
/// an alarm, a half-open socket): the connections are held open until the test ends.
fn silent_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in l.incoming().flatten() {
            held.push(s);
        }
    });
    port
}

/// A broker that accepts the connection and never answers is a failed try, retried until
/// the reconnect timeout, on every adapter: the consumer exits 1 saying so (it waited for
/// ever, silently).
#[test]
fn consume_gives_up_on_a_broker_that_never_answers() {
    for broker in every_kind(silent_port()) {
        let (_dir, store) = sqlite_store();
        let (out, took) = consume(&broker, &store, "2");
        assert_gave_up(&out, took);
    }
}

/// The same for the relay's publisher, on every adapter.
#[test]
fn relay_gives_up_on_a_broker_that_never_answers() {
    for broker in every_kind(silent_port()) {
        let (_dir, store) = sqlite_store();
        let (out, took) = relay(&store, &broker, "events", "2");
        assert_gave_up(&out, took);
    }
}

/// A drain started right after a consumer was SIGKILLed while it held messages (its
/// store locked, so it held them deferred, their visibility extended): those messages
/// are invisible on SQS until their visibility timeout (4 s here) runs out. The drain
/// (`--exit-when-idle 1`) asks the queue what it holds, waits, and processes all three,
/// exiting 0. Before, it exited 0 after one idle second with nothing processed.
#[test]
fn a_drain_after_a_sigkill_waits_for_the_invisible_messages() {
    use std::process::{Command, Stdio};
    let endpoint = std::env::var("IDEM_TEST_SQS_ENDPOINT")
        .unwrap_or_else(|_| "http://127.0.0.1:5000".to_owned());
    let broker = format!(
        "sqs://{}?visibility_timeout=4s",
        endpoint.trim_start_matches("http://").trim_end_matches('/')
    );
    let queue = format!("drain-{}-{:08x}", std::process::id(), rand::random::<u32>());
    let (dir, store) = sqlite_store();
    let lines = dir.path().join("three.jsonl");
    std::fs::write(
        &lines,
        (0..3)
            .map(|i| {
                format!(
                    "{{\"award_id\":\"D-{i}\",\"submission_timestamp\":\"2026-07-01T09:00:00Z\",\"amount_cents\":1}}\n"
                )
            })
            .collect::<String>(),
    )
    .expect("write");
    let lines = lines.to_str().expect("utf-8").to_owned();
    let (out, _) = idem(&["migrate", "--store", &store, "--handler", "grant"]);
    common::ok(&out, "migrate");
    let (out, _) = idem(&[
        "publish",
        "--broker",
        &broker,
        "--destination",
        &queue,
        "--file",
        &lines,
    ]);
    common::ok(&out, "publish");
    // The store's write lock held by another process (readers go on): the first
    // consumer receives the three messages and holds them, its claims waiting on the
    // lock, until it is killed.
    let db = store.trim_start_matches("sqlite://").to_owned();
    let mut locker = Command::new("python3")
        .args([
            "-c",
            "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], isolation_level=None); \
             c.execute('BEGIN IMMEDIATE'); print('locked', flush=True); time.sleep(60)",
            &db,
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    {
        use std::io::BufRead as _;
        let mut line = String::new();
        std::io::BufReader::new(locker.stdout.as_mut().expect("stdout"))
            .read_line(&mut line)
            .expect("read");
        assert_eq!(line.trim(), "locked");
    }
    let consume = [
        "consume", "--broker", &broker, "--source", &queue, "--store", &store,
    ];
    let mut first = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(consume)
        .arg("--no-migrate")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the first consumer");
    let queue_url = format!("{}/123456789012/{queue}", endpoint.trim_end_matches('/'));
    let deadline = Instant::now() + Duration::from_secs(30);
    while not_visible(&endpoint, &queue_url) < 3 {
        assert!(
            Instant::now() < deadline,
            "the first consumer did not receive the three messages"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    first.kill().expect("SIGKILL");
    let _ = first.wait();
    let _ = locker.kill();
    let _ = locker.wait();
    assert_eq!(
        not_visible(&endpoint, &queue_url),
        3,
        "held by the killed one"
    );
    let (out, took) = idem(&[&consume[..], &["--exit-when-idle", "1"]].concat());
    let stdout = common::ok(&out, "the drain");
    assert_eq!(common::report_value(&stdout, "processed"), 3, "{stdout}");
    assert!(took < Duration::from_secs(60), "{took:?}");
}

/// SQS's `ApproximateNumberOfMessagesNotVisible` of `queue_url`, asked of moto at
/// `endpoint` in the query protocol (moto checks no signature; the credential's scope
/// tells it the service).
fn not_visible(endpoint: &str, queue_url: &str) -> u64 {
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-H",
            "Authorization: AWS4-HMAC-SHA256 Credential=idem-local/20260101/us-east-1/sqs/aws4_request, SignedHeaders=host, Signature=0",
            endpoint,
            "--data-urlencode",
            "Action=GetQueueAttributes",
            "--data-urlencode",
            "Version=2012-11-05",
            "--data-urlencode",
            &format!("QueueUrl={queue_url}"),
            "--data-urlencode",
            "AttributeName.1=ApproximateNumberOfMessagesNotVisible",
        ])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("<Value>")
        .nth(1)
        .and_then(|v| v.split("</Value>").next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("GetQueueAttributes: {text}"))
}
