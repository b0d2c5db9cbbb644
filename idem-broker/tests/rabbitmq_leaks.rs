//! A RabbitMQ connection given up while it opens leaves nothing behind: neither lapin's
//! I/O thread (`lapin-io-loop`) nor its socket. Servers that never answer (one that
//! accepts and stays silent, one whose connections wait in its backlog, one whose SYNs
//! are dropped) and a real RabbitMQ behind a hop that goes dead after the AMQP handshake
//! (`IDEM_TEST_AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`).
//!
//! The scenarios count the process's `lapin-io-loop` threads, so they run in a binary of
//! their own, one at a time: not a module of the `broker` binary (`tests/broker`), whose
//! other RabbitMQ tests would start such threads beside them when its tests share one
//! process (plain `cargo test`; nextest runs each test in a process of its own).

#![cfg(all(feature = "rabbitmq", target_os = "linux"))]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_broker::rabbitmq::{RabbitConfig, RabbitConsumer, RabbitPublisher};
use idem_broker::BrokerError;

/// One scenario at a time: each counts the whole process's threads.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The RabbitMQ under test.
fn url() -> String {
    std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn fresh_name(prefix: &str) -> String {
    format!("idem-test-{prefix}-{:08x}", rand::random::<u32>())
}

/// How many of this process's threads are lapin's I/O threads.
fn io_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end() == "lapin-io-loop")
        .count()
}

