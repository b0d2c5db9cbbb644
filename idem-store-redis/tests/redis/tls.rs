//! TLS to Redis, for the lease store and the front filter, with each enabled client.
//!
//! - `rediss://` pointed at the plaintext port of the local Redis fails: with the `tls`
//!   feature the handshake fails, without it the URL is refused naming the feature. It
//!   never connects in plain TCP.
//! - Against a `redis-server` with only a TLS port, started here with certificates from a
//!   throwaway CA: with `cacertfile` naming that CA a key is claimed; with another CA the
//!   connection is refused.
//! - fred is handed a rustls configuration that names the `ring` provider: after claims
//!   over TLS no process-wide provider is installed, and the application's own installs.
//!   redis-rs takes no configuration and builds one from the process default at each TLS
//!   connection, so one is installed for it then, and only then. Each of these tests has
//!   its process to itself (nextest), so nothing else installed a provider before.

use crate::common;

use std::time::Duration;

use common::{fresh_prefix, key};
use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, DoneFilter};
use idem_store_redis::{ClientKind, RedisConfig, RedisFilter, RedisLeaseStore};
use idem_test_support::tls::{Pki, TlsServer};

fn config(kind: ClientKind, url: &str, tag: &str) -> RedisConfig {
    RedisConfig::new(url)
        .with_key_prefix(fresh_prefix(tag))
        .with_timeout(Duration::from_secs(3))
        .with_client(kind)
}

/// An error with its sources.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out += &format!(": {s}");
        next = s.source();
    }
    out
}

/// What connecting the store, the filter and a lazy filter (its first command) answered;
/// `Ok` means it connected.
async fn attempts(kind: ClientKind, url: &str) -> Vec<(&'static str, Result<(), String>)> {
    let bounded = Duration::from_secs(60);
    let store = tokio::time::timeout(bounded, RedisLeaseStore::connect(config(kind, url, "s")))
        .await
        .map_or_else(
            |_| Err("timed out".to_owned()),
            |r| r.map(drop).map_err(|e| chain(&e)),
        );
    let filter = tokio::time::timeout(bounded, RedisFilter::connect(config(kind, url, "f")))
        .await
        .map_or_else(
            |_| Err("timed out".to_owned()),
            |r| r.map(drop).map_err(|e| chain(&e)),
        );
    let lazy = match RedisFilter::connect_lazy(config(kind, url, "l")).await {
        Err(e) => Err(chain(&e)),
        Ok(f) => {
            // Give the background connection time to come up, were it to.
            tokio::time::sleep(Duration::from_secs(1)).await;
            f.seen(&[key("lazy")])
                .await
                .map(drop)
                .map_err(|e| chain(&e))
        }
    };
    vec![
        ("lease store", store),
        ("filter", filter),
        ("lazy filter", lazy),
    ]
}

/// `rediss://` at the plaintext port: every role fails.
async fn rediss_at_the_plaintext_port_fails(kind: ClientKind) {
    let url = "rediss://127.0.0.1:6379";
    for (role, result) in attempts(kind, url).await {
        let err = result.err().unwrap_or_else(|| {
            panic!(
                "the {role} ({kind:?}) connected to {url} in plain TCP: a TLS URL was downgraded"
            )
        });
        if !cfg!(feature = "tls") {
            assert!(
                err.contains("\"tls\" feature"),
                "the {role}'s ({kind:?}) refusal should name the missing feature: {err}"
            );
        }
        eprintln!("{role} ({kind:?}) at {url}: {err}");
    }
}

