//! What an operator sees and runs: the `--metrics-addr` endpoints of `idem consume` and
//! `idem relay` moving during a real run (Redis Streams, a Redis front filter, Postgres),
//! and both commands under the least-privilege roles of docs/operations.md with `--no-migrate`.
//! Real services at `IDEM_TEST_POSTGRES_URL` and `IDEM_TEST_REDIS_URL`; a missing one
//! fails the test.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use idem_store_postgres::{PgConfig, PgStore};

use crate::common;
use common::rt;

use common::report_value;

fn idem<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    common::idem(args)
}

fn spawn<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idem")
}

fn finish(child: Child) -> Output {
    child.wait_with_output().expect("wait for idem")
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {stdout}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn pg_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn tag() -> String {
    format!("{}_{:08x}", std::process::id(), rand::random::<u32>())
}

fn free_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    drop(l);
    addr
}

/// One scrape of the metrics endpoint at `addr` (`None` while it is not up yet).
fn scrape(addr: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: idem\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(
        text.contains("Content-Type: text/plain; version=0.0.4; charset=utf-8"),
        "{text}"
    );
    Some(text.split_once("\r\n\r\n").expect("a body").1.to_owned())
}

/// `GET path` at `addr`: the status code and the body (`None` while nothing listens).
fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: idem\r\n\r\n").as_bytes())
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split(' ').nth(1)?.parse().ok()?;
    Some((status, text.split_once("\r\n\r\n")?.1.to_owned()))
}

/// The value of the sample line `name` (with its labels, if any).
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .map(|v| v.parse().expect("a number"))
}

/// Asserts that the sample line `name` of `text` reads `want`.
#[track_caller]
fn assert_sample(text: &str, name: &str, want: f64) {
    assert_eq!(sample(text, name), Some(want), "{name} in\n{text}");
}

