//! `--reconnect-timeout`: a broker or store that cannot be had ends the command with a
//! one-line error and exit 1 — never a silent hang.

use std::net::TcpListener;
use std::process::Output;
use std::time::{Duration, Instant};

mod common;

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
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.contains("--reconnect-timeout"), "stderr: {stderr}");
    assert!(
        took >= Duration::from_millis(900),
        "gave up too soon: {took:?}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn consume_gives_up_on_an_unreachable_broker() {
    let (_dir, store) = sqlite_store();
    let broker = format!("amqp://guest:guest@127.0.0.1:{}/%2f", closed_port());
    let (out, took) = consume(&broker, &store, "1");
    assert_gave_up(&out, took);
}

#[test]
fn relay_gives_up_on_an_unreachable_broker() {
    let (_dir, store) = sqlite_store();
    let broker = format!("redis://127.0.0.1:{}", closed_port());
    let (out, took) = relay(&store, &broker, "events", "1");
    assert_gave_up(&out, took);
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
/// the reconnect timeout: the consumer exits 1 saying so (it waited for ever, silently).
#[test]
fn consume_gives_up_on_a_broker_that_never_answers() {
    for broker in [
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", silent_port()),
        format!("nats://127.0.0.1:{}", silent_port()),
        format!("redis://127.0.0.1:{}", silent_port()),
    ] {
        let (_dir, store) = sqlite_store();
        let (out, took) = consume(&broker, &store, "2");
        assert_gave_up(&out, took);
    }
}

/// The same for the relay's publisher.
#[test]
fn relay_gives_up_on_a_broker_that_never_answers() {
    let (_dir, store) = sqlite_store();
    let broker = format!("amqp://guest:guest@127.0.0.1:{}/%2f", silent_port());
    let (out, took) = relay(&store, &broker, "events", "2");
    assert_gave_up(&out, took);
}
