//! The relay source: several relays at once never publish a row twice concurrently and
//! keep each subject's order; a crash between publishing and marking republishes the same
//! event ids; NOTIFY wakes the relay only on commit.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_engine::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, EventId, IdempotencyKey, OutboxBatch,
    OutboxEvent, OutboxSource, OutboxWriter, PublishError, Publisher, Relay,
};
use idem_store_postgres::{PgOutboxSource, PgStore};
use idem_testkit::SimBroker;

fn key(n: usize) -> IdempotencyKey {
    IdempotencyKey::derive(
        &format!("S-{n}"),
        "2026-07-01T09:00:00Z",
        n.to_string().as_bytes(),
    )
    .expect("key")
}

fn ids(events: &[OutboxEvent]) -> Vec<EventId> {
    events.iter().map(|e| e.event_id).collect()
}

fn event(n: usize, subject: &str) -> OutboxEvent {
    OutboxEvent::new(
        key(n),
        "effect.recorded",
        subject,
        format!("{{\"n\":{n},\"subject\":\"{subject}\"}}"),
    )
}

/// Commits `events` in one claim transaction each.
async fn commit_events(store: &PgStore, events: &[OutboxEvent]) {
    for ev in events {
        let mut tx = store.begin().await.expect("begin");
        assert_eq!(
            tx.claim(&ev.idempotency_key, &ClaimMeta::new(ev.subject.clone()))
                .await
                .expect("claim"),
            ClaimOutcome::Claimed
        );
        tx.enqueue(ev).await.expect("enqueue");
        tx.commit().await.expect("commit");
    }
}

/// A publisher that takes its time, so relays overlap, and records which batches were
/// in flight at once.
#[derive(Clone)]
struct SlowPublisher {
    broker: SimBroker,
    in_flight: Arc<std::sync::Mutex<HashSet<EventId>>>,
    overlaps: Arc<std::sync::atomic::AtomicU64>,
}

