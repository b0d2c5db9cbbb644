//! The gate's `delivery` span carries the delivery's W3C trace (`trace_id`, the sender's
//! `parent_id`, its own `span_id`), and the span id is the parent the delivery's outbox
//! event is published with — one delivery at a time and in a batch. Spans are captured by
//! a minimal subscriber (no tracing backend involved).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use idem_engine::{Gate, IdempotencyKey, OutcomeKind, TraceParent};
use idem_testkit::{encode_submission, EffectHandler, EffectHandlerFor, MemoryStore, SimBroker};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

const T1: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const T2: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

/// Every span's fields, by span id − 1.
#[derive(Debug, Default, Clone)]
struct Spans(Arc<Mutex<Vec<HashMap<String, String>>>>);

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl Spans {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<HashMap<String, String>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The `delivery` spans, in the order they were opened.
    fn deliveries(&self) -> Vec<HashMap<String, String>> {
        self.lock()
            .iter()
            .filter(|m| m.get("name").map(String::as_str) == Some("delivery"))
            .cloned()
            .collect()
    }

    /// The `delivery` spans whose `key` is `key`'s prefix (a batch's spans have it from
    /// the start; `process` records it through `Span::current()`, which this minimal
    /// subscriber does not track).
    fn of(&self, key: &IdempotencyKey) -> Vec<HashMap<String, String>> {
        self.lock()
            .iter()
            .filter(|m| {
                m.get("name").map(String::as_str) == Some("delivery")
                    && m.get("key") == Some(&key.short())
            })
            .cloned()
            .collect()
    }
}

impl Subscriber for Spans {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, attrs: &Attributes<'_>) -> Id {
        let mut m = HashMap::new();
        m.insert("name".to_owned(), attrs.metadata().name().to_owned());
        attrs.record(&mut Fields(&mut m));
        let mut all = self.lock();
        all.push(m);
        Id::from_u64(all.len() as u64)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut all = self.lock();
        let i = usize::try_from(span.into_u64()).unwrap_or(usize::MAX) - 1;
        if let Some(m) = all.get_mut(i) {
            values.record(&mut Fields(m));
        }
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

fn body(subject: &str) -> Vec<u8> {
    encode_submission(subject, "2026-07-01T09:00:00Z", 10)
}

fn key(subject: &str) -> IdempotencyKey {
    EffectHandler::parse(&body(subject)).expect("valid").key
}

fn traced(v: &str) -> Vec<(String, String)> {
    vec![("traceparent".to_owned(), v.to_owned())]
}

/// Runs `scenario` on a current-thread runtime with `spans` as the subscriber.
fn with_spans<F: std::future::Future>(spans: &Spans, scenario: F) -> F::Output {
    tracing::subscriber::with_default(spans.clone(), || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(scenario)
    })
}

/// Checks that `subject`'s delivery span and outbox event carry `incoming`'s trace (or
/// none), and that the event's parent is the span's own id.
fn check(spans: &Spans, store: &MemoryStore, subject: &str, incoming: Option<&str>) {
    let found = spans.of(&key(subject));
    assert_eq!(found.len(), 1, "{subject}: one delivery span: {found:?}");
    check_span(&found[0], store, subject, incoming);
}