/// Scrapes until `done` holds for the text (or panics after 60 s with the last text).
fn scrape_until(addr: &str, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < deadline {
        if let Some(t) = scrape(addr) {
            if done(&t) {
                return t;
            }
            last = t;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("metrics never showed {what}; last scrape:\n{last}");
}

/// `words`, then `extra`, as owned arguments.
fn argv(words: &[&str], extra: &[&str]) -> Vec<String> {
    words.iter().chain(extra).map(|a| (*a).to_owned()).collect()
}

/// `consume --broker B --source Q --store S --schema N`, then `extra`.
fn consume_args(b: &str, q: &str, s: &str, n: &str, extra: &[&str]) -> Vec<String> {
    let words = [
        "consume", "--broker", b, "--source", q, "--store", s, "--schema", n,
    ];
    argv(&words, extra)
}

/// `relay --store S --schema N --broker B --destination Q`, then `extra`.
fn relay_args(s: &str, n: &str, b: &str, q: &str, extra: &[&str]) -> Vec<String> {
    let words = [
        "relay",
        "--store",
        s,
        "--schema",
        n,
        "--broker",
        b,
        "--destination",
        q,
    ];
    argv(&words, extra)
}

/// Runs `sql` statements on the test database (as the connecting superuser).
fn sql(statements: &[String]) {
    rt().block_on(async {
        let store = PgStore::connect(&pg_url(), PgConfig::new("public").expect("schema"))
            .await
            .expect("connect to Postgres");
        for s in statements {
            sqlx::query(sqlx::AssertSqlSafe(s.as_str()))
                .execute(store.pool())
                .await
                .unwrap_or_else(|e| panic!("{s}: {e}"));
        }
    });
}

/// One test's names, a migrated schema, and `n` distinct submissions followed by `dups`
/// repeats of the first ones published to `stream` (after them, so that a single consumer
/// has committed, and marked in the front filter, each original first).
struct Run {
    tag: String,
    schema: String,
    stream: String,
    out: String,
    pg: String,
    redis: String,
    _dir: tempfile::TempDir,
}

impl Run {
    fn new(name: &str, n: usize, dups: usize) -> Self {
        let tag = tag();
        let run = Self {
            schema: format!("cli_{name}_{tag}"),
            stream: format!("idem-{name}-in-{tag}"),
            out: format!("idem-{name}-out-{tag}"),
            pg: pg_url(),
            redis: redis_url(),
            _dir: tempfile::tempdir().expect("tempdir"),
            tag,
        };
        let line = |i: usize| {
            format!(
                r#"{{"award_id": "OP-{}-{i}", "submission_timestamp": "2026-07-01T09:00:00Z", "amount_cents": {}}}"#,
                run.tag,
                100 + i
            )
        };
        let mut lines: Vec<String> = (0..n).map(line).collect();
        lines.extend((0..dups).map(line));
        let path = run._dir.path().join("submissions.jsonl");
        std::fs::write(&path, lines.join("\n") + "\n").expect("write submissions");
        let file = path.to_str().expect("utf-8");
        ok(&idem(&[
            "migrate",
            "--store",
            &run.pg,
            "--schema",
            &run.schema,
            "--handler",
            "grant",
        ]));
        ok(&idem(&[
            "publish",
            "--broker",
            &run.redis,
            "--destination",
            &run.stream,
            "--file",
            file,
        ]));
        run
    }
}

#[test]
fn consume_and_relay_metrics_move_during_a_run() {
    let run = Run::new("op", 20, 5);
    let Run {
        schema,
        stream,
        out,
        pg,
        redis,
        ..
    } = &run;

    let addr = free_addr();
    let consume = spawn(&consume_args(
        redis,
        stream,
        pg,
        schema,
        &[
            "--front-filter",
            redis,
            "--metrics-addr",
            &addr,
            "--exit-when-idle",
            "4",
            // One delivery per transaction, so each duplicate comes after its original's
            // commit and mark (a batch would see both in one claim).
            "--batch-size",
            "1",
            "--concurrency",
            "1",
        ],
    ));
    let text = scrape_until(&addr, "20 processed and 5 duplicates", |t| {
        sample(t, "idem_deliveries_total{outcome=\"processed\"}") == Some(20.0)
            && sample(t, "idem_deliveries_total{outcome=\"duplicate\"}") == Some(5.0)
    });
    // No relay has run: every committed event waits, the oldest for a while already.
    assert_sample(&text, "idem_outbox_backlog_up", 1.0);
    assert_sample(&text, "idem_outbox_backlog", 20.0);
    let age = sample(&text, "idem_outbox_oldest_unpublished_age_seconds").expect("age");
    assert!(
        age > 0.0 && age < 120.0,
        "oldest unpublished age {age}\n{text}"
    );
    // The duplicates came after their originals were committed and marked: the filter
    // answered each of them without a store round trip.
    assert_sample(&text, "idem_front_filter_hits_total", 5.0);
    assert_sample(&text, "idem_front_filter_errors_total", 0.0);
    assert_eq!(
        sample(&text, "idem_stage_duration_seconds_count{stage=\"commit\"}"),
        Some(20.0),
        "one commit per processed delivery (duplicates roll back): {text}"
    );
    // Alive, and ready: the store answers and the delivery stream is connected.
    assert_eq!(get(&addr, "/healthz"), Some((200, "ok\n".to_owned())));
    assert_eq!(get(&addr, "/readyz"), Some((200, "ready\n".to_owned())));
    assert_eq!(get(&addr, "/nowhere").map(|r| r.0), Some(404));
    let consumed = ok(&finish(consume));
    assert_eq!(report_value(&consumed, "processed"), 20);
    assert_eq!(report_value(&consumed, "duplicates"), 5);

    let addr = free_addr();
    let relay = spawn(&relay_args(
        pg,
        schema,
        redis,
        out,
        &["--metrics-addr", &addr, "--exit-when-idle", "4"],
    ));
    let text = scrape_until(&addr, "20 published and an empty backlog", |t| {
        sample(t, "idem_relay_published_total") == Some(20.0)
            && sample(t, "idem_outbox_backlog") == Some(0.0)
    });
    assert_sample(&text, "idem_outbox_oldest_unpublished_age_seconds", 0.0);
    assert_sample(&text, "idem_relay_retries_total", 0.0);
    assert!(
        sample(&text, "idem_relay_batches_total").is_some_and(|b| b >= 1.0),
        "{text}"
    );
    assert_eq!(get(&addr, "/readyz"), Some((200, "ready\n".to_owned())));
    let relayed = ok(&finish(relay));
    assert_eq!(report_value(&relayed, "published"), 20);
    sql(&[format!("DROP SCHEMA \"{schema}\" CASCADE")]);
}

/// `/readyz` answers 503 and names what is not ready while `idem consume` waits for a
/// broker that does not answer; `/healthz` answers 200 all along (the process is alive).
#[test]
fn readyz_names_a_broker_that_is_not_connected() {
    let run = Run::new("ready", 1, 0);
    let addr = free_addr();
    let consume = spawn(&consume_args(
        // Nothing listens on port 1.
        "redis://127.0.0.1:1",
        &run.stream,
        &run.pg,
        &run.schema,
        &["--metrics-addr", &addr, "--reconnect-timeout", "8"],
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = None;
    while Instant::now() < deadline {
        last = get(&addr, "/readyz");
        if last
            .as_ref()
            .is_some_and(|(_, body)| body.contains("store: ok"))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, body) = last.expect("the endpoint answered");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("store: ok\n"), "{body}");
    assert!(body.contains("broker: not connected\n"), "{body}");
    assert_eq!(get(&addr, "/healthz"), Some((200, "ok\n".to_owned())));
    let out = finish(consume);
    assert!(!out.status.success(), "gave up on the broker");
    sql(&[format!("DROP SCHEMA \"{}\" CASCADE", run.schema)]);
}

#[test]
fn least_privilege_roles_consume_and_relay_with_no_migrate() {
    // The owner (here the superuser) migrates; the GRANTs of docs/operations.md give the rest.
    let run = Run::new("roles", 3, 1);
    let Run {
        tag: t,
        schema,
        stream,
        out,
        pg,
        redis,
        ..
    } = &run;
    let (consumer, relay) = (format!("idem_c_{t}"), format!("idem_r_{t}"));
    sql(&[
        format!("CREATE ROLE {consumer} LOGIN"),
        format!("CREATE ROLE {relay} LOGIN"),
        format!("GRANT USAGE ON SCHEMA {schema} TO {consumer}, {relay}"),
        format!("GRANT SELECT, INSERT ON {schema}.processed_messages, {schema}.disbursements, {schema}.outbox TO {consumer}"),
        format!("GRANT USAGE ON SEQUENCE {schema}.outbox_id_seq TO {consumer}"),
        format!("GRANT SELECT, UPDATE (published_at) ON {schema}.outbox TO {relay}"),
        format!("GRANT SELECT, UPDATE, DELETE ON {schema}.outbox_pending TO {relay}"),
    ]);
    let as_role = |role: &str| pg.replacen("postgres@", &format!("{role}@"), 1);
    assert!(
        as_role(&consumer).contains(&consumer),
        "test URL must name the user: {pg}"
    );
    let consume_as = |role: &str, extra: &[&str]| {
        let mut args = consume_args(redis, stream, &as_role(role), schema, extra);
        args.extend(["--exit-when-idle", "2", "--reconnect-timeout", "5"].map(String::from));
        idem(&args)
    };

    // Migrating at start needs the owner: a one-line error pointing at --no-migrate, at
    // once (not retried until the reconnect timeout), and nothing consumed.
    let started = Instant::now();
    let refused = consume_as(&consumer, &[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "stderr: {stderr}");
    assert!(
        stderr.contains("42501") && stderr.contains("--no-migrate"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );

    let consumed = ok(&consume_as(&consumer, &["--no-migrate"]));
    assert_eq!(report_value(&consumed, "processed"), 3, "{consumed}");
    assert_eq!(report_value(&consumed, "duplicates"), 1, "{consumed}");

    let relayed = ok(&idem(&relay_args(
        &as_role(&relay),
        schema,
        redis,
        out,
        &["--no-migrate", "--exit-when-idle", "2"],
    )));
    assert_eq!(report_value(&relayed, "published"), 3, "{relayed}");

    // --no-migrate on a schema nobody migrated: the missing table, named, exit 2.
    let missing = format!("cli_roles_missing_{t}");
    let out = idem(&consume_args(
        redis,
        stream,
        pg,
        &missing,
        &["--no-migrate", "--exit-when-idle", "2"],
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("processed_messages"), "{stderr}");

    sql(&[
        format!("DROP SCHEMA \"{schema}\" CASCADE"),
        format!("DROP ROLE {consumer}"),
        format!("DROP ROLE {relay}"),
    ]);
}

/// `idem migrate --outbox cdc`: the consumer writes its events published and queued for no
/// relay, and `idem relay` refuses the schema (exit 2, saying why) instead of publishing
/// nothing; the schema never goes back to the relay.
#[test]
fn an_outbox_read_by_change_data_capture_takes_no_relay() {
    let run = Run::new("cdc", 3, 1);
    let Run {
        schema,
        stream,
        out,
        pg,
        redis,
        ..
    } = &run;
    let migrated = ok(&idem(&[
        "migrate", "--store", pg, "--schema", schema, "--outbox", "cdc",
    ]));
    assert!(
        migrated.contains("outbox: read by change data capture"),
        "{migrated}"
    );
    let consumed = ok(&idem(&consume_args(
        redis,
        stream,
        pg,
        schema,
        &["--exit-when-idle", "2"],
    )));
    assert_eq!(report_value(&consumed, "processed"), 3, "{consumed}");
    let counts = rt().block_on(async {
        let store = PgStore::connect(pg, PgConfig::new(schema.as_str()).expect("schema"))
            .await
            .expect("connect");
        let count = |sql: String| {
            let pool = store.pool().clone();
            async move {
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                    .fetch_one(&pool)
                    .await
                    .expect("count")
            }
        };
        (
            count(format!(
                "SELECT count(*) FROM {schema}.outbox WHERE published_at IS NOT NULL"
            ))
            .await,
            count(format!("SELECT count(*) FROM {schema}.outbox_pending")).await,
        )
    });
    assert_eq!(counts, (3, 0), "(published events, queued events)");

    let relayed = idem(&relay_args(
        pg,
        schema,
        redis,
        out,
        &["--exit-when-idle", "2"],
    ));
    let stderr = String::from_utf8_lossy(&relayed.stderr);
    assert_eq!(relayed.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("change data capture"), "{stderr}");

    let back = idem(&[
        "migrate", "--store", pg, "--schema", schema, "--outbox", "relay",
    ]);
    let stderr = String::from_utf8_lossy(&back.stderr);
    assert_eq!(back.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("is for good"), "{stderr}");
    sql(&[format!("DROP SCHEMA \"{schema}\" CASCADE")]);
}
