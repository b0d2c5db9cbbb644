//! An outbox source over the store's outbox: its backlog and its traceparent.

use std::time::Duration;

use idem_engine::ClaimTx;
use idem_engine::{ClaimOutcome, Gate, IdempotencyKey, OutcomeKind};

use super::{key, meta};
use crate::broker::SimBroker;

/// An outbox source's [`backlog`](idem_engine::OutboxSource::backlog) follows the relay:
/// empty at first; after three committed events, three pending with a small age; after a
/// batch of two is published, one; after the rest, none. `store` and `source` must share
/// one fresh outbox (a store and a relay source over it).
pub async fn outbox_backlog_tracks_the_relay<S, O>(store: S, source: O)
where
    S: idem_engine::ClaimStore,
    S::Tx: idem_engine::OutboxWriter,
    O: idem_engine::OutboxSource,
{
    use idem_engine::{OutboxBatch as _, OutboxEvent, OutboxWriter as _};

    let empty = source.backlog().await.expect("backlog");
    assert_eq!(
        empty,
        idem_engine::OutboxBacklog::default(),
        "a fresh outbox has no backlog"
    );
    // A rolled-back event is no backlog.
    let mut tx = store.begin().await.expect("begin");
    let k = key("backlog-rolled-back");
    tx.enqueue(&OutboxEvent::new(k, "backlog.test", "B-0", b"{}".to_vec()))
        .await
        .expect("enqueue");
    tx.rollback().await.expect("rollback");
    for i in 1..=3 {
        let name = format!("backlog-{i}");
        let k = key(&name);
        let mut tx = store.begin().await.expect("begin");
        assert!(
            matches!(
                tx.claim(&k, &meta(&name)).await.expect("claim"),
                ClaimOutcome::Claimed
            ),
            "fresh key"
        );
        tx.enqueue(&OutboxEvent::new(k, "backlog.test", name, b"{}".to_vec()))
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
    }
    let three = source.backlog().await.expect("backlog");
    assert_eq!(
        three.pending, 3,
        "three committed events are pending: {three:?}"
    );
    let age = three.oldest_age.expect("an age while events are pending");
    assert!(
        age < Duration::from_secs(60),
        "the oldest pending event was committed just now, not {age:?} ago"
    );

    let batch = source.lease(2).await.expect("lease");
    assert_eq!(batch.events().len(), 2, "lease of two");
    batch.mark_published().await.expect("mark");
    let one = source.backlog().await.expect("backlog");
    assert_eq!(one.pending, 1, "one left after publishing two: {one:?}");
    assert!(one.oldest_age.is_some(), "an age while one is pending");

    let batch = source.lease(10).await.expect("lease");
    assert_eq!(batch.events().len(), 1, "the last one");
    batch.mark_published().await.expect("mark");
    assert_eq!(
        source.backlog().await.expect("backlog"),
        idem_engine::OutboxBacklog::default(),
        "nothing pending once everything is published"
    );
}

/// The handler of [`outbox_carries_the_traceparent`]: the body is the subject, and each
/// submission writes one event made with [`OutboxEvent::new`](idem_engine::OutboxEvent::new)
/// (nothing about tracing: the gate supplies it).
struct OneEventEach;

#[async_trait::async_trait]
impl<Tx> idem_engine::Handler<Tx> for OneEventEach
where
    Tx: idem_engine::ClaimTx + idem_engine::OutboxWriter + Send,
{
    type Input = ();

    fn identify(
        &self,
        payload: &[u8],
        _headers: &idem_engine::Headers,
    ) -> Result<idem_engine::Submission<()>, idem_engine::RejectReason> {
        let subject = String::from_utf8_lossy(payload).into_owned();
        Ok(idem_engine::Submission {
            key: IdempotencyKey::derive(&subject, "2026-07-01T09:00:00Z", payload)?,
            subject,
            input: (),
        })
    }

    async fn handle(
        &self,
        tx: &mut Tx,
        sub: &idem_engine::Submission<()>,
    ) -> Result<(), idem_engine::HandlerError> {
        let body = serde_json::json!({ "subject": sub.subject }).to_string();
        tx.enqueue(&idem_engine::OutboxEvent::new(
            sub.key,
            "trace.test",
            sub.subject.clone(),
            body,
        ))
        .await?;
        Ok(())
    }
}

