//! `idem purge --broker URL --source NAME` refuses a cutoff inside the source's
//! redelivery horizon plus the margin, whatever `--allow-below-floor` says, and
//! `idem inspect --broker URL --source NAME` shows the horizon it would use. On the real
//! services: SQS (moto at `IDEM_TEST_SQS_ENDPOINT`, default `http://127.0.0.1:5000`,
//! whose queues keep messages 4 days by default, as SQS does), NATS JetStream, RabbitMQ
//! and Postgres. A missing service fails the test.

use std::process::{Command, Output};

use crate::common;

fn idem(args: &[&str]) -> Output {
    common::idem(args)
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[track_caller]
fn ok(o: &Output) -> String {
    let (out, err) = text(o);
    assert!(
        o.status.success(),
        "exit {:?}\n{out}\n{err}",
        o.status.code()
    );
    out
}

#[track_caller]
fn refused(o: &Output) -> String {
    let (out, err) = text(o);
    assert_eq!(o.status.code(), Some(2), "expected exit 2\n{out}\n{err}");
    err
}

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn tag() -> String {
    format!("{}-{:08x}", std::process::id(), rand::random::<u32>())
}

fn sqs() -> String {
    let e = env("IDEM_TEST_SQS_ENDPOINT", "http://127.0.0.1:5000");
    format!(
        "sqs://{}",
        e.trim_start_matches("http://").trim_end_matches('/')
    )
}

/// A migrated Postgres schema with nothing in it.
fn store() -> (String, String) {
    let pg = env(
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    );
    let schema = format!("horizon_{}", tag().replace('-', "_"));
    ok(&idem(&["migrate", "--store", &pg, "--schema", &schema]));
    (pg, schema)
}

/// Publishes one line to `destination` (creating it).
fn publish(broker: &str, destination: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("one.jsonl");
    std::fs::write(
        &f,
        "{\"award_id\":\"H-1\",\"submission_timestamp\":\"2026-07-01T09:00:00Z\",\"amount_cents\":1}\n",
    )
    .expect("write");
    ok(&idem(&[
        "publish",
        "--broker",
        broker,
        "--destination",
        destination,
        "--file",
        f.to_str().expect("utf-8"),
    ]));
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn purge(pg: &str, schema: &str, older_than: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "purge",
        "--store",
        pg,
        "--schema",
        schema,
        "--older-than",
        older_than,
    ];
    args.extend_from_slice(extra);
    idem(&args)
}

#[test]
fn purge_refuses_a_cutoff_inside_an_sqs_queues_retention_whatever_the_floor_override() {
    let (pg, schema) = store();
    let (broker, queue) = (sqs(), format!("horizon-{}", tag()));
    publish(&broker, &queue);

    // Inspect shows the horizon and the youngest cutoff a purge would take: the queue
    // keeps 4 days, its dead-letter queue (created with it) 14, and an operator may
    // replay a dead letter.
    let shown = ok(&idem(&["inspect", "--broker", &broker, "--source", &queue]));
    assert!(
        shown.contains(&format!(
            "redelivery_horizon: SQS {queue:?}: 14d (its dead letters keep longer: SQS MessageRetentionPeriod"
        )),
        "{shown}"
    );
    assert!(
        shown.contains(
            "purge_older_than_at_least: 15d (the longest horizon 14d plus a margin of 1d)"
        ),
        "{shown}"
    );

    let src = ["--broker", broker.as_str(), "--source", queue.as_str()];
    let with = |extra: &[&str]| -> Vec<String> {
        src.iter().chain(extra).map(|s| (*s).to_owned()).collect()
    };
    // Inside the retention: refused, --allow-below-floor or not.
    for older in ["1d", "4d", "14d", "359h"] {
        let a = with(&["--allow-below-floor", "--dry-run"]);
        let err = refused(&purge(&pg, &schema, older, &args(&a)));
        assert!(err.contains("redelivery horizon"), "{older}: {err}");
        assert!(err.contains("SQS"), "{older}: {err}");
    }
    // A bigger margin moves the limit.
    let a = with(&["--allow-below-floor", "--dry-run", "--horizon-margin", "3d"]);
    refused(&purge(&pg, &schema, "16d", &args(&a)));
    // Beyond horizon + margin the horizon lets it through; the policy floor still holds
    // without the override, and with it the (dry) purge runs.
    let a = with(&["--dry-run"]);
    let err = refused(&purge(&pg, &schema, "15d", &args(&a)));
    assert!(
        err.contains("idem: refusing to purge records younger than the retention floor"),
        "{err}"
    );
    assert!(err.contains("purge: redelivery horizon of SQS"), "{err}");
    let a = with(&["--allow-below-floor", "--dry-run"]);
    let out = ok(&purge(&pg, &schema, "15d", &args(&a)));
    assert!(out.contains("dry_run: true"), "{out}");
    // Without a broker nothing changes: the override alone suffices, as before.
    ok(&purge(
        &pg,
        &schema,
        "1d",
        &["--allow-below-floor", "--dry-run"],
    ));

    // A source that does not exist is a usage error, not a horizon of zero.
    let err = refused(&purge(
        &pg,
        &schema,
        "30d",
        &[
            "--allow-below-floor",
            "--dry-run",
            "--broker",
            &broker,
            "--source",
            &format!("nope-{}", tag()),
        ],
    ));
    assert!(err.contains("no such SQS queue"), "{err}");
    let _ = Command::new("psql")
        .args([&pg, "-qc", &format!("DROP SCHEMA \"{schema}\" CASCADE")])
        .output();
}

#[test]
fn the_longest_of_several_sources_wins_and_an_unknown_one_refuses_every_cutoff() {
    let (pg, schema) = store();
    let nats = env("IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222");
    let stream = format!("horizon-{}", tag());
    publish(&nats, &stream);
    let (broker, queue) = (sqs(), format!("horizon-{}", tag()));
    publish(&broker, &queue);

    // The NATS stream (no max_age) holds one message a few seconds old.
    let shown = ok(&idem(&["inspect", "--broker", &nats, "--source", &stream]));
    assert!(shown.contains("has no max_age"), "{shown}");
    let ok_nats = purge(
        &pg,
        &schema,
        "2d",
        &[
            "--allow-below-floor",
            "--dry-run",
            "--broker",
            &nats,
            "--source",
            &stream,
        ],
    );
    ok(&ok_nats);
    // With the SQS queue beside it, its dead-letter queue's 14 days decide.
    let both = [
        "--allow-below-floor",
        "--dry-run",
        "--broker",
        &nats,
        "--source",
        &stream,
        "--broker",
        &broker,
        "--source",
        &queue,
    ];
    let err = refused(&purge(&pg, &schema, "2d", &both));
    assert!(err.contains("SQS"), "{err}");
    ok(&purge(&pg, &schema, "15d", &both));

    // RabbitMQ does not tell its TTL over AMQP: no cutoff is safe.
    let amqp = env(
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    );
    let q = format!("idem-horizon-{}", tag());
    publish(&amqp, &q);
    let err = refused(&purge(
        &pg,
        &schema,
        "36500d",
        &[
            "--allow-below-floor",
            "--dry-run",
            "--broker",
            &amqp,
            "--source",
            &q,
        ],
    ));
    assert!(err.contains("any age"), "{err}");
    let shown = ok(&idem(&["inspect", "--broker", &amqp, "--source", &q]));
    assert!(
        shown.contains("purge_older_than_at_least: never"),
        "{shown}"
    );
    let _ = Command::new("psql")
        .args([&pg, "-qc", &format!("DROP SCHEMA \"{schema}\" CASCADE")])
        .output();
}

/// A Kafka topic consumed with `?positions=store`: once every partition has a stored
/// position, the topic's own retention is no part of the horizon (nothing before a
/// stored position is delivered to the group again); its dead letters still are. On
/// tansu, which reports no retention of a topic created without one, the dead-letter
/// topic still leaves the horizon open, so this reads what `idem inspect` says of each
/// part.
#[test]
fn a_kafka_topic_whose_positions_are_stored_adds_no_horizon_of_its_own() {
    let (pg, schema) = store();
    let brokers = env("IDEM_TEST_KAFKA_BROKERS", "127.0.0.1:9092");
    let (topic, group) = (format!("horizon-{}", tag()), format!("g-{}", tag()));
    let plain = format!("kafka://{brokers}?group={group}&partitions=2&batch_messages=1");
    let stored = format!("{plain}&positions=store");
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("many.jsonl");
    let lines: String = (0..20)
        .map(|i| {
            format!(
                "{{\"award_id\":\"H-{i}\",\"submission_timestamp\":\"2026-07-01T09:00:00Z\",\"amount_cents\":1}}\n"
            )
        })
        .collect();
    std::fs::write(&f, lines).expect("write");
    let file = f.to_str().expect("utf-8");
    ok(&idem(&[
        "publish",
        "--broker",
        &plain,
        "--destination",
        &topic,
        "--file",
        file,
    ]));
    let inspect = |broker: &str| {
        ok(&idem(&[
            "inspect", "--broker", broker, "--source", &topic, "--store", &pg, "--schema", &schema,
        ]))
    };
    // Nothing consumed yet: no position stored, the topic's retention counts.
    assert!(!inspect(&stored).contains("partitions stored"));
    // A loaded machine can take longer than the idle limit to join the group and take
    // the partitions: consume again (each run goes on from the stored positions) until
    // all 20 are disbursed, so that what follows is read of a topic consumed whole.
    let disbursed = || {
        let out = common::psql_at(
            &pg,
            &format!("SELECT count(*) FROM \"{schema}\".disbursements"),
        );
        ok(&out).trim().parse::<u64>().expect("a count")
    };
    for _ in 0..6 {
        ok(&idem(&[
            "consume",
            "--broker",
            &stored,
            "--source",
            &topic,
            "--store",
            &pg,
            "--schema",
            &schema,
            "--exit-when-idle",
            "8",
        ]));
        if disbursed() == 20 {
            break;
        }
    }
    assert_eq!(disbursed(), 20, "the topic was not consumed whole");
    let shown = inspect(&stored);
    assert!(
        shown.contains(&format!(
            "positions of all 2 partitions stored as \"kafka/{group}/{topic}\""
        )),
        "{shown}"
    );
    // The same topic read as a broker-commit source: its retention counts again.
    assert!(!inspect(&plain).contains("partitions stored"));
    let _ = Command::new("psql")
        .args([&pg, "-qc", &format!("DROP SCHEMA \"{schema}\" CASCADE")])
        .output();
}