/// [`check`] with the span given.
fn check_span(
    span: &HashMap<String, String>,
    store: &MemoryStore,
    subject: &str,
    incoming: Option<&str>,
) {
    let k = key(subject);
    let event = store
        .outbox()
        .into_iter()
        .map(|(e, _)| e)
        .find(|e| e.idempotency_key == k)
        .unwrap_or_else(|| panic!("{subject}: no outbox event"));
    match incoming {
        None => {
            for f in ["trace_id", "parent_id", "span_id"] {
                assert!(
                    !span.contains_key(f),
                    "{subject}: untraced, yet {f}: {span:?}"
                );
            }
            assert_eq!(event.traceparent, None, "{subject}: untraced event");
        }
        Some(incoming) => {
            let tp: TraceParent = incoming.parse().expect("valid");
            assert_eq!(span.get("trace_id"), Some(&tp.trace_id_hex()), "{subject}");
            assert_eq!(
                span.get("parent_id"),
                Some(&tp.parent_id_hex()),
                "{subject}"
            );
            let ev = event
                .traceparent
                .unwrap_or_else(|| panic!("{subject}: the event lost the trace"));
            assert_eq!(ev.trace_id(), tp.trace_id(), "{subject}");
            assert_eq!(
                span.get("span_id"),
                Some(&ev.parent_id_hex()),
                "{subject}: the event's parent is the delivery's span"
            );
            assert_ne!(ev.parent_id(), tp.parent_id(), "{subject}: a new span id");
        }
    }
}

#[test]
fn one_delivery_span_carries_its_trace() {
    let spans = Spans::default();
    let store = MemoryStore::new();
    let broker = SimBroker::new(1);
    broker.publish_with_headers(body("traced"), traced(T1));
    broker.publish(body("plain"));
    broker.publish_with_headers(body("malformed"), traced("00-zz-yy-01"));
    let gate = Gate::new(store.clone(), EffectHandlerFor::<MemoryStore>::new());
    with_spans(&spans, async {
        while let Some(d) = broker.receive() {
            assert_eq!(gate.process(d).await.kind(), OutcomeKind::Processed);
        }
    });
    let delivered = spans.deliveries();
    assert_eq!(delivered.len(), 3, "{delivered:?}");
    check_span(&delivered[0], &store, "traced", Some(T1));
    check_span(&delivered[1], &store, "plain", None);
    check_span(&delivered[2], &store, "malformed", None);
}

#[test]
fn each_delivery_of_a_batch_carries_its_own_trace() {
    let spans = Spans::default();
    let store = MemoryStore::new();
    let broker = SimBroker::new(2);
    broker.publish_with_headers(body("b-one"), traced(T1));
    broker.publish(body("b-plain"));
    broker.publish_with_headers(body("b-two"), traced(T2));
    let gate = Gate::new(store.clone(), EffectHandlerFor::<MemoryStore>::new());
    with_spans(&spans, async {
        let batch: Vec<_> = std::iter::from_fn(|| broker.receive()).collect();
        assert_eq!(batch.len(), 3);
        for o in gate.process_batch(batch).await {
            assert_eq!(o.kind(), OutcomeKind::Processed, "{o:?}");
        }
    });
    check(&spans, &store, "b-one", Some(T1));
    check(&spans, &store, "b-plain", None);
    check(&spans, &store, "b-two", Some(T2));
    for s in ["b-one", "b-plain", "b-two"] {
        assert_eq!(
            spans.of(&key(s))[0].get("batch").map(String::as_str),
            Some("3"),
            "{s}: the batch's span"
        );
    }
}

/// A batch with a single traced delivery: only its event is traced (the others' events
/// must not borrow its trace).
#[test]
fn one_traced_delivery_in_a_batch_traces_only_its_own_event() {
    let spans = Spans::default();
    let store = MemoryStore::new();
    let broker = SimBroker::new(3);
    broker.publish(body("c-plain-1"));
    broker.publish_with_headers(body("c-one"), traced(T1));
    broker.publish(body("c-plain-2"));
    let gate = Gate::new(store.clone(), EffectHandlerFor::<MemoryStore>::new());
    with_spans(&spans, async {
        let batch: Vec<_> = std::iter::from_fn(|| broker.receive()).collect();
        for o in gate.process_batch(batch).await {
            assert_eq!(o.kind(), OutcomeKind::Processed, "{o:?}");
        }
    });
    check(&spans, &store, "c-plain-1", None);
    check(&spans, &store, "c-one", Some(T1));
    check(&spans, &store, "c-plain-2", None);
}
