//! Issue 16's first done-criterion, through the `idem` binary on real services: two
//! bodies with one award id and submission timestamp but different amounts, published to
//! RabbitMQ and consumed into Postgres. Under the default policy (`--on-conflict
//! dead-letter`) they give one disbursement and one dead letter whose reason names both
//! keys; under `--on-conflict process`, two disbursements (the reference behaviour).
//!
//! RabbitMQ at `IDEM_TEST_AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! Postgres at `IDEM_TEST_POSTGRES_URL`; a missing service fails the test.

use std::process::Command;

use idem_broker::any::{pending_count, BrokerUrl};
use idem_engine::IdempotencyKey;

use crate::common;
use common::{amqp_url, idem, ok, pg_url, psql, read_queue, report_value, rt, tag, text};

/// What one run left: the disbursed amounts (sorted), the dead letters, consume's report.
struct Run {
    amounts: Vec<u64>,
    dead: Vec<(Vec<u8>, String)>,
    stdout: String,
    /// The `idem::audit` lines about conflicts.
    audit: Vec<String>,
    bodies: [(String, IdempotencyKey); 2],
}

/// Publishes the two conflicting bodies (and a redelivery of each) to a queue of its own
/// and consumes them into a schema of its own with `extra` options.
fn run(extra: &[&str]) -> Run {
    let tag = tag();
    let queue = format!("idem-conflict-{tag}");
    let schema = format!("conflict_{tag}");
    let (amqp, store) = (amqp_url(), pg_url());
    let award = format!("C-{tag}");
    let ts = "2026-07-01T09:00:00Z";
    let bodies = [100_u64, 250].map(|amount| {
        let body = serde_json::json!({
            "award_id": award, "submission_timestamp": ts, "amount_cents": amount
        })
        .to_string();
        let key = IdempotencyKey::derive(&award, ts, body.as_bytes()).expect("key");
        (body, key)
    });
    // Each body twice: a plain redelivery of either is a duplicate or the same conflict.
    let lines: Vec<&str> = bodies
        .iter()
        .chain(bodies.iter())
        .map(|(b, _)| b.as_str())
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("bodies.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").expect("write");

    ok(
        &idem(&["migrate", "--store", &store, "--schema", &schema]),
        "migrate",
    );
    ok(
        &idem(&[
            "publish",
            "--broker",
            &amqp,
            "--destination",
            &queue,
            "--file",
            file.to_str().expect("utf-8"),
        ]),
        "publish",
    );
    let mut args = vec![
        "consume",
        "--broker",
        &amqp,
        "--source",
        &queue,
        "--store",
        &store,
        "--schema",
        &schema,
        "--exit-when-idle",
        "3",
    ];
    args.extend_from_slice(extra);
    // The audit trail on stderr (off by default).
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(&args)
        .env("RUST_LOG", "warn,idem::audit=info")
        .output()
        .expect("run idem consume");
    let stdout = ok(&out, "consume");
    let audit: Vec<String> = text(&out.stderr)
        .lines()
        .filter(|l| l.contains("idem::audit") && l.contains("conflict"))
        .map(str::to_owned)
        .collect();

    let amounts = psql(&format!(
        "SELECT coalesce(string_agg(amount_cents::text, ',' ORDER BY amount_cents), '') \
         FROM \"{schema}\".disbursements"
    ));
    let amounts = amounts
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().expect("amount"))
        .collect();
    let dead = read_queue(&amqp, &format!("{queue}.dead-letter"));
    let left = rt()
        .block_on(pending_count(
            &BrokerUrl::parse(&amqp).expect("url"),
            &queue,
        ))
        .expect("count");
    assert_eq!(left, 0, "the source queue is not empty\n{stdout}");
    psql(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"));
    Run {
        amounts,
        dead,
        stdout,
        audit,
        bodies,
    }
}

#[test]
fn a_conflicting_resubmission_is_dead_lettered_naming_both_keys_or_processed_by_policy() {
    // The default policy: one disbursement, the other payload dead-lettered (its
    // redelivery too: the same conflict again), each with a reason naming both keys.
    let r = run(&[]);
    assert_eq!(
        r.amounts.len(),
        1,
        "one disbursement: {:?}\n{}",
        r.amounts,
        r.stdout
    );
    let winner = if r.amounts[0] == 100 { 0 } else { 1 };
    assert_eq!(r.amounts[0], [100, 250][winner]);
    let (loser_body, loser_key) = &r.bodies[1 - winner];
    let winner_key = r.bodies[winner].1;
    assert_eq!(
        r.dead.len(),
        2,
        "the conflicting body and its redelivery are dead letters: {:?}",
        r.dead.iter().map(|(_, why)| why).collect::<Vec<_>>()
    );
    for (body, reason) in &r.dead {
        assert_eq!(
            body,
            loser_body.as_bytes(),
            "the dead letter is the other payload"
        );
        assert!(reason.starts_with("conflict"), "{reason}");
        assert!(
            reason.contains(&loser_key.to_hex()) && reason.contains(&winner_key.to_hex()),
            "the reason names both keys: {reason}"
        );
    }
    assert_eq!(report_value(&r.stdout, "conflicts"), 2, "{}", r.stdout);
    // Audited: each names both key prefixes and the policy.
    assert_eq!(r.audit.len(), 2, "{:?}", r.audit);
    for line in &r.audit {
        assert!(
            line.contains(&loser_key.short())
                && line.contains(&winner_key.short())
                && line.contains("dead-letter"),
            "{line}"
        );
    }

    // `process`: the reference behaviour, two disbursements and no dead letter.
    let r = run(&["--on-conflict", "process"]);
    assert_eq!(r.amounts, [100, 250], "{}", r.stdout);
    assert!(r.dead.is_empty(), "{:?}", r.dead);
    assert_eq!(report_value(&r.stdout, "conflicts"), 0, "{}", r.stdout);
    // Audited all the same, with the policy that let it through.
    assert!(
        !r.audit.is_empty() && r.audit.iter().all(|l| l.contains("process")),
        "{:?}",
        r.audit
    );
}
