//! The outbox read by change data capture (`OutboxMode::ChangeDataCapture`), with no relay:
//! what a connector reading the write-ahead log sees is read here through a logical
//! replication slot of `test_decoding` (the server needs `wal_level = logical`, as the
//! throwaway cluster of `scripts/test` has it).

use crate::common;

use std::time::Duration;

use idem_engine::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent, OutboxSource,
    OutboxWriter, StoreError,
};
use idem_store_postgres::{OutboxMode, PgColumn, PgConfig, PgOutboxSource, PgRows, PgStore};
use sqlx::{Connection, PgConnection, Row};

fn key(n: usize) -> IdempotencyKey {
    IdempotencyKey::derive(
        &format!("C-{n}"),
        "2026-07-01T09:00:00Z",
        n.to_string().as_bytes(),
    )
    .expect("key")
}

fn event(n: usize, subject: &str) -> OutboxEvent {
    OutboxEvent::new(key(n), "effect.recorded", subject, format!("{{\"n\":{n}}}"))
}

/// A temporary logical replication slot (gone with its connection), made before the
/// writes it is to see.
struct Slot {
    conn: PgConnection,
    name: String,
}

impl Slot {
    async fn open() -> Self {
        let mut conn = PgConnection::connect(&common::url())
            .await
            .expect("a connection for the slot");
        let name = format!("idem_cdc_{:08x}", rand::random::<u32>());
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'test_decoding', true)")
            .bind(&name)
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "a logical replication slot (the server needs wal_level = logical, as \
                     scripts/test's throwaway cluster has it): {e}"
                )
            });
        Self { conn, name }
    }

    /// The outbox inserts of `store`'s schema the log holds, in the log's (commit) order:
    /// `(event_id, published)` each.
    async fn outbox_inserts(&mut self, store: &PgStore) -> Vec<(String, bool)> {
        let rows = sqlx::query(
            "SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL) WITH ORDINALITY AS c(lsn, xid, data, n) \
             WHERE data LIKE $2 ORDER BY n",
        )
        .bind(&self.name)
        .bind(format!("table {}.outbox: INSERT:%", store.schema()))
        .fetch_all(&mut self.conn)
        .await
        .expect("read the slot");
        rows.iter()
            .map(|row| {
                let data: String = row.get(0);
                let id = data
                    .split("event_id[text]:'")
                    .nth(1)
                    .and_then(|rest| rest.split('\'').next())
                    .unwrap_or_else(|| panic!("an event id in {data}"))
                    .to_owned();
                let published = !data.contains("published_at[timestamp with time zone]:null");
                (id, published)
            })
            .collect()
    }
}

async fn count(store: &PgStore, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(
        sql.replace("{s}", &format!("\"{}\"", store.schema())),
    ))
    .fetch_one(store.pool())
    .await
    .expect("count")
}

async fn fresh_cdc() -> PgStore {
    let store = common::fresh_pg_with(|c| c.with_outbox(OutboxMode::ChangeDataCapture)).await;
    assert_eq!(store.outbox_mode(), OutboxMode::ChangeDataCapture);
    store
}

#[tokio::test]
async fn the_log_holds_each_committed_event_once_in_commit_order_and_nothing_is_queued() {
    let mut slot = Slot::open().await;
    let store = fresh_cdc().await;
    let mut committed = Vec::new();
    // One event per transaction (the one-event statement), then two per transaction
    // (the many-event one), then rows and events in one statement; two subjects.
    for n in 0..4 {
        let ev = event(n, if n % 2 == 0 { "S-A" } else { "S-B" });
        let mut tx = store.begin().await.expect("begin");
        assert_eq!(
            tx.claim(&ev.idempotency_key, &ClaimMeta::new(ev.subject.clone()))
                .await
                .expect("claim"),
            ClaimOutcome::Claimed
        );
        tx.enqueue(&ev).await.expect("enqueue");
        tx.commit().await.expect("commit");
        committed.push(ev.event_id.to_string());
    }
    {
        let evs = [event(4, "S-A"), event(5, "S-B")];
        let mut tx = store.begin().await.expect("begin");
        tx.claim(&key(4), &ClaimMeta::new("S-A"))
            .await
            .expect("claim");
        tx.enqueue_many(&evs).await.expect("enqueue_many");
        tx.commit().await.expect("commit");
        committed.extend(evs.iter().map(|e| e.event_id.to_string()));
    }
    {
        let ev = event(6, "S-A");
        let mut tx = store.begin().await.expect("begin");
        tx.claim(&key(6), &ClaimMeta::new("S-A"))
            .await
            .expect("claim");
        let table = idem_engine::sql!("{schema}.effects", schema = store.schema_ident());
        let rows = PgRows::new(table)
            .column("key", PgColumn::OwnedText(vec![key(6).to_hex()]))
            .expect("column")
            .column("subject", PgColumn::Text(vec!["S-A"]))
            .expect("column")
            .column("amount", PgColumn::Int8(vec![6]))
            .expect("column");
        tx.insert_and_enqueue(&rows, std::slice::from_ref(&ev))
            .await
            .expect("insert_and_enqueue");
        tx.commit().await.expect("commit");
        committed.push(ev.event_id.to_string());
    }
    // A redelivery rolls back; a transaction that wrote its event and then rolled back
    // leaves nothing in the log.
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&key(0), &ClaimMeta::new("S-A"))
            .await
            .expect("claim"),
        ClaimOutcome::Duplicate
    );
    tx.rollback().await.expect("rollback");
    let mut tx = store.begin().await.expect("begin");
    tx.claim(&key(100), &ClaimMeta::new("S-A"))
        .await
        .expect("claim");
    tx.enqueue(&event(100, "S-A")).await.expect("enqueue");
    tx.rollback().await.expect("rollback");

    let seen = slot.outbox_inserts(&store).await;
    let ids: Vec<String> = seen.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(ids, committed, "the log's outbox inserts, in commit order");
    assert!(
        seen.iter().all(|(_, published)| *published),
        "every event is written published: {seen:?}"
    );
    assert_eq!(
        count(&store, "SELECT count(*) FROM {s}.outbox_pending").await,
        0
    );
    assert_eq!(
        count(
            &store,
            "SELECT count(*) FROM {s}.outbox WHERE published_at IS NULL"
        )
        .await,
        0
    );
    // No relay runs on it: it says why instead of publishing nothing.
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    match source.lease(10).await {
        Err(StoreError::Config(message)) => {
            assert!(message.contains("change data capture"), "{message}");
        }
        other => panic!("the relay on a CDC outbox: {other:?}"),
    }
    common::drop_schema(&store).await;
}