#[async_trait]
impl Publisher for SlowPublisher {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        {
            let mut f = self.in_flight.lock().expect("lock");
            for e in events {
                if !f.insert(e.event_id) {
                    self.overlaps
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
        let r = Publisher::publish(&self.broker, events).await;
        let mut f = self.in_flight.lock().expect("lock");
        for e in events {
            f.remove(&e.event_id);
        }
        r
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_relays_publish_each_event_once_in_subject_order() {
    several_relays_publish_once_in_subject_order(common::fresh_pg().await).await;
}

/// The same on the distributed layout's outbox (primary key `(subject, id)`, event ids
/// unique per subject).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_relays_publish_each_event_once_in_subject_order_on_the_distributed_layout() {
    several_relays_publish_once_in_subject_order(common::fresh_distributed_pg().await).await;
}

async fn several_relays_publish_once_in_subject_order(store: PgStore) {
    let subjects = ["A", "B", "C", "D", "E"];
    let events: Vec<OutboxEvent> = (0..200)
        .map(|n| event(n, subjects[(n * 7 + n / 3) % subjects.len()]))
        .collect();
    commit_events(&store, &events).await;

    let publisher = SlowPublisher {
        broker: SimBroker::new(1),
        in_flight: Arc::default(),
        overlaps: Arc::default(),
    };
    let mut relays = Vec::new();
    for _ in 0..4 {
        let relay = Relay::new(
            PgOutboxSource::new(store.clone(), Duration::from_millis(20)),
            publisher.clone(),
            7,
        );
        relays.push(tokio::spawn(async move {
            let mut n = 0;
            // Run until this relay finds nothing three times in a row.
            let mut idle = 0;
            while idle < 3 {
                match relay.run_once().await.expect("relay") {
                    0 => {
                        idle += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    k => {
                        idle = 0;
                        n += k;
                    }
                }
            }
            n
        }));
    }
    let mut per_relay = Vec::new();
    for r in relays {
        per_relay.push(r.await.expect("relay task"));
    }
    let published = publisher.broker.published_events();
    assert_eq!(published.len(), events.len(), "each event published once");
    assert_eq!(per_relay.iter().sum::<usize>(), events.len());
    assert_eq!(
        publisher.overlaps.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "one event was being published by two relays at once"
    );
    let ids: HashSet<EventId> = published.iter().map(|e| e.event_id).collect();
    assert_eq!(ids.len(), events.len(), "an event was published twice");
    // Per subject, publication order is commit (id) order.
    let mut expected: HashMap<&str, Vec<EventId>> = HashMap::new();
    for e in &events {
        expected
            .entry(e.subject.as_str())
            .or_default()
            .push(e.event_id);
    }
    let mut got: HashMap<&str, Vec<EventId>> = HashMap::new();
    for e in &published {
        got.entry(e.subject.as_str()).or_default().push(e.event_id);
    }
    assert_eq!(
        got, expected,
        "a subject's events were published out of order"
    );
    assert!(
        per_relay.iter().filter(|&&n| n > 0).count() >= 2,
        "the relays did not share the work: {per_relay:?}"
    );
    // Everything is marked: nothing left to lease.
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(20));
    assert!(source.lease(100).await.expect("lease").events().is_empty());
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_held_by_one_relay_is_skipped_by_another() {
    let store = common::fresh_pg().await;
    // ids in order: a0 (A), b0 (B), a1 (A), b1 (B)
    let evs = vec![event(0, "A"), event(1, "B"), event(2, "A"), event(3, "B")];
    commit_events(&store, &evs).await;
    let s1 = PgOutboxSource::new(store.clone(), Duration::from_millis(20));
    let s2 = PgOutboxSource::new(store.clone(), Duration::from_millis(20));

    let first = s1.lease(1).await.expect("lease");
    assert_eq!(
        ids(first.events()),
        ids(&evs[..1]),
        "the first relay takes the oldest row"
    );
    let second = s2.lease(10).await.expect("lease");
    assert_eq!(
        ids(second.events()),
        ids(&[evs[1].clone(), evs[3].clone()]),
        "the second relay must take only B's rows: A's next row waits for A's first"
    );
    second.mark_published().await.expect("mark");
    // While A's first row is held, A's second stays unleased.
    assert!(s2.lease(10).await.expect("lease").events().is_empty());
    // Released unpublished, then both A rows come in order.
    first.release().await.expect("release");
    let again = s2.lease(10).await.expect("lease");
    assert_eq!(ids(again.events()), ids(&[evs[0].clone(), evs[2].clone()]));
    again.mark_published().await.expect("mark");
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_publishing_republishes_the_same_event_ids() {
    let store = common::fresh_pg().await;
    let evs: Vec<OutboxEvent> = (0..5).map(|n| event(n, &format!("S{}", n % 2))).collect();
    commit_events(&store, &evs).await;
    let broker = SimBroker::new(7);
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(20));

    // Publish, then "crash" before marking: the batch is dropped, its transaction rolls
    // back.
    {
        let batch = source.lease(10).await.expect("lease");
        Publisher::publish(&broker, batch.events())
            .await
            .expect("publish");
        drop(batch);
    }
    let first: Vec<EventId> = broker
        .published_events()
        .iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(first.len(), 5);

    // A new relay (a restarted process) publishes the same events again, same ids.
    let relay = Relay::new(
        PgOutboxSource::new(store.clone(), Duration::from_millis(20)),
        broker.clone(),
        10,
    );
    // The dropped batch's rollback reaches the server asynchronously (as a dead
    // process's does): the rows come back within moments.
    let mut republished_n = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while republished_n < 5 && std::time::Instant::now() < deadline {
        republished_n += relay.run_once().await.expect("relay");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(republished_n, 5, "the unmarked batch must be leased again");
    let all: Vec<EventId> = broker
        .published_events()
        .iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(all.len(), 10, "the unmarked batch must be published again");
    assert_eq!(
        &all[5..],
        &first[..],
        "the republished events must carry the same ids"
    );
    let expected: Vec<EventId> = evs.iter().map(|e| e.event_id).collect();
    assert_eq!(first, expected);
    // The headers carry the id too, so the next consumer can dedup.
    let republished = &broker.published_events()[5];
    assert!(republished.headers().iter().any(
        |(k, v)| k == idem_engine::outbox::EVENT_ID_HEADER && *v == evs[0].event_id.to_string()
    ));
    // Marked now: the next run publishes nothing.
    assert_eq!(relay.run_once().await.expect("relay"), 0);
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_the_relay_on_commit_only() {
    let store = common::fresh_pg().await;
    // A polling interval far longer than the test: only a notification can wake it fast.
    let source = Arc::new(PgOutboxSource::new(store.clone(), Duration::from_secs(30)));
    source.listen().await.expect("listen");

    // A rolled-back enqueue sends nothing.
    let mut tx = store.begin().await.expect("begin");
    tx.enqueue(&event(1, "A")).await.expect("enqueue");
    tx.rollback().await.expect("rollback");
    let waited = tokio::time::timeout(Duration::from_millis(500), source.wait()).await;
    assert!(
        waited.is_err(),
        "a rolled-back outbox insert woke the relay"
    );

    // A committed one does.
    let waiter = {
        let source = source.clone();
        tokio::spawn(async move { source.wait().await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut tx = store.begin().await.expect("begin");
    tx.enqueue(&event(2, "A")).await.expect("enqueue");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished(), "woken before the commit");
    tx.commit().await.expect("commit");
    tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the committed insert must wake the relay")
        .expect("task")
        .expect("wait");
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_many_keeps_order_and_dedups_event_ids() {
    let store = common::fresh_pg().await;
    let evs: Vec<OutboxEvent> = (0..50).map(|n| event(n, "A")).collect();
    let mut tx = store.begin().await.expect("begin");
    tx.enqueue_many(&evs).await.expect("enqueue_many");
    // Repeating ids (in one call and across calls) stores each once.
    tx.enqueue_many(&evs[..3])
        .await
        .expect("enqueue_many again");
    tx.enqueue(&evs[4]).await.expect("enqueue again");
    tx.commit().await.expect("commit");
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(20));
    let batch = source.lease(1000).await.expect("lease");
    assert_eq!(
        ids(batch.events()),
        ids(&evs),
        "events must come back once each, in order"
    );
    // The payload is Postgres's jsonb rendering of what was written.
    assert_eq!(
        String::from_utf8(batch.events()[3].payload.clone()).expect("utf-8"),
        "{\"n\": 3, \"subject\": \"A\"}"
    );
    assert!(batch
        .events()
        .iter()
        .zip(&evs)
        .all(|(a, b)| a.subject == b.subject
            && a.event_type == b.event_type
            && a.idempotency_key == b.idempotency_key));
    batch.mark_published().await.expect("mark");
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_backlog_tracks_the_relay() {
    let store = common::fresh_pg().await;
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    idem_testkit::conformance::outbox_backlog_tracks_the_relay(store, source).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_carries_the_traceparent() {
    let store = common::fresh_pg().await;
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    idem_testkit::conformance::outbox_carries_the_traceparent(store.clone(), source).await;
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_distributed_outbox_backlog_tracks_the_relay() {
    let store = common::fresh_distributed_pg().await;
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    idem_testkit::conformance::outbox_backlog_tracks_the_relay(store.clone(), source).await;
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_distributed_outbox_carries_the_traceparent() {
    let store = common::fresh_distributed_pg().await;
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    idem_testkit::conformance::outbox_carries_the_traceparent(store.clone(), source).await;
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partitioned_outbox_carries_the_traceparent() {
    let store = common::fresh_partitioned_pg().await;
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    idem_testkit::conformance::outbox_carries_the_traceparent(store.clone(), source).await;
    common::drop_schema(&store).await;
}

/// An outbox made before migration 0007 (no `traceparent` column) keeps working: a store
/// connected to it writes events without their trace, and its relay reads them untraced;
/// `migrate` adds the column in place (old rows stay, NULL), after which events keep
/// their trace, one by one and in bulk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_without_the_trace_column_is_upgraded_in_place() {
    use idem_engine::TraceParent;

    const T: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let tp: TraceParent = T.parse().expect("valid");
    let store = common::fresh_pg().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {} DROP COLUMN traceparent",
        store.table("outbox")
    )))
    .execute(store.pool())
    .await
    .expect("drop the column");
    let old = PgStore::connect(&common::url(), store.config().clone())
        .await
        .expect("connect");
    let mut tx = old.begin().await.expect("begin");
    tx.enqueue(&event(1, "A").with_traceparent(Some(tp)))
        .await
        .expect("an outbox without the column still takes events");
    tx.enqueue_many(&[event(2, "A").with_traceparent(Some(tp))])
        .await
        .expect("in bulk too");
    tx.commit().await.expect("commit");
    let batch = PgOutboxSource::new(old.clone(), Duration::from_millis(50))
        .lease(10)
        .await
        .expect("lease from the old outbox");
    assert_eq!(batch.events().len(), 2);
    assert!(batch.events().iter().all(|e| e.traceparent.is_none()));
    batch.release().await.expect("release");

    store.migrate().await.expect("migrate in place");
    let new = PgStore::connect(&common::url(), store.config().clone())
        .await
        .expect("connect");
    let mut tx = new.begin().await.expect("begin");
    tx.enqueue(&event(3, "B").with_traceparent(Some(tp)))
        .await
        .expect("enqueue");
    tx.enqueue_many(&[event(4, "B").with_traceparent(Some(tp)), event(5, "B")])
        .await
        .expect("enqueue many");
    tx.commit().await.expect("commit");
    let rows: Vec<(String, Option<String>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT subject, traceparent FROM {} ORDER BY id",
        store.table("outbox")
    )))
    .fetch_all(store.pool())
    .await
    .expect("select");
    let t = Some(T.to_owned());
    assert_eq!(
        rows,
        vec![
            ("A".to_owned(), None),
            ("A".to_owned(), None),
            ("B".to_owned(), t.clone()),
            ("B".to_owned(), t),
            ("B".to_owned(), None),
        ]
    );
    let batch = PgOutboxSource::new(new.clone(), Duration::from_millis(50))
        .lease(10)
        .await
        .expect("lease");
    let traces: Vec<Option<TraceParent>> = batch.events().iter().map(|e| e.traceparent).collect();
    assert_eq!(traces, vec![None, None, Some(tp), Some(tp), None]);
    batch.release().await.expect("release");
    common::drop_schema(&store).await;
}

/// Runs one statement of a test's own (its text built from the test's schema).
async fn exec(store: &PgStore, sql: String) {
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(store.pool())
        .await
        .expect("sql");
}

/// The number a test's own `SELECT count(*) …` returns.
async fn count_of(store: &PgStore, sql: String) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(store.pool())
        .await
        .expect("count")
}

/// The rows in the relay's queue.
async fn queued(store: &PgStore) -> i64 {
    count_of(
        store,
        format!("SELECT count(*) FROM {}", store.table("outbox_pending")),
    )
    .await
}

/// The outbox's indexes and the relay's queue: no index names `published_at` (as a key
/// or in its predicate) — one that did would make every mark a non-HOT update, a new row
/// version in every index — and the relay's queue holds exactly the events to publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_outbox_index_names_published_at_and_the_queue_holds_what_is_unpublished() {
    for store in [
        common::fresh_pg().await,
        common::fresh_distributed_pg().await,
    ] {
        let naming: Vec<String> = sqlx::query_scalar(
            "SELECT pg_get_indexdef(indexrelid) FROM pg_index \
             WHERE indrelid = $1::regclass AND pg_get_indexdef(indexrelid) LIKE '%published_at%'",
        )
        .bind(store.table("outbox"))
        .fetch_all(store.pool())
        .await
        .expect("indexes");
        assert!(naming.is_empty(), "{}: {naming:?}", store.config().layout);
        commit_events(&store, &[event(1, "A"), event(2, "B"), event(3, "A")]).await;
        assert_eq!(queued(&store).await, 3);
        let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
        let batch = source.lease(2).await.expect("lease");
        assert_eq!(
            ids(batch.events()),
            vec![event(1, "A").event_id, event(2, "B").event_id]
        );
        batch.mark_published().await.expect("mark");
        assert_eq!(queued(&store).await, 1);
        let published = format!(
            "SELECT count(*) FROM {} WHERE published_at IS NOT NULL",
            store.table("outbox")
        );
        assert_eq!(count_of(&store, published).await, 2);
        // A released batch stays queued.
        let batch = source.lease(10).await.expect("lease");
        assert_eq!(ids(batch.events()), vec![event(3, "A").event_id]);
        batch.release().await.expect("release");
        assert_eq!(queued(&store).await, 1);
        common::drop_schema(&store).await;
    }
}

/// A held batch is queued and unpublished for everyone until its mark; a refused publish
/// (`record_failure`) and a dropped batch (a relay that dies mid-publish) leave every
/// event queued, unpublished and leased again in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_batch_stays_queued_and_unpublished_for_others_until_its_mark() {
    let store = common::fresh_pg().await;
    let all = [event(1, "A"), event(2, "B"), event(3, "A")];
    commit_events(&store, &all).await;
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    let published = || {
        format!(
            "SELECT count(*) FROM {} WHERE published_at IS NOT NULL",
            store.table("outbox")
        )
    };
    let attempted = format!(
        "SELECT count(*) FROM {} WHERE publish_attempts = 1 AND failed_at IS NULL",
        store.table("outbox")
    );

    let batch = source.lease(10).await.expect("lease");
    assert_eq!(ids(batch.events()), ids(&all));
    assert_eq!(queued(&store).await, 3, "held, not yet marked");
    assert_eq!(
        count_of(&store, published()).await,
        0,
        "held, not yet marked"
    );
    assert_eq!(batch.record_failure("refused", 5).await.expect("record"), 0);
    assert_eq!(
        queued(&store).await,
        3,
        "a refused batch goes back in the queue"
    );
    assert_eq!(count_of(&store, published()).await, 0);
    assert_eq!(count_of(&store, attempted).await, 3);

    // A relay that dies with its batch: rolled back once its connection is used again.
    let batch = source.lease(10).await.expect("lease");
    assert_eq!(ids(batch.events()), ids(&all));
    drop(batch);
    let batch = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let batch = source.lease(10).await.expect("lease");
            if !batch.events().is_empty() {
                return batch;
            }
            batch.release().await.expect("release");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the dropped batch's rows are leased again");
    assert_eq!(ids(batch.events()), ids(&all));
    assert_eq!(count_of(&store, published()).await, 0);
    batch.mark_published().await.expect("mark");
    assert_eq!(queued(&store).await, 0);
    assert_eq!(count_of(&store, published()).await, 3);
    assert!(source.lease(10).await.expect("lease").events().is_empty());
    common::drop_schema(&store).await;
}

/// A writer that knows nothing of the queue — a consumer built before it, or plain SQL
/// into idem's columns — still queues its events (the outbox's trigger); a row without an
/// event id (another program's, in a reference outbox) is not queued; a duplicate event
/// id (`ON CONFLICT DO NOTHING`) queues nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_writer_queues_its_events() {
    let store = common::fresh_pg().await;
    let ob = store.table("outbox");
    let ev = event(7, "Z");
    for _ in 0..2 {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {ob} (event_id, event_type, subject, idempotency_key, payload) \
             VALUES ($1, 'effect.recorded', 'Z', $2, '{{}}') ON CONFLICT (event_id) DO NOTHING"
        )))
        .bind(ev.event_id.to_string())
        .bind(ev.idempotency_key.to_hex())
        .execute(store.pool())
        .await
        .expect("insert as an older writer would");
    }
    // Another program's row in a reference outbox: no event id.
    exec(
        &store,
        format!("INSERT INTO {ob} (event_type, payload) VALUES ('reference.row', '{{}}')"),
    )
    .await;
    assert_eq!(queued(&store).await, 1);
    let batch = PgOutboxSource::new(store.clone(), Duration::from_millis(50))
        .lease(10)
        .await
        .expect("lease");
    assert_eq!(ids(batch.events()), vec![ev.event_id]);
    batch.mark_published().await.expect("mark");
    common::drop_schema(&store).await;
}

