//! Helpers shared by the tests that drive the `idem` binary on real services. Each test
//! module uses a subset of them.
#![allow(dead_code)]

use std::io::Read as _;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

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

/// How long one command of a test may run: past it, the command is killed and the test
/// fails showing what the command wrote, instead of hanging the test run.
pub(crate) const COMMAND_LIMIT: Duration = Duration::from_secs(240);

/// Runs `cmd` to its end, as [`Command::output`] does, but for at most `limit`: a
/// command still running then is killed and the test panics with its output so far (a
/// hang in a broker, a store or the command itself becomes a failure that says where).
pub(crate) fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for a command") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (
        stdout.join().expect("stdout reader"),
        stderr.join().expect("stderr reader"),
    );
    match status {
        Some(status) => Output {
            status,
            stdout,
            stderr,
        },
        None => panic!(
            "{cmd:?} did not finish within {limit:?}; killed\nstdout: {}\nstderr: {}",
            text(&stdout),
            text(&stderr)
        ),
    }
}

/// Runs `idem ARGS` to its end (at most [`COMMAND_LIMIT`]).
pub(crate) fn idem<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    output_within(
        Command::new(env!("CARGO_BIN_EXE_idem")).args(args),
        COMMAND_LIMIT,
    )
}

/// The number on the `name: N` line of a command's report (`processed: 20`).
pub(crate) fn report_value(stdout: &str, name: &str) -> u64 {
    stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{name}:")))
        .unwrap_or_else(|| panic!("no {name} in {stdout}"))
        .trim()
        .parse()
        .expect("a number")
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
    output_within(
        Command::new("psql").args([url, "-v", "ON_ERROR_STOP=1", "-qAtc", sql]),
        COMMAND_LIMIT,
    )
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
        tokio::time::timeout(COMMAND_LIMIT, read_queue_to_idle(url, name))
            .await
            .unwrap_or_else(|_| panic!("reading queue {name} took over {COMMAND_LIMIT:?}"))
    })
}

async fn read_queue_to_idle(url: &str, name: &str) -> Vec<(Vec<u8>, String)> {
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
}
