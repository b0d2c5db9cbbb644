//! Redis Streams on a server that freezes: a `redis-server` of the test's own, on a free
//! port, stopped with `SIGSTOP` (its connections stay open, nothing answers) and resumed
//! with `SIGCONT` by a guard, whatever the test's outcome. `redis-server` must be on the
//! `PATH`: a missing one fails the test.

use crate::common;

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use idem_broker::redis_streams::{publish_raw, RedisStreamsConfig, RedisStreamsConsumer};
use idem_broker::BrokerError;
use idem_engine::{Gate, Outcome};
use idem_testkit::MemoryStore;

use common::{fresh_name, plain_bodies, take, Plain};

/// A `redis-server` of this test's own; dropped, it is resumed (`SIGCONT`) and killed.
struct OwnRedis {
    child: Child,
    port: u16,
}

impl OwnRedis {
    /// Starts one on a free port and waits until it accepts connections.
    fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on the PATH");
        let server = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal}");
    }

    /// Stops the server's process: connections stay open, nothing is answered.
    fn freeze(&self) {
        self.signal("-STOP");
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A frozen server: the ack of a delivery taken before fails with a retryable error
/// after the command timeout, and the stream ends with a timeout error (of the blocking
/// read, or of a takeover scan) instead of hanging; neither waits for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_fails_the_ack_and_ends_the_stream_with_a_timeout() {
    let server = OwnRedis::start();
    let name = fresh_name("redis-frozen");
    publish_raw(&server.url(), &name, &plain_bodies(&name, 1))
        .await
        .expect("publish");
    let config = RedisStreamsConfig::new(server.url(), &name)
        .with_block(Duration::from_millis(200))
        .with_command_timeout(Duration::from_secs(1));
    let mut deliveries = RedisStreamsConsumer::connect(&config)
        .await
        .expect("connect");
    let d = take(&mut deliveries, 1).await.remove(0);
    server.freeze();

    let gate = Gate::new(MemoryStore::new(), Plain::default());
    let outcome = tokio::time::timeout(Duration::from_secs(30), gate.process(d))
        .await
        .expect("the ack hung on a frozen server");
    match outcome {
        Outcome::Processed { settle: Err(e), .. } => {
            assert!(e.is_retryable(), "{e}");
            assert!(e.to_string().contains("XACK got no answer"), "{e}");
        }
        other => panic!("{other:?}"),
    }

    let next = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
        .await
        .expect("the stream hung on a frozen server");
    match next {
        Some(Err(e @ BrokerError::Timeout { .. })) => {
            assert!(e.is_retryable(), "{e}");
            let BrokerError::Timeout {
                broker,
                action,
                after,
            } = e
            else {
                unreachable!()
            };
            assert_eq!(broker, "redis");
            match action {
                // The block time (at most 200 ms) plus the command timeout.
                "XREADGROUP" => assert!(
                    after > Duration::from_secs(1) && after <= Duration::from_millis(1_200),
                    "{after:?}"
                ),
                "XAUTOCLAIM" | "XPENDING" => assert_eq!(after, Duration::from_secs(1)),
                other => panic!("{other}"),
            }
        }
        Some(Err(e)) => panic!("not a timeout: {e:?}"),
        Some(Ok(_)) => panic!("a delivery from a frozen server"),
        None => panic!("the stream ended without an error"),
    }
}