/// A queue row whose event is not to be published — its outbox row gone, already
/// published, or moved aside — is dropped when leased, never published; the events
/// behind it are published as usual, and a lease that finds only such rows drops them
/// and comes back empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_queue_row_is_dropped_not_published() {
    let store = common::fresh_pg().await;
    let (ob, pend) = (store.table("outbox"), store.table("outbox_pending"));
    commit_events(
        &store,
        &[event(1, "A"), event(2, "B"), event(3, "C"), event(4, "D")],
    )
    .await;
    let id_of = |n: usize| {
        format!(
            "(SELECT id FROM {ob} WHERE event_id = '{}')",
            event(n, "").event_id
        )
    };
    exec(
        &store,
        format!(
            "UPDATE {ob} SET published_at = now() WHERE id = {}",
            id_of(1)
        ),
    )
    .await;
    exec(
        &store,
        format!("UPDATE {ob} SET failed_at = now() WHERE id = {}", id_of(2)),
    )
    .await;
    exec(
        &store,
        format!("INSERT INTO {pend} (id, subject) VALUES (0, 'gone')"),
    )
    .await;
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    let batch = source.lease(10).await.expect("lease");
    assert_eq!(
        ids(batch.events()),
        vec![event(3, "C").event_id, event(4, "D").event_id]
    );
    batch.mark_published().await.expect("mark");
    assert_eq!(
        queued(&store).await,
        0,
        "the stale rows were dropped with the batch"
    );
    // Only stale rows: dropped, and the lease is empty.
    exec(
        &store,
        format!(
            "INSERT INTO {pend} (id, subject) VALUES (0, 'gone'), {}",
            "(-1, 'gone')"
        ),
    )
    .await;
    let batch = source.lease(10).await.expect("lease");
    assert!(batch.events().is_empty());
    batch.release().await.expect("release");
    assert_eq!(queued(&store).await, 0);
    common::drop_schema(&store).await;
}