/// Waits up to 5 s for `check`; fails with `what` (and what `check` last saw) past it.
async fn within_5s(what: &str, mut check: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match check() {
            Ok(()) => return,
            Err(seen) if Instant::now() > deadline => panic!("{what}: {seen}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A publisher's and a consumer's connect to `url` (`times` each) fail with a retryable
/// connect error, each within 10 s.
async fn connects_fail(url: &str, times: usize) {
    let config = RabbitConfig::new(url, fresh_name("given-up"));
    for _ in 0..times {
        let publisher = tokio::time::timeout(
            Duration::from_secs(10),
            RabbitPublisher::connect_with(&config),
        )
        .await
        .expect("the publisher's connect ends");
        let consumer =
            tokio::time::timeout(Duration::from_secs(10), RabbitConsumer::connect(&config))
                .await
                .expect("the consumer's connect ends");
        for e in [
            publisher.map(drop).expect_err("no publisher"),
            consumer.map(drop).expect_err("no consumer"),
        ] {
            assert!(
                matches!(e, BrokerError::Connect { .. }) && e.is_retryable(),
                "{e:?}"
            );
        }
    }
}

/// A listener that accepts every connection and never writes; counts the connections it
/// accepted and those the client closed (a read that ends).
fn silent_acceptor() -> (u16, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (accepted, closed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (counted, ended) = (Arc::clone(&accepted), Arc::clone(&closed));
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(mut client) = client else { return };
            counted.fetch_add(1, Ordering::SeqCst);
            let ended = Arc::clone(&ended);
            std::thread::spawn(move || {
                let mut buf = [0u8; 512];
                while let Ok(n) = client.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                }
                ended.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    (port, accepted, closed)
}

/// Against servers that take the TCP connection (or never answer its SYN) and then say
/// nothing, each connect times out after `connection_timeout`, and its socket and lapin's
/// I/O thread end with it: the server sees each connection closed, and no
/// `lapin-io-loop` thread is left. Each stayed for ever, one more at every retry of
/// `idem consume` or `idem relay`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_open_leaves_no_io_thread_nor_socket() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let before = io_threads();
    let url = |port: u16| format!("amqp://guest:guest@127.0.0.1:{port}/%2f?connection_timeout=300");

    // Accepts and never writes (a RabbitMQ out of file handles does this).
    let (port, accepted, closed) = silent_acceptor();
    connects_fail(&url(port), 2).await;

    // Never accepts: the kernel completes the TCP handshake into the backlog.
    let backlog = TcpListener::bind("127.0.0.1:0").expect("bind");
    connects_fail(&url(backlog.local_addr().expect("addr").port()), 2).await;

    // A full backlog (of 0, taken by one connection): the SYN is dropped, the TCP connect
    // never completes (about 2 minutes of retransmits).
    let full = tokio::net::TcpSocket::new_v4().expect("socket");
    full.bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let full = full.listen(0).expect("listen");
    let full_port = full.local_addr().expect("addr").port();
    let _filler = TcpStream::connect(("127.0.0.1", full_port)).expect("the one queued");
    assert!(
        TcpStream::connect_timeout(
            &format!("127.0.0.1:{full_port}").parse().expect("addr"),
            Duration::from_millis(300)
        )
        .is_err(),
        "a full backlog drops the SYN"
    );
    connects_fail(&url(full_port), 2).await;

    within_5s("every lapin I/O thread ends", || {
        let now = io_threads();
        (now <= before)
            .then_some(())
            .ok_or(format!("{now} lapin-io-loop threads, {before} before"))
    })
    .await;
    within_5s("the accepting server sees each connection closed", || {
        let (accepted, closed) = (
            accepted.load(Ordering::SeqCst),
            closed.load(Ordering::SeqCst),
        );
        (accepted >= 4 && closed == accepted)
            .then_some(())
            .ok_or(format!("{closed} closed of {accepted} accepted"))
    })
    .await;
    // The backlog's connections, accepted now, end after the protocol header.
    backlog.set_nonblocking(true).expect("nonblocking");
    let mut ended = 0;
    while let Ok((client, _)) = backlog.accept() {
        let mut client = client;
        client.set_nonblocking(false).expect("blocking");
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("read timeout");
        let mut sent = Vec::new();
        let end = client.read_to_end(&mut sent);
        assert!(
            end.is_ok(),
            "a connection in the backlog is still open: {end:?}"
        );
        ended += 1;
    }
    assert!(ended >= 4, "{ended} connections in the backlog");
}

/// A TCP hop to the test RabbitMQ that goes dead right after the AMQP handshake: it
/// passes both directions until the server's `connection.open-ok` has gone to the
/// client, then forwards nothing more from the client, so the client's `channel.open`
/// (and its `connection.close`) is never answered. Counts the clients' connections and
/// those the client closed. Returns the hop's port.
fn hop_dead_after_the_handshake() -> (u16, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let upstream = url()
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or("127.0.0.1:5672")
        .to_owned();
    let (connections, closed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (counted, ended) = (Arc::clone(&connections), Arc::clone(&closed));
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let server = TcpStream::connect(&upstream).expect("the test RabbitMQ");
            counted.fetch_add(1, Ordering::SeqCst);
            let dead = Arc::new(AtomicBool::new(false));
            let (mut from_client, mut to_server) = (
                client.try_clone().expect("clone"),
                server.try_clone().expect("clone"),
            );
            let (client_dead, ended) = (Arc::clone(&dead), Arc::clone(&ended));
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match from_client.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        // Swallowed: the path is dead from here on.
                        Ok(_) if client_dead.load(Ordering::SeqCst) => {}
                        Ok(n) => {
                            if to_server.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                ended.fetch_add(1, Ordering::SeqCst);
                to_server.shutdown(Shutdown::Both).ok();
            });
            let (mut from_server, mut to_client) = (server, client);
            std::thread::spawn(move || {
                // Frames: type (1), channel (2), size (4), payload, 0xCE; a method's payload
                // starts with its class and method ids: connection.open-ok is 10, 41.
                let mut pending: Vec<u8> = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n) = from_server.read(&mut buf) {
                    if n == 0 || to_client.write_all(&buf[..n]).is_err() {
                        return;
                    }
                    pending.extend_from_slice(&buf[..n]);
                    while pending.len() >= 7 {
                        let size =
                            u32::from_be_bytes([pending[3], pending[4], pending[5], pending[6]])
                                as usize;
                        if pending.len() < 7 + size + 1 {
                            break;
                        }
                        if pending[0] == 1 && size >= 4 && pending[7..11] == [0, 10, 0, 41] {
                            dead.store(true, Ordering::SeqCst);
                        }
                        pending.drain(..7 + size + 1);
                    }
                }
            });
        }
    });
    (port, connections, closed)
}

/// A server that completes the handshake and then answers nothing: when the publisher's
/// and the consumer's setup (`channel.open`, ...) time out, their connections' sockets
/// are closed and their lapin I/O threads end. Each dropped connection waited for ever
/// for the server's `connection.close-ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setup_given_up_after_the_handshake_leaves_no_io_thread_nor_socket() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let before = io_threads();
    let (port, connections, closed) = hop_dead_after_the_handshake();
    connects_fail(
        &format!("amqp://guest:guest@127.0.0.1:{port}/%2f?connection_timeout=1500"),
        1,
    )
    .await;
    assert_eq!(
        connections.load(Ordering::SeqCst),
        3,
        "the publisher's connection and the consumer's two passed the handshake"
    );
    within_5s("every lapin I/O thread ends", || {
        let now = io_threads();
        (now <= before)
            .then_some(())
            .ok_or(format!("{now} lapin-io-loop threads, {before} before"))
    })
    .await;
    within_5s("the hop sees each connection closed", || {
        let closed = closed.load(Ordering::SeqCst);
        (closed == 3)
            .then_some(())
            .ok_or(format!("{closed} of 3 closed"))
    })
    .await;
}
