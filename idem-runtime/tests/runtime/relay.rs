//! Core's `Relay` run with `idem-runtime`'s timer over an outbox whose failures the test
//! controls: retries with backoff, the give-up deadline, the poison event moved aside,
//! shutdown during a wait, idle exit, and a configuration error.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_engine::outbox::{Backoff, RelayObserver};
use idem_engine::{
    async_trait, Error, IdempotencyKey, OutboxBacklog, OutboxBatch, OutboxEvent, OutboxSource,
    PublishError, Publisher, Relay, StoreError,
};

#[derive(Default)]
struct Row {
    event: Option<OutboxEvent>,
    published: bool,
    leased: bool,
    attempts: u32,
    failed: bool,
}

#[derive(Default, Clone)]
struct Outbox {
    rows: Arc<Mutex<Vec<Row>>>,
    /// Lease calls that fail with a store `Config` error.
    config_error: Arc<AtomicU32>,
}

fn event(i: usize, subject: &str) -> OutboxEvent {
    let key = IdempotencyKey::derive(subject, &i.to_string(), b"{}").unwrap();
    OutboxEvent::new(key, "t", subject, format!("{{\"n\":{i}}}"))
}

impl Outbox {
    fn with(events: &[(usize, &str)]) -> Self {
        let o = Self::default();
        o.rows
            .lock()
            .unwrap()
            .extend(events.iter().map(|(i, s)| Row {
                event: Some(event(*i, s)),
                ..Row::default()
            }));
        o
    }
}

struct Batch {
    rows: Arc<Mutex<Vec<Row>>>,
    idx: Vec<usize>,
    events: Vec<OutboxEvent>,
}

#[async_trait]
impl OutboxBatch for Batch {
    fn events(&self) -> &[OutboxEvent] {
        &self.events
    }
    async fn mark_published(self) -> Result<(), StoreError> {
        let mut rows = self.rows.lock().unwrap();
        for i in &self.idx {
            rows[*i].published = true;
            rows[*i].leased = false;
        }
        Ok(())
    }
    async fn release(self) -> Result<(), StoreError> {
        let mut rows = self.rows.lock().unwrap();
        for i in &self.idx {
            rows[*i].leased = false;
        }
        Ok(())
    }
    async fn record_failure(self, _reason: &str, max: u32) -> Result<u64, StoreError> {
        let mut rows = self.rows.lock().unwrap();
        let mut moved = 0;
        for i in &self.idx {
            let r = &mut rows[*i];
            r.leased = false;
            r.attempts += 1;
            if r.attempts >= max {
                r.failed = true;
                moved += 1;
            }
        }
        Ok(moved)
    }
}

#[async_trait]
impl OutboxSource for Outbox {
    type Batch = Batch;
    async fn lease(&self, max: usize) -> Result<Batch, StoreError> {
        if self.config_error.load(Ordering::SeqCst) > 0 {
            return Err(StoreError::Config(
                "relation \"outbox\" does not exist".into(),
            ));
        }
        let mut rows = self.rows.lock().unwrap();
        let (mut idx, mut events) = (Vec::new(), Vec::new());
        for (i, r) in rows.iter_mut().enumerate() {
            if r.published || r.failed || r.leased || idx.len() >= max {
                continue;
            }
            r.leased = true;
            idx.push(i);
            events.push(r.event.clone().unwrap());
        }
        Ok(Batch {
            rows: Arc::clone(&self.rows),
            idx,
            events,
        })
    }
    async fn wait(&self) -> Result<(), StoreError> {
        tokio::time::sleep(Duration::from_millis(10)).await;
        Ok(())
    }
    async fn backlog(&self) -> Result<OutboxBacklog, StoreError> {
        Ok(OutboxBacklog::default())
    }
}

/// Records what it publishes; fails retryably `transient` more times; refuses for good
/// every batch holding an event of subject `poison`.
#[derive(Default)]
struct Broker {
    sent: Mutex<Vec<OutboxEvent>>,
    transient: AtomicU32,
    always_down: bool,
}

#[async_trait]
impl Publisher for Broker {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        if self.always_down {
            return Err(PublishError::new("connection refused", true, None));
        }
        if self
            .transient
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(PublishError::new("connection reset", true, None));
        }
        if events.iter().any(|e| e.subject == "poison") {
            return Err(PublishError::new("message too large", false, None));
        }
        self.sent.lock().unwrap().extend(events.iter().cloned());
        Ok(())
    }
}

#[derive(Default)]
struct Seen {
    published: AtomicU32,
    failed: AtomicU32,
    moved: AtomicU32,
}

impl RelayObserver for Seen {
    fn published(&self, events: usize) {
        self.published.fetch_add(events as u32, Ordering::SeqCst);
    }
    fn failed(&self, _e: &Error, _retry_in: Duration) {
        self.failed.fetch_add(1, Ordering::SeqCst);
    }
    fn moved_aside(&self, events: u64, _reason: &str) {
        self.moved.fetch_add(events as u32, Ordering::SeqCst);
    }
}

