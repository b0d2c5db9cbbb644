//! Inspection answers "was this key / award processed, when, which outbox events".

use crate::common;

use std::time::{Duration, SystemTime};

use idem_engine::{
    ClaimMeta, ClaimStore, ClaimTx, EventId, IdempotencyKey, OutboxBatch, OutboxEvent,
    OutboxSource, OutboxWriter,
};
use idem_store_postgres::PgOutboxSource;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_shows_claims_and_their_events() {
    let store = common::fresh_pg().await;
    assert_eq!(
        audit_index_count(&store).await,
        2,
        "the default migration creates the audit indexes, and no index of its own on award_id"
    );
    // The lookup by award id goes through the identity index (which leads with award_id).
    let plan = plan_without_seqscan(
        &store,
        format!(
            "SELECT idempotency_key FROM {} WHERE award_id = 'A-7'",
            store.table("processed_messages")
        ),
    )
    .await;
    assert!(
        plan.iter()
            .any(|l| l.contains("processed_messages_identity_key")),
        "{plan:#?}"
    );
    assert_eq!(
        events_plan(&store).await,
        "outbox_idempotency_key_hash",
        "a key's events are found through the hash index"
    );
    inspect_on(store).await;
}

/// The index through which `inspect` and `audit export` find the outbox events of a few
/// keys (their statement's `idempotency_key = ANY($1)`), with sequential scans off.
async fn events_plan(store: &idem_store_postgres::PgStore) -> String {
    let plan = plan_without_seqscan(
        store,
        format!(
            "SELECT id FROM {} WHERE idempotency_key = ANY(ARRAY['a', 'b']) ORDER BY id",
            store.table("outbox")
        ),
    )
    .await;
    ["outbox_idempotency_key_hash", "outbox_idempotency_key_idx"]
        .into_iter()
        .find(|i| plan.iter().any(|l| l.contains(&format!(" on {i}"))))
        .unwrap_or_else(|| panic!("no index of the keys in {plan:#?}"))
        .to_owned()
}

/// The lines of `EXPLAIN query` with sequential scans off.
async fn plan_without_seqscan(store: &idem_store_postgres::PgStore, query: String) -> Vec<String> {
    let mut tx = store.pool().begin().await.expect("begin");
    sqlx::query("SET LOCAL enable_seqscan = off")
        .execute(&mut *tx)
        .await
        .expect("set");
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {query}")))
        .fetch_all(&mut *tx)
        .await
        .expect("explain")
}

async fn audit_index_count(store: &idem_store_postgres::PgStore) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND indexname IN \
         ('processed_messages_claimed_at_idx', 'processed_messages_award_id_idx', \
          'outbox_idempotency_key_idx', 'outbox_idempotency_key_hash')",
    )
    .bind(store.schema())
    .fetch_one(store.pool())
    .await
    .expect("count indexes")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_works_without_the_audit_indexes() {
    let store = common::fresh_pg_with(|c| c.with_audit_indexes(false)).await;
    assert_eq!(
        audit_index_count(&store).await,
        0,
        "audit indexes created although turned off"
    );
    inspect_on(store).await;
}

async fn inspect_on(store: idem_store_postgres::PgStore) {
    let before = SystemTime::now() - Duration::from_secs(60);
    let k1 = IdempotencyKey::derive("A-7", "2026-07-01T09:00:00Z", b"{\"n\":1}").expect("key");
    let k2 = IdempotencyKey::derive("A-7", "2026-07-02T09:00:00Z", b"{\"n\":2}").expect("key");
    let other = IdempotencyKey::derive("A-8", "2026-07-01T09:00:00Z", b"{}").expect("key");
    for (k, subject) in [(k1, "A-7"), (k2, "A-7"), (other, "A-8")] {
        let mut tx = store.begin().await.expect("begin");
        tx.claim(&k, &ClaimMeta::new(subject)).await.expect("claim");
        tx.enqueue(&OutboxEvent::new(k, "disbursement.recorded", subject, "{}"))
            .await
            .expect("enqueue");
        tx.enqueue(&OutboxEvent::new(k, "award.updated", subject, "{}"))
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");
    }
    // Publish the first batch of two (k1's events).
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(50));
    let batch = source.lease(2).await.expect("lease");
    assert_eq!(batch.events().len(), 2);
    batch.mark_published().await.expect("mark");

    let rec = store
        .inspect_key(&k1)
        .await
        .expect("inspect")
        .expect("k1 was claimed");
    assert_eq!(rec.key, k1.to_hex());
    assert_eq!(rec.award_id.as_deref(), Some("A-7"));
    let claimed = rec.claimed_at.expect("claimed_at").to_system_time();
    assert!(claimed > before && claimed < SystemTime::now() + Duration::from_secs(60));
    let ids: Vec<Option<String>> = rec.events.iter().map(|e| e.event_id.clone()).collect();
    assert_eq!(
        ids,
        vec![
            Some(EventId::derive(&k1, "disbursement.recorded").to_string()),
            Some(EventId::derive(&k1, "award.updated").to_string())
        ]
    );
    assert_eq!(rec.events[0].event_type, "disbursement.recorded");
    assert!(
        rec.events.iter().all(|e| e.published_at.is_some()),
        "k1's events were published"
    );
    assert!(rec.events.iter().all(|e| e.created_at.is_some()));

    let rec2 = store.inspect_key(&k2).await.expect("inspect").expect("k2");
    assert!(
        rec2.events.iter().all(|e| e.published_at.is_none()),
        "k2's events are not published"
    );

    let by_subject = store.inspect_subject("A-7").await.expect("inspect subject");
    let keys: Vec<&str> = by_subject.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys.len(), 2);
    assert!(keys.contains(&k1.to_hex().as_str()) && keys.contains(&k2.to_hex().as_str()));
    assert!(by_subject.iter().all(|r| r.events.len() == 2));

    let never = IdempotencyKey::derive("A-9", "2026-07-01T09:00:00Z", b"{}").expect("key");
    assert!(store.inspect_key(&never).await.expect("inspect").is_none());
    assert!(store
        .inspect_subject("A-9")
        .await
        .expect("inspect")
        .is_empty());
    common::drop_schema(&store).await;
}
