//! Issue 12's second reproduction, through the `idem` binary on real services: bodies
//! that parse as JSON but that no store can hold — NUL and other control characters in
//! the award id or timestamp, an over-long award id or timestamp (refused by parsing,
//! before the claim), and an award id the store alone refuses (a character a LATIN1
//! database cannot hold: SQLSTATE 22P05, mapped to `StoreError::Rejected`) — published to
//! RabbitMQ beside valid ones and consumed by `idem consume --exit-when-idle 3` into
//! Postgres. Every refused body ends in `NAME.dead-letter` with its reason, the valid ones
//! are exact, the source queue is empty, and consume exits on its own.
//!
//! RabbitMQ at `IDEM_TEST_AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! Postgres at `IDEM_TEST_POSTGRES_URL`; a missing service fails the test.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idem_broker::any::{pending_count, BrokerUrl};

use crate::common;
use common::{amqp_url, idem, ok, pg_url, psql_at, read_queue, rt, tag, text};

/// A LATIN1 database beside the test database (created once; kept for later runs).
fn latin1_url() -> String {
    let base = pg_url();
    let (server, _) = base.rsplit_once('/').expect("a database in the URL");
    let url = format!("{server}/idem_test_latin1");
    let exists = psql_at(
        &base,
        "SELECT 1 FROM pg_database WHERE datname = 'idem_test_latin1'",
    );
    if text(&exists.stdout).trim() != "1" {
        // A concurrent creator may win: then this fails with duplicate_database, fine.
        let _ = psql_at(
            &base,
            "CREATE DATABASE idem_test_latin1 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' \
             TEMPLATE template0",
        );
    }
    let enc = psql_at(&url, "SHOW server_encoding");
    assert_eq!(text(&enc.stdout).trim(), "LATIN1", "{}", text(&enc.stderr));
    url
}

fn line(award_id: &str, ts: &str, amount: u64) -> String {
    serde_json::json!({"award_id": award_id, "submission_timestamp": ts, "amount_cents": amount})
        .to_string()
}

#[test]
fn bodies_no_store_can_hold_are_dead_lettered_with_their_reason_and_consume_exits() {
    let tag = tag();
    let queue = format!("idem-refused-{tag}");
    let schema = format!("refused_{tag}");
    let store = latin1_url();
    let amqp = amqp_url();
    let ts = "2026-07-01T09:00:00Z";

    let valid: Vec<String> = (0..20)
        .map(|i| line(&format!("R-{tag}-{i}"), ts, 100 + i))
        .collect();
    // (body, what the reason must name)
    let refused: Vec<(String, &str)> = vec![
        (
            line(&format!("R-{tag}-\u{0}-nul"), ts, 1),
            "control_character",
        ),
        (
            line(&format!("R-{tag}-nul-ts"), "2026-07-01T09:00:00Z\u{0}", 1),
            "control_character",
        ),
        (
            line(&format!("R-{tag}-\n-newline"), ts, 1),
            "control_character",
        ),
        (
            line(&format!("R-{tag}-{}", "L".repeat(300)), ts, 1),
            "too_long",
        ),
        (
            line(
                &format!("R-{tag}-long-ts"),
                &format!("{ts}{}", "0".repeat(80)),
                1,
            ),
            "too_long",
        ),
        // Valid UTF-8 that parses, that only the store refuses: no LATIN1 equivalent.
        (line(&format!("R-{tag}-\u{3a9}-omega"), ts, 1), "22P05"),
    ];
    let mut lines = valid.clone();
    lines.extend(refused.iter().map(|(b, _)| b.clone()));
    // Every valid one twice: the redelivery of a committed submission is a duplicate.
    lines.extend(valid.iter().cloned());
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("bodies.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").expect("write");

    ok(
        &idem(&[
            "migrate",
            "--store",
            store.as_str(),
            "--schema",
            schema.as_str(),
        ]),
        "migrate",
    );
    ok(
        &idem(&[
            "publish",
            "--broker",
            amqp.as_str(),
            "--destination",
            queue.as_str(),
            "--file",
            file.to_str().expect("utf-8"),
        ]),
        "publish",
    );

    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "consume",
            "--broker",
            amqp.as_str(),
            "--source",
            queue.as_str(),
            "--store",
            store.as_str(),
            "--schema",
            schema.as_str(),
            "--exit-when-idle",
            "3",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn consume");
    // A message nacked into a loop keeps consume from ever being idle.
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = child.wait_with_output().expect("output");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    let status = status.unwrap_or_else(|| {
        panic!("consume did not exit on its own within 120 s (a message looping?)\nstdout: {stdout}\nstderr: {stderr}")
    });
    assert!(
        status.success(),
        "consume: {status:?}\nstdout: {stdout}\nstderr: {stderr}"
    );

    // The valid ones, exactly once each.
    let rows = psql_at(
        &store,
        &format!(
            "SELECT count(*), count(DISTINCT idempotency_key), coalesce(sum(amount_cents), 0) \
             FROM \"{schema}\".disbursements"
        ),
    );
    let expected_total: u64 = (0..20).map(|i| 100 + i).sum();
    assert_eq!(
        text(&rows.stdout).trim(),
        format!("20|20|{expected_total}"),
        "{}",
        text(&rows.stderr)
    );

    // Every refused one in the dead-letter queue, bytes unchanged, with its reason: first
    // those parsing refuses, then the one only the store refuses.
    let dead = read_queue(&amqp, &format!("{queue}.dead-letter"));
    let by_body: HashMap<Vec<u8>, String> = dead.into_iter().collect();
    for (body, reason) in &refused {
        let store_only = *reason == "22P05";
        let got = by_body.get(body.as_bytes()).unwrap_or_else(|| {
            panic!(
                "not dead-lettered (reason {reason}){}; dead letters: {:?}\nconsume stderr: {stderr}",
                if store_only {
                    " - a body only the store refuses (StoreError::Rejected) is dead-lettered \
                     only once the gate maps Rejected store errors to a dead letter (issue 12 \
                     item 1)"
                } else {
                    ""
                },
                by_body.values().collect::<Vec<_>>()
            )
        });
        assert!(got.contains(reason), "reason {got:?} should name {reason}");
        assert!(!got.contains(&tag), "the reason quotes the payload: {got}");
    }
    assert_eq!(
        by_body.len(),
        refused.len(),
        "only the refused ones are dead letters"
    );

    let left = rt()
        .block_on(pending_count(
            &BrokerUrl::parse(&amqp).expect("url"),
            &queue,
        ))
        .expect("count");
    assert_eq!(
        left, 0,
        "the source queue is not empty\nconsume stderr: {stderr}"
    );

    let _ = psql_at(
        &store,
        &format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"),
    );
    let _ = dir;
}
