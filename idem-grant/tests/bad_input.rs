//! Bad input, end to end: each kind of malformed submission, published to the simulated
//! at-least-once broker and run through a `Gate` with the grant handler, ends as a typed
//! `Rejected` outcome, dead-lettered once with its reason code — never looped (delivered
//! exactly once), never lost (in the dead-letter place, byte for byte), the broker
//! settled, and no claim, disbursement or outbox row written for it.

#![cfg(feature = "memory")]

use idem_engine::{Gate, Outcome};
use idem_grant::{
    GrantDb, GrantHandler, DEFAULT_MAX_BODY, MAX_AWARD_ID_BYTES, MAX_TIMESTAMP_BYTES,
};
use idem_sim::{MemoryStore, SimBroker};

const VALID: &[u8] =
    br#"{"award_id":"A-2026-014","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":125000}"#;

/// An award id one byte over the limit (and far under what the bodies may carry).
fn long_award_id() -> Vec<u8> {
    format!(
        "{{\"award_id\":\"{}\",\"submission_timestamp\":\"2026-07-01T09:00:00Z\",\"amount_cents\":1}}",
        "B".repeat(MAX_AWARD_ID_BYTES + 1)
    )
    .into_bytes()
}

/// (what, body, expected reason code).
fn cases() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let mut too_large = br#"{"award_id":"A-1","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":1,"note":""#.to_vec();
    too_large.resize(DEFAULT_MAX_BODY, b'x');
    too_large.extend_from_slice(b"\"}");
    vec![
        ("empty body", Vec::new(), "empty_body"),
        ("over the size limit", too_large, "too_large"),
        ("invalid UTF-8", vec![b'{', 0xff, 0xfe, b'}'], "not_utf8"),
        (
            "invalid UTF-8 inside a string",
            b"{\"award_id\":\"A-\xc3\x28\",\"submission_timestamp\":\"t\",\"amount_cents\":1}"
                .to_vec(),
            "not_utf8",
        ),
        ("not JSON", b"{not json".to_vec(), "not_json"),
        ("truncated JSON", VALID[..VALID.len() - 1].to_vec(), "not_json"),
        ("not an object", b"[1,2]".to_vec(), "not_object"),
        ("a bare string", b"\"A-1\"".to_vec(), "not_object"),
        (
            "missing award_id",
            br#"{"submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":1}"#.to_vec(),
            "missing_field",
        ),
        (
            "missing submission_timestamp",
            br#"{"award_id":"A-1","amount_cents":1}"#.to_vec(),
            "missing_field",
        ),
        (
            "missing amount_cents",
            br#"{"award_id":"A-1","submission_timestamp":"2026-07-01T09:00:00Z"}"#.to_vec(),
            "missing_field",
        ),
        (
            "empty award_id",
            br#"{"award_id":"","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":1}"#
                .to_vec(),
            "missing_field",
        ),
        (
            "null award_id",
            br#"{"award_id":null,"submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":1}"#
                .to_vec(),
            "missing_field",
        ),
        (
            "award_id a number",
            br#"{"award_id":7,"submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":1}"#
                .to_vec(),
            "wrong_type",
        ),
        (
            "amount_cents a string",
            br#"{"award_id":"A-1","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":"1"}"#
                .to_vec(),
            "wrong_type",
        ),
        (
            "amount_cents a fraction",
            br#"{"award_id":"A-1","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":1.5}"#
                .to_vec(),
            "not_integer",
        ),
        (
            "amount_cents beyond i64",
            br#"{"award_id":"A-1","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":18446744073709551615}"#
                .to_vec(),
            "not_integer",
        ),
        (
            "negative amount",
            br#"{"award_id":"A-1","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":-1}"#
                .to_vec(),
            "negative_amount",
        ),
        (
            "NUL in the award id",
            b"{\"award_id\":\"A-\\u00001\",\"submission_timestamp\":\"2026-07-01T09:00:00Z\",\"amount_cents\":1}".to_vec(),
            "control_character",
        ),
        (
            "NUL in the timestamp",
            b"{\"award_id\":\"A-1\",\"submission_timestamp\":\"2026-07-01T09:00:00Z\\u0000\",\"amount_cents\":1}".to_vec(),
            "control_character",
        ),
        (
            "a newline in the award id",
            b"{\"award_id\":\"A-\\n1\",\"submission_timestamp\":\"2026-07-01T09:00:00Z\",\"amount_cents\":1}".to_vec(),
            "control_character",
        ),
        ("an award id over the length limit", long_award_id(), "too_long"),
        (
            "a timestamp over the length limit",
            format!(
                "{{\"award_id\":\"A-1\",\"submission_timestamp\":\"2026-07-01T09:00:00Z{}\",\"amount_cents\":1}}",
                "0".repeat(MAX_TIMESTAMP_BYTES)
            )
            .into_bytes(),
            "too_long",
        ),
        (
            "| in the award id",
            br#"{"award_id":"A|1","submission_timestamp":"2026-07-01T09:00:00Z","amount_cents":1}"#
                .to_vec(),
            "invalid_identity",
        ),
    ]
}