/// A delivery's W3C `traceparent` reaches its outbox event and the relay's message: the
/// gate processes traced, untraced and malformed-traced deliveries one at a time and in a
/// batch (where each event must get its own delivery's trace); the source must give each
/// event back with the delivery's trace id and a new parent id (the delivery's span),
/// none for the others; the relay must publish it as the `traceparent` header, unchanged.
/// `store` and `source` must share one fresh outbox.
pub async fn outbox_carries_the_traceparent<S, O>(store: S, source: O)
where
    S: idem_engine::ClaimStore,
    S::Tx: idem_engine::OutboxWriter,
    O: idem_engine::OutboxSource,
{
    use std::collections::BTreeMap;

    use idem_engine::{OutboxBatch as _, Relay, TraceParent};

    const T1: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const T2: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    const T3: &str = "00-11111111111111111111111111111111-2222222222222222-01";
    // Upper-case hex: not a valid traceparent, so ignored (processed untraced).
    const BAD: &str = "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01";
    let tp = |v: &str| vec![("traceparent".to_owned(), v.to_owned())];
    let upstream = SimBroker::new(7);
    let gate = Gate::new(store, OneEventEach);

    // (subject, the incoming traceparent if valid)
    let single = [
        ("trace-single", Some(T1)),
        ("trace-untraced", None),
        ("trace-malformed", None),
    ];
    upstream.publish_with_headers("trace-single", tp(T1));
    upstream.publish_with_headers("trace-untraced", Vec::new());
    upstream.publish_with_headers("trace-malformed", tp(BAD));
    for (subject, _) in &single {
        let d = upstream.receive().expect("a delivery");
        let outcome = gate.process(d).await;
        assert_eq!(
            outcome.kind(),
            OutcomeKind::Processed,
            "{subject}: {outcome:?}"
        );
    }
    let batched = [
        ("trace-batch-1", Some(T2)),
        ("trace-batch-2", Some(T3)),
        ("trace-batch-3", None),
    ];
    upstream.publish_with_headers("trace-batch-1", tp(T2));
    upstream.publish_with_headers("trace-batch-2", tp(T3));
    upstream.publish_with_headers("trace-batch-3", Vec::new());
    let batch: Vec<_> = (0..3)
        .map(|_| upstream.receive().expect("a delivery"))
        .collect();
    for o in gate.process_batch(batch).await {
        assert_eq!(o.kind(), OutcomeKind::Processed, "{o:?}");
    }
    let expected: BTreeMap<&str, Option<TraceParent>> = single
        .iter()
        .chain(&batched)
        .map(|(s, t)| (*s, t.map(|t| t.parse().expect("a valid traceparent"))))
        .collect();

    // The outbox gives each event back with its delivery's trace.
    let leased = source.lease(100).await.expect("lease");
    let stored: BTreeMap<String, Option<TraceParent>> = leased
        .events()
        .iter()
        .map(|e| (e.subject.clone(), e.traceparent))
        .collect();
    assert_eq!(
        stored.len(),
        expected.len(),
        "one event per delivery: {stored:?}"
    );
    for (subject, want) in &expected {
        let got = stored
            .get(*subject)
            .unwrap_or_else(|| panic!("no outbox event for {subject}"));
        match (want, got) {
            (None, None) => {}
            (Some(w), Some(g)) => {
                assert_eq!(
                    g.trace_id(),
                    w.trace_id(),
                    "{subject}: the trace id is kept"
                );
                assert_eq!(g.flags(), w.flags(), "{subject}: the flags are kept");
                assert_ne!(
                    g.parent_id(),
                    w.parent_id(),
                    "{subject}: the event's parent is the delivery's own span, not the sender's"
                );
            }
            _ => panic!("{subject}: expected trace {want:?}, the outbox holds {got:?}"),
        }
    }
    leased.release().await.expect("release");

    // The relay publishes what the outbox holds, as the `traceparent` header.
    let downstream = SimBroker::new(8);
    let relay = Relay::new(source, downstream.clone(), 100);
    assert_eq!(relay.run_once().await.expect("relay"), expected.len());
    let mut seen = 0;
    // Held until the end: a delivery dropped unsettled goes back to the queue.
    let mut held = Vec::new();
    while let Some(d) = downstream.receive() {
        let body = String::from_utf8_lossy(&d.payload).into_owned();
        let (subject, want) = stored
            .iter()
            .find(|(s, _)| body.contains(&format!("\"{s}\"")))
            .unwrap_or_else(|| panic!("an unknown message {body}"));
        assert_eq!(
            d.header("traceparent"),
            want.map(|t| t.to_string()).as_deref(),
            "{subject}: the published traceparent is the stored one"
        );
        seen += 1;
        held.push(d);
    }
    assert_eq!(seen, expected.len(), "every event published once");
}