fn fast() -> idem_engine::RelayOptions {
    idem_runtime::relay_options()
        .backoff(Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(5),
        ))
        .exit_when_idle(Some(Duration::from_millis(100)))
}

/// A hang guard, not a timing assertion.
async fn guarded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("the relay did not return")
}

#[tokio::test]
async fn retryable_failures_are_retried_with_backoff_and_nothing_is_lost() {
    let outbox = Outbox::with(&[(1, "a"), (2, "b"), (3, "a")]);
    let broker = Broker {
        transient: AtomicU32::new(3),
        ..Broker::default()
    };
    let seen = Arc::new(Seen::default());
    let relay = Relay::with_options(
        outbox.clone(),
        broker,
        fast().batch_size(2).observer(seen.clone()),
    );
    let stats = guarded(relay.run(std::future::pending())).await.unwrap();
    assert_eq!(stats.published, 3);
    assert_eq!(stats.failed_batches, 3);
    assert_eq!(seen.failed.load(Ordering::SeqCst), 3);
    assert_eq!(seen.published.load(Ordering::SeqCst), 3);
    let sent = relay.publisher().sent.lock().unwrap();
    let order: Vec<&str> = sent
        .iter()
        .map(|e| &e.payload[..])
        .map(|p| std::str::from_utf8(p).unwrap())
        .collect();
    assert_eq!(order, ["{\"n\":1}", "{\"n\":2}", "{\"n\":3}"]);
}

#[tokio::test]
async fn a_broker_down_past_the_deadline_ends_the_run_with_its_error() {
    let outbox = Outbox::with(&[(1, "a")]);
    let broker = Broker {
        always_down: true,
        ..Broker::default()
    };
    let relay = Relay::with_options(
        outbox,
        broker,
        fast()
            .exit_when_idle(None)
            .give_up_after(Some(Duration::from_millis(200))),
    );
    let err = guarded(relay.run(std::future::pending()))
        .await
        .unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert!(err.to_string().contains("connection refused"), "{err}");
}

#[tokio::test]
async fn an_event_refused_for_good_is_moved_aside_and_the_rest_flows() {
    // The poison event is at the head, in one batch with good events of its own and
    // other subjects.
    let outbox = Outbox::with(&[(1, "poison"), (2, "a"), (3, "b"), (4, "a")]);
    let seen = Arc::new(Seen::default());
    let relay = Relay::with_options(
        outbox.clone(),
        Broker::default(),
        fast()
            .batch_size(10)
            .max_publish_attempts(3)
            .observer(seen.clone()),
    );
    let stats = guarded(relay.run(std::future::pending())).await.unwrap();
    assert_eq!(stats.published, 3);
    assert_eq!(stats.moved_aside, 1);
    assert_eq!(seen.moved.load(Ordering::SeqCst), 1);
    let rows = outbox.rows.lock().unwrap();
    assert!(rows[0].failed && !rows[0].published);
    assert_eq!(
        rows[0].attempts, 3,
        "charged exactly max_publish_attempts times"
    );
    assert!(rows[1..].iter().all(|r| r.published && r.attempts == 0));
    let sent = relay.publisher().sent.lock().unwrap();
    let subjects: Vec<&str> = sent.iter().map(|e| e.subject.as_str()).collect();
    assert_eq!(subjects, ["a", "b", "a"]);
}

#[tokio::test]
async fn shutdown_cuts_a_backoff_wait_short() {
    let outbox = Outbox::with(&[(1, "a")]);
    let broker = Broker {
        always_down: true,
        ..Broker::default()
    };
    // A wait of an hour after the first failure: only shutdown can end it.
    let relay = Relay::with_options(
        outbox,
        broker,
        idem_runtime::relay_options().backoff(Backoff::new(
            Duration::from_secs(3600),
            Duration::from_secs(3600),
        )),
    );
    let stop = async { tokio::time::sleep(Duration::from_millis(100)).await };
    let stats = guarded(relay.run(stop)).await.unwrap();
    assert_eq!(stats.failed_batches, 1);
    assert_eq!(stats.published, 0);
}

#[tokio::test]
async fn an_idle_relay_exits_and_a_config_error_stops_at_once() {
    let relay = Relay::with_options(Outbox::default(), Broker::default(), fast());
    let stats = guarded(relay.run(std::future::pending())).await.unwrap();
    assert_eq!(stats.published, 0);

    let outbox = Outbox::with(&[(1, "a")]);
    outbox.config_error.store(1, Ordering::SeqCst);
    let relay = Relay::with_options(
        outbox,
        Broker::default(),
        fast().exit_when_idle(None).give_up_after(None),
    );
    let err = guarded(relay.run(std::future::pending()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Store(StoreError::Config(_))), "{err}");
}