/// Claims a key through a lease store on `url`, commits, and sees it marked done through a
/// filter on the same URL.
async fn claims_over(kind: ClientKind, url: &str) -> Result<(), String> {
    let work = async {
        let store = RedisLeaseStore::connect(config(kind, url, "tls"))
            .await
            .map_err(|e| format!("lease store: {}", chain(&e)))?;
        let k = key("tls-1");
        let mut tx = store.begin().await.map_err(|e| chain(&e))?;
        let outcome = tx
            .claim(&k, &ClaimMeta::new("tls-1"))
            .await
            .map_err(|e| chain(&e))?;
        assert_eq!(outcome, ClaimOutcome::Claimed);
        tx.commit().await.map_err(|e| chain(&e))?;
        let filter = RedisFilter::connect(config(kind, url, "tlsf"))
            .await
            .map_err(|e| format!("filter: {}", chain(&e)))?;
        filter.mark_done(&[k]).await.map_err(|e| chain(&e))?;
        assert_eq!(filter.seen(&[k]).await.map_err(|e| chain(&e))?, vec![true]);
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(60), work)
        .await
        .map_err(|_| "timed out".to_owned())?
}

/// `rediss://` with `cacertfile` naming the server's CA claims a key; naming another CA
/// it is refused; without TLS compiled in it is refused naming the feature.
async fn tls_with_the_right_ca_and_not_another(kind: ClientKind) {
    let pki = Pki::new();
    let server = TlsServer::redis(&pki);
    let base = format!("rediss://127.0.0.1:{}", server.port);
    let good = format!("{base}/?cacertfile={}", pki.ca.display());
    let result = claims_over(kind, &good).await;
    if cfg!(feature = "tls") {
        result.unwrap_or_else(|e| panic!("{kind:?}: {good} must work: {e}"));
    } else {
        let err = result.expect_err("no TLS compiled in: refused");
        assert!(err.contains("\"tls\" feature"), "{err}");
    }
    let wrong = format!("{base}/?cacertfile={}", pki.other_ca.display());
    for (role, result) in attempts(kind, &wrong).await {
        let err = result.err().unwrap_or_else(|| {
            panic!("the {role} ({kind:?}) trusting another CA connected to {base}")
        });
        eprintln!("{role} ({kind:?}) trusting another CA: {err}");
    }
}

/// A server that requires client certificates: with `certfile` and `keyfile` a key is
/// claimed; without them the server refuses the connection.
async fn client_certificates_are_sent(kind: ClientKind) {
    let pki = Pki::new();
    let server = TlsServer::redis_requiring_client_certificates(&pki);
    let base = format!(
        "rediss://127.0.0.1:{}/?cacertfile={}",
        server.port,
        pki.ca.display()
    );
    let with = format!(
        "{base}&certfile={}&keyfile={}",
        pki.client_cert.display(),
        pki.client_key.display()
    );
    if !cfg!(feature = "tls") {
        return;
    }
    claims_over(kind, &with)
        .await
        .unwrap_or_else(|e| panic!("{kind:?}: {with} must work: {e}"));
    let err = claims_over(kind, &base)
        .await
        .expect_err("a server requiring client certificates took a client without one");
    eprintln!("{kind:?} without a client certificate: {err}");
}

/// TLS files are refused on a `redis://` URL, and a certificate needs its key.
#[test]
fn tls_files_need_a_tls_url() {
    for url in [
        "redis://127.0.0.1:6379/?cacertfile=/ca.pem",
        "rediss://127.0.0.1:6379/?certfile=/c.pem",
        "rediss://127.0.0.1:6379/?keyfile=/k.pem",
        "rediss://127.0.0.1:6379/?cacertfile=/a.pem&cacertfile=/b.pem",
    ] {
        assert!(RedisConfig::new(url).validate().is_err(), "{url}");
    }
}

