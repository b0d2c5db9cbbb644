//! `idem` against servers that speak TLS only, started by these tests with their own CA
//! (`idem_test_support::tls`): a Postgres cluster with `ssl = on` and only `hostssl` entries,
//! and per test one broker — Redis with only a TLS port, NATS with `--tls`, a RabbitMQ
//! node whose only listener is TLS. `idem migrate`, `publish`, `consume` and `relay` run
//! end to end with verification on; with another CA each is refused, and nothing is
//! written.
//!
//! The brokers' trusted roots come from `SSL_CERT_FILE` (Redis Streams, NATS) or the
//! URL's `cacertfile` (RabbitMQ); the store's from `sslrootcert`. Each command runs with
//! its own environment.

use std::path::Path;
use std::process::{Command, Output};

use idem_test_support::tls::{Pki, TlsServer};

use crate::common;

use common::{ok, output_within, report_value, tag, text, COMMAND_LIMIT};

/// `idem ARGS` trusting only `ca` through `SSL_CERT_FILE`.
fn idem_trusting(ca: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args)
        .env("SSL_CERT_FILE", ca)
        .env_remove("SSL_CERT_DIR")
        .env_remove("IDEM_STORE")
        .env_remove("IDEM_BROKER")
        .env_remove("DATABASE_URL");
    output_within(&mut cmd, COMMAND_LIMIT)
}

/// The TLS-only Postgres at `port`, verifying its certificate against `ca`.
fn store_url(port: u16, ca: &Path) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{port}/postgres?sslmode=verify-full&sslrootcert={}",
        ca.display()
    )
}

/// Three submissions in a file under `dir`.
fn submissions(dir: &Path, t: &str) -> String {
    let lines: Vec<String> = (0..3)
        .map(|i| {
            format!(
                r#"{{"award_id": "TLS-{t}-{i}", "submission_timestamp": "2026-07-01T09:00:00Z", "amount_cents": {}}}"#,
                100 + i
            )
        })
        .collect();
    let path = dir.join("submissions.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").expect("write submissions");
    path.to_string_lossy().into_owned()
}

/// Migrate, publish, consume and relay over TLS with `broker(ca)`; then the same store
/// and broker trusting another CA are refused.
fn end_to_end(pki: &Pki, pg: &TlsServer, broker: impl Fn(&Path) -> String) {
    let t = tag();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = submissions(dir.path(), &t);
    let (source, out) = (format!("idem-tls-in-{t}"), format!("idem-tls-out-{t}"));
    let store = store_url(pg.port, &pki.ca);
    let b = broker(&pki.ca);
    let run = |args: &[&str]| idem_trusting(&pki.ca, args);
    ok(&run(&["migrate", "--store", &store]), "migrate over TLS");
    ok(
        &run(&[
            "publish",
            "--broker",
            &b,
            "--destination",
            &source,
            "--file",
            &file,
        ]),
        "publish over TLS",
    );
    let consumed = ok(
        &run(&[
            "consume",
            "--broker",
            &b,
            "--source",
            &source,
            "--store",
            &store,
            "--exit-when-idle",
            "3",
        ]),
        "consume over TLS",
    );
    assert_eq!(report_value(&consumed, "processed"), 3, "{consumed}");
    let relayed = ok(
        &run(&[
            "relay",
            "--store",
            &store,
            "--broker",
            &b,
            "--destination",
            &out,
            "--exit-when-idle",
            "3",
        ]),
        "relay over TLS",
    );
    assert_eq!(report_value(&relayed, "published"), 3, "{relayed}");

    // Another CA: the store refuses to migrate, the consumer to connect.
    let wrong_store = store_url(pg.port, &pki.other_ca);
    let wrong_broker = broker(&pki.other_ca);
    let wrong = |args: &[&str]| idem_trusting(&pki.other_ca, args);
    let o = wrong(&["migrate", "--store", &wrong_store]);
    assert!(
        !o.status.success(),
        "migrate trusting another CA: {}",
        text(&o.stdout)
    );
    let o = wrong(&[
        "consume",
        "--broker",
        &wrong_broker,
        "--source",
        &source,
        "--store",
        &store,
        "--exit-when-idle",
        "3",
        "--reconnect-timeout",
        "3",
    ]);
    assert!(
        !o.status.success(),
        "consume trusting another CA for the broker: {}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
}

#[test]
fn redis_streams_and_postgres_over_tls() {
    let pki = Pki::new();
    let pg = TlsServer::postgres(&pki);
    let redis = TlsServer::redis(&pki);
    end_to_end(&pki, &pg, |_| format!("rediss://127.0.0.1:{}", redis.port));
}

#[test]
fn nats_and_postgres_over_tls() {
    let pki = Pki::new();
    let pg = TlsServer::postgres(&pki);
    let nats = TlsServer::nats(&pki);
    end_to_end(&pki, &pg, |_| format!("tls://127.0.0.1:{}", nats.port));
}

#[test]
fn rabbitmq_and_postgres_over_tls() {
    let pki = Pki::new();
    let pg = TlsServer::postgres(&pki);
    let rabbit = TlsServer::rabbitmq(&pki);
    end_to_end(&pki, &pg, |ca| {
        format!(
            "amqps://guest:guest@127.0.0.1:{}/%2f?cacertfile={}",
            rabbit.port,
            ca.display()
        )
    });
}