/// A subject's order lock belongs to one schema's outbox: an open transaction holding a
/// subject in one schema holds up no writer of that subject in another (two pipelines
/// sharing a database, whose award ids overlap), while a writer in its own schema waits
/// for it (here: until its lock timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_held_in_one_schema_holds_up_no_writer_in_another() {
    let timeout = Some(Duration::from_millis(500));
    let one = common::fresh_pg_with(|c| c.with_lock_timeout(timeout)).await;
    let other = common::fresh_pg_with(|c| c.with_lock_timeout(timeout)).await;
    let subject = "SHARED-1";
    let mut held = one.begin().await.expect("begin");
    claimed(&mut held, 1, subject).await;
    held.enqueue(&event(1, subject)).await.expect("enqueue");

    let mut elsewhere = other.begin().await.expect("begin");
    claimed(&mut elsewhere, 2, subject).await;
    elsewhere
        .enqueue(&event(2, subject))
        .await
        .expect("another schema's writer of the subject is not held up");
    elsewhere.commit().await.expect("commit");

    let mut beside = one.begin().await.expect("begin");
    claimed(&mut beside, 3, subject).await;
    let waited = beside.enqueue(&event(3, subject)).await;
    assert!(
        waited.is_err(),
        "a writer of the subject in the same schema went past the open transaction's lock"
    );
    drop(beside);
    held.commit().await.expect("commit");
}

/// Claims key `n` (subject `subject`) in `tx`, which must be new.
async fn claimed<T: ClaimTx>(tx: &mut T, n: usize, subject: &str) {
    assert_eq!(
        tx.claim(&key(n), &ClaimMeta::new(subject))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed
    );
}
