//! Helpers shared by the tests that drive the `idem` binary on real services. Each test
//! binary uses a subset of them.
#![allow(dead_code)]

use std::process::{Command, Output};
use std::time::Duration;

use futures::StreamExt as _;
use idem_broker::any::{AnyConsumer, BrokerUrl};
use idem_broker::{until_idle, DEAD_LETTER_REASON_HEADER};

/// RabbitMQ: `IDEM_TEST_AMQP_URL`, default the local server.
pub(crate) fn amqp_url() -> String {
    std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Postgres: `IDEM_TEST_POSTGRES_URL`, default the local `test` database.
pub(crate) fn pg_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A tag unique to this test run (process id and a random part), for queue and schema
/// names.
pub(crate) fn tag() -> String {
    format!("{}_{:08x}", std::process::id(), rand::random::<u32>())
}

/// Bytes as text, lossily.
pub(crate) fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `idem ARGS` to its end.
pub(crate) fn idem<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .output()
        .expect("run idem")
}

/// Asserts that `out` succeeded (showing its output otherwise) and returns its stdout.
pub(crate) fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs `sql` with psql on the database at `url` (unaligned, tuples only).
pub(crate) fn psql_at(url: &str, sql: &str) -> Output {
    Command::new("psql")
        .args([url, "-v", "ON_ERROR_STOP=1", "-qAtc", sql])
        .output()
        .expect("run psql")
}

/// Runs `sql` on the test database; it must succeed. Returns its trimmed output.
pub(crate) fn psql(sql: &str) -> String {
    let out = psql_at(&pg_url(), sql);
    assert!(out.status.success(), "psql: {}", text(&out.stderr));
    text(&out.stdout).trim().to_owned()
}

/// A current-thread runtime for the async parts of a test.
pub(crate) fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The messages waiting in the queue `name` at `url`, each with its dead-letter reason
/// header (empty when it has none), read without settling them.
pub(crate) fn read_queue(url: &str, name: &str) -> Vec<(Vec<u8>, String)> {
    rt().block_on(async {
        let url = BrokerUrl::parse(url).expect("broker URL");
        let consumer = AnyConsumer::connect(&url, name, 1000)
            .await
            .expect("connect to the broker");
        let mut held = Vec::new();
        let mut out = Vec::new();
        let mut stream = std::pin::pin!(until_idle(consumer, Duration::from_secs(3)));
        while let Some(item) = stream.next().await {
            let d = item.expect("delivery");
            out.push((
                d.payload.clone(),
                d.header(DEAD_LETTER_REASON_HEADER).unwrap_or("").to_owned(),
            ));
            held.push(d);
        }
        out
    })
}