/// A minimal executor (idem-grant has no runtime dependency; the in-memory store and the
/// simulated broker need none).
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

#[test]
fn every_malformed_submission_is_dead_lettered_once_with_its_reason() {
    block_on(malformed());
}

async fn malformed() {
    let broker = SimBroker::new(7);
    let store = MemoryStore::new();
    store.migrate_grants().await.expect("tables");
    let cases = cases();
    for (_, body, _) in &cases {
        broker.publish(body.clone());
    }
    broker.publish(VALID.to_vec());
    let gate = Gate::new(store.clone(), GrantHandler::new());

    let mut outcomes = Vec::new();
    // A bound: a looping message would exceed it.
    for _ in 0..(cases.len() + 1) * 3 {
        let Some(delivery) = broker.receive() else {
            break;
        };
        outcomes.push(gate.process(delivery).await);
    }
    assert!(broker.is_settled(), "nothing ready or in flight");
    assert_eq!(
        outcomes.len(),
        cases.len() + 1,
        "every message delivered exactly once (none looped)"
    );

    for ((what, _, code), outcome) in cases.iter().zip(&outcomes) {
        match outcome {
            Outcome::Rejected { reason, settle } => {
                assert_eq!(reason.code, *code, "{what}: {reason}");
                assert!(settle.is_ok(), "{what}: dead-lettering failed: {settle:?}");
                assert!(
                    !reason.detail.contains("A-1") && !reason.detail.contains("2026"),
                    "{what}: the reason quotes the payload: {reason}"
                );
            }
            other => panic!("{what}: expected Rejected({code}), got {other:?}"),
        }
    }
    assert!(
        matches!(outcomes.last(), Some(Outcome::Processed { .. })),
        "the valid submission beside them: {:?}",
        outcomes.last()
    );

    // Never lost: each one is in the dead-letter place, bytes unchanged, delivered once.
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), cases.len());
    for ((what, body, code), (msg, reason)) in cases.iter().zip(&dead) {
        assert_eq!(&msg.payload, body, "{what}: dead letter's bytes");
        assert_eq!(reason.code, *code, "{what}");
        assert_eq!(msg.deliveries, 1, "{what}: delivered more than once");
    }
    let stats = broker.stats();
    assert_eq!(
        stats.deliveries, stats.published,
        "no redelivery: {stats:?}"
    );
    assert_eq!(stats.dead_lettered, cases.len() as u64);
    assert_eq!(stats.nacks, 0, "bad input is never nacked into a loop");

    // No effect from any of them: one claim, one disbursement, one event (the valid one).
    assert_eq!(store.claim_rows().await.expect("claims"), 1);
    assert_eq!(store.ledger().await.expect("ledger").len(), 1);
    assert_eq!(store.outbox_rows().await.expect("outbox"), 1);
}

#[test]
fn a_lower_size_limit_applies_and_a_body_at_the_limit_passes() {
    block_on(size_limit());
}

async fn size_limit() {
    let broker = SimBroker::new(8);
    let store = MemoryStore::new();
    store.migrate_grants().await.expect("tables");
    let gate = Gate::new(
        store.clone(),
        GrantHandler::new().with_max_body(VALID.len()),
    );
    let mut over = VALID.to_vec();
    over.insert(1, b' ');
    broker.publish(VALID.to_vec());
    broker.publish(over);
    let a = gate.process(broker.receive().expect("one")).await;
    let b = gate.process(broker.receive().expect("two")).await;
    assert!(matches!(a, Outcome::Processed { .. }), "{a:?}");
    match b {
        Outcome::Rejected { reason, .. } => assert_eq!(reason.code, "too_large"),
        other => panic!("{other:?}"),
    }
    assert!(broker.is_settled());
    assert_eq!(broker.dead_letters().len(), 1);
}
