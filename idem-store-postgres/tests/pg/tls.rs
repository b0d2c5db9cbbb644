//! TLS to Postgres: a throwaway cluster with `ssl = on` that takes TLS connections only
//! (`hostssl`), its certificate signed by a CA made here; and one with `ssl = off`.
//!
//! - `sslmode=verify-full` with `sslrootcert` naming the CA: a key is claimed and
//!   committed. `sslmode=require` / `verify-ca` / `verify-full` with another CA:
//!   refused (`require` with a root certificate verifies the chain, as in libpq).
//! - `sslmode=require` at the server without TLS: refused (never plaintext).
//! - `sslmode=disable` at the TLS-only server: refused by the server, which shows the
//!   connections above did use TLS.
//!
//! Without the `tls` feature every URL that requires TLS is refused.

use std::path::Path;
use std::time::Duration;

use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
use idem_store_postgres::{PgConfig, PgStore};
use idem_test_support::tls::{Pki, TlsServer};

fn url(port: u16, query: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/postgres?{query}")
}

/// A file path for the URL query (the test's paths hold no character to escape).
fn root(path: &Path) -> String {
    let s = path.to_string_lossy().into_owned();
    assert!(!s.contains(['&', '%', '#', '?', ' ']), "{s}");
    s
}

async fn connect(url: &str) -> Result<PgStore, String> {
    let config = PgConfig::new(format!("idem_tls_{:08x}", rand::random::<u32>()))
        .expect("schema")
        .with_max_connections(2)
        .with_acquire_timeout(Duration::from_secs(20));
    match tokio::time::timeout(Duration::from_secs(60), PgStore::connect(url, config)).await {
        Err(_) => Err("timed out".to_owned()),
        Ok(r) => r.map_err(|e| chain(&e)),
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out += &format!(": {s}");
        next = s.source();
    }
    out
}

/// Migrates, claims a key and commits; the second claim is a duplicate.
async fn claims_over(store: &PgStore) {
    store.migrate().await.expect("migrate over TLS");
    let key = IdempotencyKey::derive("tls-1", "2026-07-01T09:00:00Z", b"{}").expect("key");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&key, &ClaimMeta::new("tls-1"))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");
    let mut again = store.begin().await.expect("begin");
    assert_eq!(
        again
            .claim(&key, &ClaimMeta::new("tls-1"))
            .await
            .expect("claim"),
        ClaimOutcome::Duplicate
    );
    again.rollback().await.expect("rollback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verified_tls_with_the_right_ca_claims_and_another_ca_is_refused() {
    let pki = Pki::new();
    let server = TlsServer::postgres(&pki);
    let port = server.port;

    let good = url(
        port,
        &format!("sslmode=verify-full&sslrootcert={}", root(&pki.ca)),
    );
    if cfg!(feature = "tls") {
        let store = connect(&good)
            .await
            .unwrap_or_else(|e| panic!("verify-full with the server's CA must connect: {e}"));
        claims_over(&store).await;
        store.pool().close().await;
    } else {
        let err = connect(&good)
            .await
            .map(drop)
            .expect_err("no TLS compiled in: refused");
        assert!(err.contains("TLS"), "{err}");
    }

    // `require` with a root certificate verifies the chain, as libpq does (sqlx alone
    // verified nothing: another CA's certificate was accepted).
    for mode in ["require", "verify-ca", "verify-full"] {
        let wrong = url(
            port,
            &format!("sslmode={mode}&sslrootcert={}", root(&pki.other_ca)),
        );
        let err = connect(&wrong)
            .await
            .err()
            .unwrap_or_else(|| panic!("sslmode={mode} with another CA connected"));
        eprintln!("{mode} with another CA: {err}");
    }

    // The server takes TLS connections only: a plaintext one is refused.
    let err = connect(&url(port, "sslmode=disable"))
        .await
        .map(drop)
        .expect_err("the server refuses plaintext connections");
    assert!(
        err.contains("no encryption") || err.contains("pg_hba"),
        "{err}"
    );
}

