//! Issue 16's sixth done-criterion, through the `idem` binary on real services: a W3C
//! `traceparent` survives consume → outbox → relay → downstream. `idem publish --header
//! traceparent=…` puts it on a grant submission in RabbitMQ (or NATS); `idem consume`
//! writes the outbox row in Postgres with the same trace id (and the consumer's span as
//! parent); `idem relay` publishes the event with it as the `traceparent` header. An
//! untraced submission stays untraced, and one with a malformed `traceparent` is
//! processed (never dead-lettered) and published untraced.
//!
//! RabbitMQ at `IDEM_TEST_AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//! NATS at `IDEM_TEST_NATS_URL` (default `nats://127.0.0.1:4222`), Postgres at
//! `IDEM_TEST_POSTGRES_URL`; a missing service fails the test.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use futures::StreamExt as _;
use idem_broker::any::{pending_count, AnyConsumer, BrokerUrl};
use idem_broker::until_idle;
use idem_engine::TraceParent;

use crate::common;
use common::{amqp_url, idem, ok, pg_url, psql, report_value, rt, text};

/// The W3C example trace, as a sender would put it on the submission.
const TRACED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// Upper-case hex: not a valid traceparent.
const MALFORMED: &str = "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01";

fn nats_url() -> String {
    std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// The messages in `name` by award id, each with its `traceparent` header if any; read
/// without settling.
fn read_downstream(url: &str, name: &str) -> BTreeMap<String, Option<String>> {
    rt().block_on(async {
        let url = BrokerUrl::parse(url).expect("broker URL");
        let consumer = AnyConsumer::connect(&url, name, 1000)
            .await
            .expect("connect downstream");
        let mut held = Vec::new();
        let mut out = BTreeMap::new();
        let mut stream = std::pin::pin!(until_idle(consumer, Duration::from_secs(3)));
        while let Some(item) = stream.next().await {
            let d = item.expect("delivery");
            let body: serde_json::Value = serde_json::from_slice(&d.payload).expect("a JSON event");
            let award = body["award_id"].as_str().expect("award_id").to_owned();
            let before = out.insert(award.clone(), d.header("traceparent").map(str::to_owned));
            assert!(before.is_none(), "{award} published twice");
            held.push(d);
        }
        out
    })
}

/// Publishes three submissions (traced, untraced, malformed trace) to `broker`, consumes
/// them into Postgres and relays their events to a downstream queue of the same broker;
/// checks the trace at each step.
fn trace_survives(broker: &str, kind: &str) {
    let tag = format!("{}_{:08x}", std::process::id(), rand::random::<u32>());
    let queue = format!("idem-trace-{kind}-{tag}").replace('_', "-");
    let down = format!("{queue}-down");
    let schema = format!("trace_{kind}_{tag}");
    let store = pg_url();
    let dir = tempfile::tempdir().expect("tempdir");
    let award = |what: &str| format!("TR-{tag}-{what}");
    let cases = [
        ("traced", Some(TRACED)),
        ("untraced", None),
        ("malformed", Some(MALFORMED)),
    ];

    ok(
        &idem(&["migrate", "--store", &store, "--schema", &schema]),
        "migrate",
    );
    for (what, header) in cases {
        let body = serde_json::json!({
            "award_id": award(what),
            "submission_timestamp": "2026-07-01T09:00:00Z",
            "amount_cents": 1000
        })
        .to_string();
        let file = dir.path().join(format!("{what}.jsonl"));
        std::fs::write(&file, body + "\n").expect("write");
        let file = file.to_str().expect("utf-8").to_owned();
        let mut args = vec![
            "publish".to_owned(),
            "--broker".to_owned(),
            broker.to_owned(),
            "--destination".to_owned(),
            queue.clone(),
            "--file".to_owned(),
            file,
        ];
        if let Some(h) = header {
            args.extend(["--header".to_owned(), format!("traceparent={h}")]);
        }
        let out = idem(&args);
        ok(&out, &format!("publish {what}"));
        if what == "malformed" {
            assert!(
                text(&out.stderr).contains("not a valid W3C traceparent"),
                "publish warns: {}",
                text(&out.stderr)
            );
        }
    }

    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "consume",
            "--broker",
            broker,
            "--source",
            &queue,
            "--store",
            &store,
            "--schema",
            &schema,
            "--exit-when-idle",
            "3",
        ])
        .env("RUST_LOG", "warn,idem::gate=debug")
        .output()
        .expect("run idem consume");
    let consumed = ok(&out, "consume");
    // The delivery's span carries the trace id into the consumer's log.
    let logged: Vec<String> = text(&out.stderr)
        .lines()
        .filter(|l| l.contains("delivery settled") && l.contains("trace_id"))
        .map(str::to_owned)
        .collect();
    assert_eq!(
        logged.len(),
        1,
        "one traced delivery: {}",
        text(&out.stderr)
    );
    assert!(
        logged[0].contains("4bf92f3577b34da6a3ce929d0e0e4736")
            && logged[0].contains("00f067aa0ba902b7"),
        "{}",
        logged[0]
    );
    assert_eq!(report_value(&consumed, "processed"), 3, "{consumed}");
    assert_eq!(
        report_value(&consumed, "rejected"),
        0,
        "a malformed traceparent is no reason to dead-letter: {consumed}"
    );

    // The outbox rows: the traced one holds the sender's trace id with a new parent id.
    let rows: BTreeMap<String, String> = psql(&format!(
        "SELECT subject || '|' || coalesce(traceparent, '') FROM \"{schema}\".outbox"
    ))
    .lines()
    .filter_map(|l| l.split_once('|'))
    .map(|(s, t)| (s.to_owned(), t.to_owned()))
    .collect();
    assert_eq!(rows.len(), 3, "{rows:?}");
    let sent: TraceParent = TRACED.parse().expect("valid");
    let stored: TraceParent = rows[&award("traced")]
        .parse()
        .unwrap_or_else(|e| panic!("the outbox row holds a traceparent ({e}): {rows:?}"));
    assert_eq!(stored.trace_id_hex(), sent.trace_id_hex(), "same trace");
    assert_ne!(
        stored.parent_id_hex(),
        sent.parent_id_hex(),
        "the consumer's span is the event's parent"
    );
    assert!(
        logged[0].contains(&stored.parent_id_hex()),
        "the logged span_id is the stored parent: {}",
        logged[0]
    );
    assert_eq!(rows[&award("untraced")], "", "{rows:?}");
    assert_eq!(rows[&award("malformed")], "", "{rows:?}");

    let relayed = ok(
        &idem(&[
            "relay",
            "--store",
            &store,
            "--schema",
            &schema,
            "--broker",
            broker,
            "--destination",
            &down,
            "--exit-when-idle",
            "2",
        ]),
        "relay",
    );
    assert_eq!(report_value(&relayed, "published"), 3, "{relayed}");

    let got = read_downstream(broker, &down);
    assert_eq!(got.len(), 3, "{got:?}");
    let header = got[&award("traced")]
        .as_deref()
        .unwrap_or_else(|| panic!("the traced event lost its traceparent downstream: {got:?}"));
    let downstream: TraceParent = header.parse().expect("a valid traceparent downstream");
    assert_eq!(
        downstream.trace_id_hex(),
        sent.trace_id_hex(),
        "one trace from broker to broker"
    );
    assert_eq!(
        downstream, stored,
        "the relay publishes what the outbox holds"
    );
    assert_eq!(got[&award("untraced")], None, "{got:?}");
    assert_eq!(got[&award("malformed")], None, "{got:?}");

    let left = rt()
        .block_on(pending_count(
            &BrokerUrl::parse(broker).expect("url"),
            &queue,
        ))
        .expect("count");
    assert_eq!(left, 0, "the source is drained");
    psql(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"));
}

#[test]
fn a_traceparent_survives_rabbitmq_consume_outbox_relay_downstream() {
    trace_survives(&amqp_url(), "amqp");
}

#[test]
fn a_traceparent_survives_nats_consume_outbox_relay_downstream() {
    trace_survives(&nats_url(), "nats");
}

#[test]
fn a_malformed_header_option_exits_2() {
    for bad in ["traceparent", "=x", "a b=c"] {
        let out = idem(&[
            "publish",
            "--broker",
            "amqp://127.0.0.1:1/%2f",
            "--destination",
            "q",
            "--file",
            "-",
            "--header",
            bad,
        ]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "--header {bad:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains("--header"),
            "names the option: {}",
            text(&out.stderr)
        );
    }
}
