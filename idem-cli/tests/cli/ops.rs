//! The operator's dashboard and alerts in `ops/` name only metrics idem exports: every
//! `idem_…` name in the Grafana dashboard, the alert rules and their unit tests is served
//! by a running `idem consume --metrics-addr` (Redis Streams, a Redis front filter,
//! Postgres) or `idem relay --metrics-addr`; and the rules pass `promtool check rules` and
//! `promtool test rules` (`ops/check`).
//! Real services at `IDEM_TEST_POSTGRES_URL` and `IDEM_TEST_REDIS_URL`; a missing one
//! fails the test.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common;

/// Names the dashboard and rules use that idem does not export yet. Each is asserted
/// absent from the scrape, so the entry must go once it is exported.
const PENDING: &[&str] = &[];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn idem(args: &[&str]) -> Output {
    common::idem(args)
}

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idem")
}

#[track_caller]
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

fn free_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    drop(l);
    addr
}

fn scrape(addr: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: idem\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    Some(text.split_once("\r\n\r\n")?.1.to_owned())
}

/// Scrapes until `done` holds (or panics after 60 s with the last text).
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

/// The sample names of an exposition text (`name{…} v` and `name v` lines).
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            l.split(['{', ' '])
                .next()
                .expect("a sample name")
                .to_owned()
        })
        .collect()
}

/// Every `idem_[a-z0-9_]+` token of `text`.
fn idem_names(text: &str) -> BTreeSet<String> {
    let b = text.as_bytes();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while let Some(at) = text[i..].find("idem_") {
        let start = i + at;
        let word_before =
            start > 0 && (b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        let mut end = start + 5;
        while end < b.len()
            && (b[end].is_ascii_lowercase() || b[end].is_ascii_digit() || b[end] == b'_')
        {
            end += 1;
        }
        if !word_before && end > start + 5 {
            out.insert(text[start..end].to_owned());
        }
        i = end;
    }
    out
}

/// The metric names the ops files use, by file.
fn used_names() -> Vec<(String, BTreeSet<String>)> {
    let ops = repo().join("ops");
    [
        "grafana/idem-dashboard.json",
        "prometheus/idem-alerts.yml",
        "prometheus/idem-alerts.test.yml",
    ]
    .iter()
    .map(|f| {
        let text = std::fs::read_to_string(ops.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        ((*f).to_owned(), idem_names(&text))
    })
    .collect()
}

#[test]
fn the_name_scanner_finds_metric_names_and_nothing_else() {
    let t = r#"rate(idem_deliveries_total{outcome="x"}[5m]) / sum(idem_stage_duration_seconds_bucket) IdemAlert my_idem_thing idem_ idem:rule"#;
    let names: Vec<String> = idem_names(t).into_iter().collect();
    assert_eq!(
        names,
        [
            "idem_deliveries_total",
            "idem_stage_duration_seconds_bucket"
        ]
    );
    let e = exported("# HELP idem_a x\n# TYPE idem_a counter\nidem_a 1\nidem_b{l=\"v\"} 2\n");
    assert_eq!(e.into_iter().collect::<Vec<_>>(), ["idem_a", "idem_b"]);
}

#[test]
fn every_metric_the_dashboard_and_alerts_use_is_exported() {
    let used = used_names();
    for (file, names) in &used {
        assert!(
            names.contains("idem_deliveries_total"),
            "{file} names no idem_deliveries_total: {names:?}"
        );
    }

    // A real run: 6 submissions and 2 duplicates through Redis Streams into Postgres with a
    // Redis front filter, then the relay, each serving its metrics.
    let tag = format!("{}_{:08x}", std::process::id(), rand::random::<u32>());
    let (pg, redis) = (pg_url(), redis_url());
    let schema = format!("ops_{tag}");
    let (stream, out) = (format!("idem-ops-in-{tag}"), format!("idem-ops-out-{tag}"));
    let dir = tempfile::tempdir().expect("tempdir");
    let line = |i: usize| {
        format!(
            r#"{{"award_id": "OPS-{tag}-{i}", "submission_timestamp": "2026-07-01T09:00:00Z", "amount_cents": {}}}"#,
            100 + i
        )
    };
    let lines: Vec<String> = (0..6).chain(0..2).map(line).collect();
    let file = dir.path().join("submissions.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").expect("write");
    let file = file.to_str().expect("utf-8");
    ok(&idem(&["migrate", "--store", &pg, "--schema", &schema]));
    ok(&idem(&[
        "publish",
        "--broker",
        &redis,
        "--destination",
        &stream,
        "--file",
        file,
    ]));

    let addr = free_addr();
    let consume = spawn(&[
        "consume",
        "--broker",
        &redis,
        "--source",
        &stream,
        "--store",
        &pg,
        "--schema",
        &schema,
        "--front-filter",
        &redis,
        "--metrics-addr",
        &addr,
        "--exit-when-idle",
        "3",
    ]);
    let consume_text = scrape_until(&addr, "6 processed and the backlog", |t| {
        t.contains("idem_deliveries_total{outcome=\"processed\"} 6\n")
            && t.contains("\nidem_outbox_backlog ")
    });
    ok(&consume.wait_with_output().expect("consume"));

    let addr = free_addr();
    let relay = spawn(&[
        "relay",
        "--store",
        &pg,
        "--schema",
        &schema,
        "--broker",
        &redis,
        "--destination",
        &out,
        "--metrics-addr",
        &addr,
        "--exit-when-idle",
        "3",
    ]);
    let relay_text = scrape_until(&addr, "6 published", |t| {
        t.contains("\nidem_relay_published_total 6\n")
    });
    ok(&relay.wait_with_output().expect("relay"));

    let mut exports = exported(&consume_text);
    exports.extend(exported(&relay_text));
    let mut missing = Vec::new();
    for (file, names) in &used {
        for name in names {
            let pending = PENDING.contains(&name.as_str());
            if pending {
                assert!(
                    !exports.contains(name),
                    "{name} is exported now: take it off PENDING in idem-cli/tests/cli/ops.rs"
                );
            } else if !exports.contains(name) {
                missing.push(format!("{file}: {name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the ops files use metrics idem does not export:\n{}\nexported: {exports:?}",
        missing.join("\n")
    );
    // The pending names are used (otherwise the list is stale).
    for p in PENDING {
        assert!(
            used.iter().any(|(_, n)| n.contains(*p)),
            "{p} is pending but no ops file uses it"
        );
    }
    let _ = Command::new("psql")
        .args([&pg, "-qc", &format!("DROP SCHEMA \"{schema}\" CASCADE")])
        .output();
}

#[test]
fn alert_rules_pass_promtool_check_and_unit_tests() {
    let out = Command::new(repo().join("ops/check"))
        .output()
        .expect("run ops/check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "ops/check failed:\n{text}");
    assert!(text.contains("SUCCESS: 8 rules found"), "{text}");
    assert!(text.contains("SUCCESS"), "{text}");
}