/// The store's TLS configuration names ring itself: a verified TLS connection installs no
/// process-wide rustls provider, so an application that installs its own afterwards (or
/// compiles aws-lc-rs in beside ring) gets no error.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_connection_installs_no_process_wide_crypto_provider() {
    let pki = Pki::new();
    let server = TlsServer::postgres(&pki);
    let good = url(
        server.port,
        &format!("sslmode=verify-full&sslrootcert={}", root(&pki.ca)),
    );
    let store = connect(&good)
        .await
        .unwrap_or_else(|e| panic!("verify-full with the server's CA must connect: {e}"));
    claims_over(&store).await;
    store.pool().close().await;
    assert!(
        rustls::crypto::CryptoProvider::get_default().is_none(),
        "connecting installed a process-wide crypto provider"
    );
    assert!(
        rustls::crypto::ring::default_provider()
            .install_default()
            .is_ok(),
        "the application's own provider must install"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_required_at_a_server_without_tls_is_refused() {
    let server = TlsServer::postgres_without_tls();
    let port = server.port;
    // The cluster is reachable in plaintext ...
    let store = connect(&url(port, "sslmode=disable"))
        .await
        .unwrap_or_else(|e| panic!("the plaintext cluster must be reachable: {e}"));
    store.pool().close().await;
    // ... and every mode that requires TLS is refused, never downgraded.
    for mode in ["require", "verify-ca", "verify-full"] {
        let err = connect(&url(port, &format!("sslmode={mode}")))
            .await
            .err()
            .unwrap_or_else(|| panic!("sslmode={mode} connected in plaintext"));
        eprintln!("sslmode={mode} at a server without TLS: {err}");
    }
}

/// Over TLS a transaction costs its round trips, not Nagle's algorithm: a statement larger
/// than one TLS record (16 KiB: a batch's claims, a batch's rows and outbox events) leaves
/// as several writes, and the last, small one must not wait for the server's delayed ACK
/// (40 ms on Linux). The socket needs `TCP_NODELAY`, which sqlx 0.9.0 dropped and 0.9.1
/// sets again: with 0.9.0 every transaction here took over 40 ms, and `idem demo
/// --batch-size 100` against a local Postgres with TLS (`sslmode=prefer`, the default, on a
/// server with `ssl = on`) ran at a quarter of its speed. The median of 15 transactions
/// claiming 400 keys each (a few round trips of under a millisecond on loopback) must stay
/// well under those 40 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_over_tls_never_waits_for_a_delayed_ack() {
    let pki = Pki::new();
    let server = TlsServer::postgres(&pki);
    let store = connect(&url(
        server.port,
        &format!("sslmode=verify-full&sslrootcert={}", root(&pki.ca)),
    ))
    .await
    .expect("connect over TLS");
    store.migrate().await.expect("migrate over TLS");
    let mut took = Vec::new();
    for round in 0..16 {
        let items: Vec<(IdempotencyKey, ClaimMeta)> = (0..400)
            .map(|i| {
                let award = format!("N-{round}-{i}");
                let key =
                    IdempotencyKey::derive(&award, "2026-07-01T09:00:00Z", b"{}").expect("key");
                (
                    key,
                    ClaimMeta::new(&award).with_submission_timestamp("2026-07-01T09:00:00Z"),
                )
            })
            .collect();
        let started = std::time::Instant::now();
        let mut tx = store.begin().await.expect("begin");
        let claims = tx.claim_batch(&items).await.expect("claim");
        assert!(claims.iter().all(|c| *c == ClaimOutcome::Claimed));
        tx.commit().await.expect("commit");
        // The first transaction also prepares its statements.
        if round > 0 {
            took.push(started.elapsed());
        }
    }
    took.sort();
    let median = took[took.len() / 2];
    assert!(
        median < Duration::from_millis(30),
        "median batch claim transaction over TLS took {median:?} (all: {took:?}): \
         Nagle's algorithm held a TLS record back (no TCP_NODELAY on the socket)"
    );
}
