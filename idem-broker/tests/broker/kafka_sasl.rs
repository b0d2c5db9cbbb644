//! SASL against a real protocol server: a tansu broker of the test's own with
//! `--authentication` (SASL required before any other request; in-memory storage), on a
//! free loopback port. The `tansu` binary comes from `scripts/ensure-kafka`
//! (`IDEM_TEST_TANSU` names another; `IDEM_TEST_TANSU_LOG=FILE` with `RUST_LOG` keeps
//! the first 16 MiB of its log).
//!
//! tansu 0.6 as installed here cannot accept a SASL client: it offers `SCRAM-SHA-256`,
//! `SCRAM-SHA-512` and `OAUTHBEARER` but not `PLAIN`, and its memory and S3 storage keep
//! no SCRAM users (`tansu user create` answers success, and the SCRAM exchange then ends
//! in `e=unknown-user`). It has no TLS listener either: `tansu broker` refuses `--cert`
//! and `--key` together, and its listener serves plain TCP whatever it is given. So what
//! is tested here is the refusal: the adapter's SCRAM exchange with the broker fails, and
//! so does a client without credentials, each as an error within a bounded time that
//! never shows the password. Settings that reach librdkafka are tested by the unit tests
//! of `kafka::config`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_broker::any::BrokerUrl;
use idem_broker::kafka::{KafkaConfig, KafkaPublisher};
use idem_broker::BrokerError;

const PASSWORD: &str = "s3cret-pw";

fn tansu_binary() -> String {
    std::env::var("IDEM_TEST_TANSU").unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_default();
        let installed = Path::new(&home).join(".cargo/bin/tansu");
        if installed.is_file() {
            installed.display().to_string()
        } else {
            "tansu".to_owned()
        }
    })
}

/// A tansu broker of this test's own with `--authentication`, killed when dropped.
struct Tansu {
    port: u16,
    child: Child,
}

impl Tansu {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let tansu = tansu_binary();
        let listener = format!("tcp://127.0.0.1:{port}");
        let mut cmd = Command::new(&tansu);
        cmd.args(["broker", "--authentication", "--silent"])
            .args(["--listener-url", &listener])
            .args(["--advertised-listener-url", &listener])
            .args(["--storage-engine", "memory://tansu/"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let log = std::env::var("IDEM_TEST_TANSU_LOG").ok();
        if log.is_some() {
            cmd.stdout(Stdio::piped());
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start {tansu} (scripts/ensure-kafka installs it): {e}"));
        if let (Some(log), Some(mut out)) = (log, child.stdout.take()) {
            use std::io::{Read as _, Write as _};
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .unwrap_or_else(|e| panic!("{log}: {e}"));
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut (&mut out).take(16 << 20), &mut file);
                let _ = file.flush();
                let _ = std::io::copy(&mut out, &mut std::io::sink());
            });
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "tansu did not listen on {port}");
            std::thread::sleep(Duration::from_millis(100));
        }
        Self { port, child }
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_sasl_client_fails_in_bounded_time_without_showing_its_password() {
    let tansu = Tansu::start();
    for (what, userinfo, query) in [
        (
            "SCRAM-SHA-256 with a user the broker does not know",
            format!("idem:{PASSWORD}@"),
            "&security.protocol=sasl_plaintext&sasl.mechanism=SCRAM-SHA-256",
        ),
        ("no credentials", String::new(), ""),
    ] {
        let url = format!(
            "kafka://{userinfo}127.0.0.1:{}?group=idem-test-sasl&partitions=1{query}",
            tansu.port
        );
        let config = KafkaConfig::from_url(
            &BrokerUrl::parse(&url).expect("url"),
            format!("idem-test-sasl-{:08x}", rand::random::<u32>()),
        )
        .expect("config");
        assert!(!format!("{config:?}").contains(PASSWORD), "{config:?}");
        let started = Instant::now();
        let refused = tokio::time::timeout(
            Duration::from_secs(60),
            KafkaPublisher::connect_config(&config),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: neither refused nor connected within 60 s"));
        let Err(e) = refused else {
            panic!("{what}: connected")
        };
        assert!(matches!(e, BrokerError::Connect { .. }), "{what}: {e:?}");
        let text = format!("{e} {e:?}");
        assert!(!text.contains(PASSWORD), "{what}: {text}");
        eprintln!("{what}: refused after {:?}: {e:?}", started.elapsed());
    }
}
