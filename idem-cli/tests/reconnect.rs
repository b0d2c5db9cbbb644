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
    let dir = tempfile::tempdir().expect("tempdir");
    let store = format!("sqlite://{}", dir.path().join("db.sqlite").display());
    let broker = format!("amqp://guest:guest@127.0.0.1:{}/%2f", closed_port());
    let (out, took) = idem(&[
        "consume",
        "--broker",
        &broker,
        "--source",
        "q",
        "--store",
        &store,
        "--reconnect-timeout",
        "1",
    ]);
    assert_gave_up(&out, took);
}

#[test]
fn relay_gives_up_on_an_unreachable_broker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = format!("sqlite://{}", dir.path().join("db.sqlite").display());
    let broker = format!("redis://127.0.0.1:{}", closed_port());
    let (out, took) = idem(&[
        "relay",
        "--store",
        &store,
        "--broker",
        &broker,
        "--destination",
        "events",
        "--reconnect-timeout",
        "1",
    ]);
    assert_gave_up(&out, took);
}

#[test]
fn consume_gives_up_on_an_unreachable_store() {
    let store = format!("postgres://postgres@127.0.0.1:{}/test", closed_port());
    let (out, took) = idem(&[
        "consume",
        "--broker",
        "amqp://guest:guest@127.0.0.1:1/%2f",
        "--source",
        "q",
        "--store",
        &store,
        "--reconnect-timeout",
        "1",
    ]);
    assert_gave_up(&out, took);
}

#[test]
fn relay_gives_up_on_an_unreachable_store() {
    let store = format!("postgres://postgres@127.0.0.1:{}/test", closed_port());
    let (out, took) = idem(&[
        "relay",
        "--store",
        &store,
        "--broker",
        "redis://127.0.0.1:6379",
        "--destination",
        "idem-reconnect-test-events",
        "--reconnect-timeout",
        "1",
    ]);
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
        let dir = tempfile::tempdir().expect("tempdir");
        let store = format!("sqlite://{}", dir.path().join("db.sqlite").display());
        let (out, took) = idem(&[
            "consume",
            "--broker",
            &broker,
            "--source",
            "q",
            "--store",
            &store,
            "--reconnect-timeout",
            "2",
        ]);
        assert_gave_up(&out, took);
    }
}

/// The same for the relay's publisher.
#[test]
fn relay_gives_up_on_a_broker_that_never_answers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = format!("sqlite://{}", dir.path().join("db.sqlite").display());
    let broker = format!("amqp://guest:guest@127.0.0.1:{}/%2f", silent_port());
    let (out, took) = idem(&[
        "relay",
        "--store",
        &store,
        "--broker",
        &broker,
        "--destination",
        "events",
        "--reconnect-timeout",
        "2",
    ]);
    assert_gave_up(&out, took);
}