/// Two open transactions writing events of one subject: the second waits for the first
/// under the relay (its lock per subject), and not under change data capture.
async fn second_writer_of_a_subject_waits(store: &PgStore) -> bool {
    let mut first = store.begin().await.expect("begin");
    first
        .claim(&key(1), &ClaimMeta::new("S"))
        .await
        .expect("claim");
    first.enqueue(&event(1, "S")).await.expect("enqueue");
    let mut second = store.begin().await.expect("begin");
    second
        .claim(&key(2), &ClaimMeta::new("S"))
        .await
        .expect("claim");
    let waited = tokio::time::timeout(Duration::from_secs(2), second.enqueue(&event(2, "S")))
        .await
        .is_err();
    first.commit().await.expect("commit");
    waited
}

#[tokio::test]
async fn writers_of_one_subject_wait_for_each_other_only_for_the_relay() {
    let relay = common::fresh_pg().await;
    assert!(second_writer_of_a_subject_waits(&relay).await);
    common::drop_schema(&relay).await;
    let cdc = fresh_cdc().await;
    assert!(!second_writer_of_a_subject_waits(&cdc).await);
    common::drop_schema(&cdc).await;
}

#[tokio::test]
async fn a_relay_schema_turns_to_cdc_only_with_an_empty_queue_and_for_good() {
    let relay = common::fresh_pg().await;
    let mut tx = relay.begin().await.expect("begin");
    tx.claim(&key(1), &ClaimMeta::new("S"))
        .await
        .expect("claim");
    tx.enqueue(&event(1, "S")).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let config = || {
        PgConfig::new(relay.schema())
            .expect("schema")
            .with_max_connections(2)
    };
    // Asked for CDC, the store follows the schema until its migration records it.
    let asking = PgStore::connect(
        &common::url(),
        config().with_outbox(OutboxMode::ChangeDataCapture),
    )
    .await
    .expect("connect");
    assert_eq!(asking.outbox_mode(), OutboxMode::Relay);
    let refused = asking
        .migrate()
        .await
        .expect_err("an event is still queued");
    assert!(
        refused.to_string().contains("still queued for the relay"),
        "{refused}"
    );
    assert_eq!(asking.outbox_mode(), OutboxMode::Relay);
    assert_eq!(
        count(&relay, "SELECT count(*) FROM {s}.outbox_pending").await,
        1
    );
    // The relay publishes it (its mark: the queue row deleted, published_at set).
    count(
        &relay,
        "WITH d AS (DELETE FROM {s}.outbox_pending RETURNING id), \
         u AS (UPDATE {s}.outbox o SET published_at = now() FROM d WHERE o.id = d.id RETURNING 1) \
         SELECT count(*) FROM u",
    )
    .await;
    asking.migrate().await.expect("migrate to CDC");
    assert_eq!(asking.outbox_mode(), OutboxMode::ChangeDataCapture);
    // A store connected with the default config follows what the schema records, and its
    // own migration keeps it.
    let later = PgStore::connect(&common::url(), config())
        .await
        .expect("connect");
    assert_eq!(later.outbox_mode(), OutboxMode::ChangeDataCapture);
    later.migrate().await.expect("migrate");
    let mut tx = later.begin().await.expect("begin");
    tx.claim(&key(2), &ClaimMeta::new("S"))
        .await
        .expect("claim");
    tx.enqueue(&event(2, "S")).await.expect("enqueue");
    tx.commit().await.expect("commit");
    assert_eq!(
        count(&relay, "SELECT count(*) FROM {s}.outbox_pending").await,
        0
    );
    assert_eq!(
        count(
            &relay,
            "SELECT count(*) FROM {s}.outbox WHERE published_at IS NULL"
        )
        .await,
        0
    );
    let again = PgStore::connect(&common::url(), config())
        .await
        .expect("connect");
    assert_eq!(again.outbox_mode(), OutboxMode::ChangeDataCapture);
    common::drop_schema(&relay).await;
}