/// fred over TLS, with the CA from the URL and with the system's roots (`SSL_CERT_FILE`,
/// set for this test's own process), a client certificate each time: no process-wide
/// provider is installed, and the application's own installs afterwards.
#[cfg(all(feature = "tls", feature = "fred"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fred_over_tls_installs_no_process_wide_crypto_provider() {
    let pki = Pki::new();
    let server = TlsServer::redis_requiring_client_certificates(&pki);
    std::env::set_var("SSL_CERT_FILE", &pki.ca);
    let cert = format!(
        "certfile={}&keyfile={}",
        pki.client_cert.display(),
        pki.client_key.display()
    );
    for query in [format!("cacertfile={}&{cert}", pki.ca.display()), cert] {
        let url = format!("rediss://127.0.0.1:{}/?{query}", server.port);
        claims_over(ClientKind::Fred, &url)
            .await
            .unwrap_or_else(|e| panic!("{url} must work: {e}"));
    }
    assert!(
        rustls::crypto::CryptoProvider::get_default().is_none(),
        "connecting fred over TLS installed a process-wide rustls crypto provider"
    );
    assert!(
        rustls::crypto::ring::default_provider()
            .install_default()
            .is_ok(),
        "the application's own provider must install"
    );
}

/// redis-rs builds the rustls configuration of each TLS connection from the process
/// default (it takes none): a provider is installed for it just before such a connection,
/// and never for one in plain TCP, whether the URL or the application made the client.
#[cfg(all(feature = "tls", feature = "redis-rs"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_rs_installs_a_process_wide_provider_for_tls_only() {
    let none_yet = |when: &str| {
        assert!(
            rustls::crypto::CryptoProvider::get_default().is_none(),
            "{when} installed a process-wide rustls crypto provider"
        );
    };
    let plain = common::redis_url();
    claims_over(ClientKind::RedisRs, &plain)
        .await
        .unwrap_or_else(|e| panic!("{plain} must work: {e}"));
    none_yet("a redis-rs connection in plain TCP");
    let client = idem_store_redis::redis::Client::open(plain.as_str()).expect("a client");
    let store = RedisLeaseStore::from_client(
        idem_store_redis::RedisClient::RedisRs(client),
        config(ClientKind::RedisRs, &plain, "own"),
    )
    .await
    .unwrap_or_else(|e| panic!("the application's plain client: {}", chain(&e)));
    let mut tx = store.begin().await.expect("begin");
    tx.claim(&key("own-1"), &ClaimMeta::new("own-1"))
        .await
        .expect("claim");
    tx.commit().await.expect("commit");
    none_yet("the application's own redis-rs client in plain TCP");

    let pki = Pki::new();
    let server = TlsServer::redis(&pki);
    let url = format!(
        "rediss://127.0.0.1:{}/?cacertfile={}",
        server.port,
        pki.ca.display()
    );
    claims_over(ClientKind::RedisRs, &url)
        .await
        .unwrap_or_else(|e| panic!("{url} must work: {e}"));
    assert!(
        rustls::crypto::CryptoProvider::get_default().is_some(),
        "redis-rs spoke TLS: it built its configuration from a process-wide provider"
    );
}

/// An application that installs its own provider before redis-rs connects over TLS keeps
/// it (here ring with one cipher suite, told apart by that): redis-rs speaks TLS with it.
#[cfg(all(feature = "tls", feature = "redis-rs"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_rs_over_tls_keeps_the_applications_own_provider() {
    let ring = rustls::crypto::ring::default_provider();
    let own = rustls::crypto::CryptoProvider {
        cipher_suites: vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256],
        ..ring
    };
    own.install_default()
        .expect("nothing installed a provider before");
    let pki = Pki::new();
    let server = TlsServer::redis(&pki);
    let url = format!(
        "rediss://127.0.0.1:{}/?cacertfile={}",
        server.port,
        pki.ca.display()
    );
    claims_over(ClientKind::RedisRs, &url)
        .await
        .unwrap_or_else(|e| panic!("{url} must work: {e}"));
    let installed = rustls::crypto::CryptoProvider::get_default().expect("the application's");
    assert_eq!(
        installed.cipher_suites.len(),
        1,
        "the application's provider was replaced"
    );
}

per_client!(
    rediss_at_the_plaintext_port_fails,
    tls_with_the_right_ca_and_not_another,
    client_certificates_are_sent,
);
