//! TLS on the broker adapters.
//!
//! - A URL that asks for TLS (`amqps://`, `rediss://`, NATS `tls://`) pointed at the
//!   plaintext port of the local RabbitMQ, Redis or NATS fails: with the `tls` feature the
//!   handshake fails, without it the URL is refused naming the feature. It never connects
//!   in plain TCP.
//! - Against servers with a TLS listener that these tests start (Redis, NATS with
//!   JetStream, a RabbitMQ node with only a TLS listener; certificates from a throwaway
//!   CA), a client that trusts the CA publishes and consumes; one that trusts another CA
//!   is refused. The trusted roots come from
//!   `SSL_CERT_FILE`, which each test sets for its own process (nextest runs every test in
//!   a process of its own).
//! - Each adapter hands its client a rustls configuration that names the `ring` provider:
//!   after a round trip over TLS no process-wide provider is installed, and the
//!   application's own installs (each such test has its process to itself, so nothing
//!   else installed one before).

use std::time::Duration;

use futures::StreamExt;
use idem_broker::any::{AnyConsumer, AnyPublisher, BrokerUrl};
use idem_test_support::tls::{Pki, TlsServer};

fn name(tag: &str) -> String {
    format!("idem-tls-{tag}-{:016x}", rand::random::<u64>())
}

/// What the connection attempt answered: `Ok` means it connected (the bug).
async fn connect_publisher(url: &str, name: &str) -> Result<(), String> {
    let parsed = BrokerUrl::parse(url).map_err(|e| format!("parse: {e}"))?;
    let connecting = AnyPublisher::connect(&parsed, name);
    match tokio::time::timeout(Duration::from_secs(60), connecting).await {
        Err(_) => Err("timed out".to_owned()),
        Ok(Err(e)) => Err(format!("{e}: {}", source_chain(&e))),
        Ok(Ok(_)) => Ok(()),
    }
}

async fn connect_consumer(url: &str, name: &str) -> Result<(), String> {
    let parsed = BrokerUrl::parse(url).map_err(|e| format!("parse: {e}"))?;
    let connecting = AnyConsumer::connect(&parsed, name, 8);
    match tokio::time::timeout(Duration::from_secs(60), connecting).await {
        Err(_) => Err("timed out".to_owned()),
        Ok(Err(e)) => Err(format!("{e}: {}", source_chain(&e))),
        Ok(Ok(_)) => Ok(()),
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = Vec::new();
    let mut next = e.source();
    while let Some(s) = next {
        out.push(s.to_string());
        next = s.source();
    }
    out.join(": ")
}

/// Both roles refuse `url` (a TLS URL at a plaintext port); without the `tls` feature the
/// error names it.
async fn refused_at_plaintext_port(url: &str, tag: &str) {
    let name = name(tag);
    for (role, result) in [
        ("publisher", connect_publisher(url, &name).await),
        ("consumer", connect_consumer(url, &name).await),
    ] {
        let err = result.err().unwrap_or_else(|| {
            panic!("the {role} connected to {url} in plain TCP: a TLS URL was downgraded")
        });
        if !cfg!(feature = "tls") && !url.starts_with("tls://") {
            assert!(
                err.contains("\"tls\" feature"),
                "the {role}'s refusal of {url} should name the missing feature: {err}"
            );
        }
        eprintln!("{role} at {url}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_at_the_plaintext_port_fails() {
    refused_at_plaintext_port("amqps://guest:guest@127.0.0.1:5672/%2f", "amqps").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_at_the_plaintext_port_fails() {
    refused_at_plaintext_port("rediss://127.0.0.1:6379", "rediss").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_tls_at_the_plaintext_port_fails() {
    refused_at_plaintext_port("tls://127.0.0.1:4222", "natstls").await;
}

/// Publishes one body to `name` at `url` and receives it back.
async fn round_trip(url: &str, name: &str) -> Result<(), String> {
    let parsed = BrokerUrl::parse(url).map_err(|e| format!("parse: {e}"))?;
    let work = async {
        let publisher = AnyPublisher::connect(&parsed, name)
            .await
            .map_err(|e| format!("publisher: {e}: {}", source_chain(&e)))?;
        let mut consumer = AnyConsumer::connect(&parsed, name, 8)
            .await
            .map_err(|e| format!("consumer: {e}: {}", source_chain(&e)))?;
        publisher
            .publish_raw(&[b"over TLS".to_vec()])
            .await
            .map_err(|e| format!("publish: {e}: {}", source_chain(&e)))?;
        let delivery = consumer
            .next()
            .await
            .ok_or("the stream ended")?
            .map_err(|e| format!("consume: {e}"))?;
        // Received over TLS; acking needs a gate's proof, so the delivery is dropped.
        assert_eq!(delivery.payload, b"over TLS");
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(60), work)
        .await
        .map_err(|_| "timed out".to_owned())?
}

/// The trusted roots for this test's process: only `ca` (rustls-native-certs reads
/// `SSL_CERT_FILE` instead of the system's store). Each test runs in its own process
/// under nextest, and sets it before any connection.
fn trust_only(ca: &std::path::Path) {
    std::env::set_var("SSL_CERT_FILE", ca);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_over_tls_with_the_right_ca_and_not_another() {
    let pki = Pki::new();
    let server = TlsServer::redis(&pki);
    let url = format!("rediss://127.0.0.1:{}", server.port);
    trust_only(&pki.ca);
    let result = round_trip(&url, &name("rstls")).await;
    if cfg!(feature = "tls") {
        result.unwrap_or_else(|e| panic!("rediss:// with the server's CA: {e}"));
    } else {
        let err = result.expect_err("no TLS compiled in: refused");
        assert!(err.contains("\"tls\" feature"), "{err}");
    }
    trust_only(&pki.other_ca);
    let err = round_trip(&url, &name("rstls"))
        .await
        .expect_err("rediss:// trusting another CA connected");
    eprintln!("another CA: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_over_tls_with_the_right_ca_and_not_another() {
    let pki = Pki::new();
    let server = TlsServer::nats(&pki);
    trust_only(&pki.ca);
    // `tls://` asks for TLS; a `nats://` URL gets it too, from a server that requires it.
    for scheme in ["tls", "nats"] {
        let url = format!("{scheme}://127.0.0.1:{}", server.port);
        round_trip(&url, &name("natstls"))
            .await
            .unwrap_or_else(|e| panic!("{url} with the server's CA: {e}"));
    }
    trust_only(&pki.other_ca);
    let url = format!("tls://127.0.0.1:{}", server.port);
    let err = round_trip(&url, &name("natstls"))
        .await
        .expect_err("tls:// trusting another CA connected");
    eprintln!("another CA: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_the_right_ca_and_not_another() {
    let pki = Pki::new();
    let server = TlsServer::rabbitmq(&pki);
    // The system's roots hold neither CA: only the URL's `cacertfile` can make it trusted.
    trust_only(&pki.other_ca);
    let url = |ca: &std::path::Path| {
        format!(
            "amqps://guest:guest@127.0.0.1:{}/%2f?cacertfile={}",
            server.port,
            ca.display()
        )
    };
    let result = round_trip(&url(&pki.ca), &name("amqpstls")).await;
    if cfg!(feature = "tls") {
        result.unwrap_or_else(|e| panic!("amqps:// with the server's CA: {e}"));
    } else {
        let err = result.expect_err("no TLS compiled in: refused");
        assert!(err.contains("\"tls\" feature"), "{err}");
    }
    let err = round_trip(&url(&pki.other_ca), &name("amqpstls"))
        .await
        .expect_err("amqps:// trusting another CA connected");
    eprintln!("another CA: {err}");
    // The node has no plaintext listener: `amqp://` at its TLS port never connects.
    let plain = format!("amqp://guest:guest@127.0.0.1:{}/%2f", server.port);
    let err = round_trip(&plain, &name("amqpstls"))
        .await
        .expect_err("amqp:// at a TLS-only port connected");
    eprintln!("plaintext at the TLS port: {err}");
}

/// NATS with a token, then with a user and password: the right ones in the URL's user
/// part publish and consume; wrong ones and none are refused. (async-nats 0.51 ignores a
/// URL's user part: idem sends it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_with_a_token() {
    let server = TlsServer::nats_with_config("authorization { token: \"s3cr3t-t0ken\" }");
    let at = |auth: &str| format!("nats://{auth}127.0.0.1:{}", server.port);
    round_trip(&at("s3cr3t-t0ken@"), &name("natstoken"))
        .await
        .unwrap_or_else(|e| panic!("the right token: {e}"));
    for wrong in ["other@", ""] {
        let err = round_trip(&at(wrong), &name("natstoken"))
            .await
            .expect_err("a wrong token or none connected");
        assert!(
            !err.contains("s3cr3t-t0ken"),
            "the token is never shown: {err}"
        );
    }
    let server =
        TlsServer::nats_with_config("authorization { user: \"idem\", password: \"p@ss w0rd\" }");
    let at = |auth: &str| format!("nats://{auth}127.0.0.1:{}", server.port);
    round_trip(&at("idem:p%40ss%20w0rd@"), &name("natsuser"))
        .await
        .unwrap_or_else(|e| panic!("the right user and password: {e}"));
    for wrong in ["idem:other@", "idem@", ""] {
        round_trip(&at(wrong), &name("natsuser"))
            .await
            .expect_err("a wrong password or none connected");
    }
}

/// NATS with nkeys: a URL whose `nkey` file holds the user's seed publishes and
/// consumes; another user's seed and no seed are refused; an unreadable or seedless file
/// is the caller's mistake, named before any connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_with_an_nkey_seed_file() {
    let user = nkeys::KeyPair::new_user();
    let other = nkeys::KeyPair::new_user();
    let server = TlsServer::nats_with_config(&format!(
        "authorization {{ users = [ {{ nkey: \"{}\" }} ] }}",
        user.public_key()
    ));
    let dir = tempfile::tempdir().expect("tempdir");
    let seed_file = |kp: &nkeys::KeyPair, file: &str| {
        let path = dir.path().join(file);
        std::fs::write(&path, format!("{}\n", kp.seed().expect("a seed"))).expect("write seed");
        path
    };
    let (right, wrong) = (seed_file(&user, "user.nk"), seed_file(&other, "other.nk"));
    let url = |q: &str| format!("nats://127.0.0.1:{}{q}", server.port);
    round_trip(
        &url(&format!("?nkey={}", right.display())),
        &name("natsnkey"),
    )
    .await
    .unwrap_or_else(|e| panic!("the user's seed: {e}"));
    for q in [format!("?nkey={}", wrong.display()), String::new()] {
        round_trip(&url(&q), &name("natsnkey"))
            .await
            .expect_err("another seed, or none, connected");
    }
    let seedless = dir.path().join("empty.nk");
    std::fs::write(&seedless, "no seed here\n").expect("write");
    for (q, says) in [
        (format!("?nkey={}", seedless.display()), "no user nkey seed"),
        (
            format!("?nkey={}", dir.path().join("missing.nk").display()),
            "cannot read",
        ),
        (
            format!("?creds={}", seedless.display()),
            "not a credentials file",
        ),
    ] {
        let err = round_trip(&url(&q), &name("natsnkey"))
            .await
            .expect_err("a bad file connected");
        assert!(err.contains(says), "{q}: {err}");
    }
}

/// NATS over TLS with the CA named in the URL (`cacertfile`) rather than the process's
/// roots: trusted; `cacertfile` naming another CA: refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_over_tls_with_the_ca_in_the_url() {
    let pki = Pki::new();
    let server = TlsServer::nats(&pki);
    trust_only(&pki.other_ca);
    let url = |ca: &std::path::Path| {
        format!(
            "tls://127.0.0.1:{}?cacertfile={}",
            server.port,
            ca.display()
        )
    };
    round_trip(&url(&pki.ca), &name("natsca"))
        .await
        .unwrap_or_else(|e| panic!("cacertfile with the server's CA: {e}"));
    round_trip(&url(&pki.other_ca), &name("natsca"))
        .await
        .expect_err("cacertfile naming another CA connected");
}

/// After a connection over TLS: rustls has no process-wide provider, and the application
/// can install its own.
fn no_process_wide_provider(adapter: &str) {
    assert!(
        rustls::crypto::CryptoProvider::get_default().is_none(),
        "{adapter}: connecting over TLS installed a process-wide rustls crypto provider"
    );
    assert!(
        rustls::crypto::ring::default_provider()
            .install_default()
            .is_ok(),
        "{adapter}: the application's own provider must install"
    );
}

#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_streams_over_tls_installs_no_process_wide_crypto_provider() {
    let pki = Pki::new();
    let server = TlsServer::redis(&pki);
    trust_only(&pki.ca);
    let url = format!("rediss://127.0.0.1:{}", server.port);
    round_trip(&url, &name("rsprov"))
        .await
        .unwrap_or_else(|e| panic!("{url} with the server's CA: {e}"));
    no_process_wide_provider("Redis Streams");
}

/// Both ways to TLS: `tls://` trusting the process's roots, and a `nats://` URL whose
/// server requires TLS, trusting the URL's `cacertfile`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_over_tls_installs_no_process_wide_crypto_provider() {
    let pki = Pki::new();
    let server = TlsServer::nats(&pki);
    trust_only(&pki.ca);
    for url in [
        format!("tls://127.0.0.1:{}", server.port),
        format!(
            "nats://127.0.0.1:{}?cacertfile={}",
            server.port,
            pki.ca.display()
        ),
    ] {
        round_trip(&url, &name("natsprov"))
            .await
            .unwrap_or_else(|e| panic!("{url} with the server's CA: {e}"));
    }
    no_process_wide_provider("NATS");
}

#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_installs_no_process_wide_crypto_provider() {
    let pki = Pki::new();
    let server = TlsServer::rabbitmq(&pki);
    trust_only(&pki.other_ca);
    let url = format!(
        "amqps://guest:guest@127.0.0.1:{}/%2f?cacertfile={}",
        server.port,
        pki.ca.display()
    );
    round_trip(&url, &name("amqpsprov"))
        .await
        .unwrap_or_else(|e| panic!("{url} with the server's CA: {e}"));
    no_process_wide_provider("RabbitMQ");
}
