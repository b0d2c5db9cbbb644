//! Retention on SQLite, as on Postgres: old dedup records and old *published* outbox rows
//! go, in batches; young and unpublished rows stay; the floor is enforced (calendar
//! years counted by SQLite); a dry run deletes nothing.

use crate::common;

use std::time::Duration;

use idem_engine::OutboxWriter;
use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent};
use idem_store_sqlite::{PurgeOptions, PurgeTable, RetentionFloor, SqliteError, SqliteStore};

const DAY: u64 = 86_400;

fn key(n: usize) -> IdempotencyKey {
    IdempotencyKey::derive(&format!("R-{n}"), "2026-07-01T09:00:00Z", b"{}").expect("key")
}

/// Commits `n` claims with one outbox event each, ages the first `old` by `age_days` and
/// marks the first `published` events published.
async fn seed(store: &SqliteStore, n: usize, old: usize, age_days: u64, published: usize) {
    for i in 0..n {
        let mut tx = store.begin().await.expect("begin");
        tx.claim(&key(i), &ClaimMeta::new(format!("R-{i}")))
            .await
            .expect("claim");
        tx.enqueue(&OutboxEvent::new(
            key(i),
            "effect.recorded",
            format!("R-{i}"),
            "{}",
        ))
        .await
        .expect("enqueue");
        tx.commit().await.expect("commit");
    }
    let aged = format!("-{age_days} days");
    for i in 0..old {
        for sql in [
            "UPDATE processed_messages SET claimed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?2) WHERE idempotency_key = ?1",
            "UPDATE outbox SET created_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?2) WHERE idempotency_key = ?1",
        ] {
            sqlx::query(sql)
                .bind(key(i).to_hex())
                .bind(&aged)
                .execute(store.pool())
                .await
                .expect("age");
        }
    }
    for i in 0..published {
        sqlx::query("UPDATE outbox SET published_at = created_at WHERE idempotency_key = ?1")
            .bind(key(i).to_hex())
            .execute(store.pool())
            .await
            .expect("publish");
    }
}

async fn count(store: &SqliteStore, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(store.pool())
        .await
        .expect("count")
}

#[tokio::test]
async fn purge_deletes_old_records_and_published_events_in_batches() {
    let t = common::fresh().await;
    let store = &t.store;
    // 20 claims: 12 are four years old; of their events, 8 are published.
    seed(store, 20, 12, 4 * 365, 8).await;

    let opts = PurgeOptions::new(Duration::from_secs(3 * 365 * DAY + DAY)).with_batch_size(5);
    let dry = store
        .purge(&opts.clone().dry_run(true), |_| {})
        .await
        .expect("dry run");
    assert_eq!(
        (dry.dedup_records, dry.outbox_events, dry.dry_run),
        (12, 8, true)
    );
    assert_eq!(
        count(store, "SELECT count(*) FROM processed_messages").await,
        20
    );
    assert_eq!(count(store, "SELECT count(*) FROM outbox").await, 20);

    let mut progress = Vec::new();
    let report = store
        .purge(&opts, |p| {
            progress.push((p.table, p.rows_so_far, p.batch_rows))
        })
        .await
        .expect("purge");
    assert_eq!((report.dedup_records, report.outbox_events), (12, 8));
    assert!(report.partitions_dropped.is_empty());
    assert_eq!(
        count(store, "SELECT count(*) FROM processed_messages").await,
        8
    );
    // The 4 old unpublished events stay, as do the 8 young ones.
    assert_eq!(
        count(
            store,
            "SELECT count(*) FROM outbox WHERE published_at IS NULL"
        )
        .await,
        12,
        "an unpublished event was purged"
    );
    assert_eq!(count(store, "SELECT count(*) FROM outbox").await, 12);
    assert_eq!(
        progress,
        vec![
            (PurgeTable::DedupRecords, 5, 5),
            (PurgeTable::DedupRecords, 10, 5),
            (PurgeTable::DedupRecords, 12, 2),
            (PurgeTable::OutboxEvents, 5, 5),
            (PurgeTable::OutboxEvents, 8, 3),
        ]
    );
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&key(15), &ClaimMeta::new("R-15"))
            .await
            .expect("claim"),
        ClaimOutcome::Duplicate,
        "a young record was purged"
    );
    assert_eq!(
        tx.claim(&key(0), &ClaimMeta::new("R-0"))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed,
        "an old record survived"
    );
    tx.rollback().await.expect("rollback");
}

#[tokio::test]
async fn purge_below_the_floor_is_refused_unless_allowed() {
    let t = common::fresh().await;
    let store = &t.store;
    seed(store, 4, 2, 30, 2).await;
    let opts = PurgeOptions::new(Duration::from_secs(7 * DAY));
    let err = store
        .purge(&opts, |_| {})
        .await
        .expect_err("below the floor");
    assert!(
        matches!(err, SqliteError::BelowRetentionFloor { .. }),
        "got {err:?}"
    );
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("interval '3 years'"), "{err}");
    assert_eq!(
        count(store, "SELECT count(*) FROM processed_messages").await,
        4
    );

    let report = store
        .purge(&opts.clone().allow_below_floor(true), |_| {})
        .await
        .expect("allowed purge");
    assert_eq!((report.dedup_records, report.outbox_events), (2, 2));

    // A lower floor, configured, needs no override.
    let lower =
        PurgeOptions::new(Duration::from_secs(7 * DAY)).with_floor(Duration::from_secs(DAY));
    assert_eq!(
        store
            .purge(&lower, |_| {})
            .await
            .expect("purge")
            .dedup_records,
        0
    );
}

/// The calendar floor is counted by SQLite's calendar: three years back is 1095 or 1096
/// days, by leap days. A cutoff one day inside it is refused, one day outside passes.
#[tokio::test]
async fn the_calendar_floor_counts_leap_days() {
    let t = common::fresh().await;
    let days: i64 = count(
        &t.store,
        "SELECT CAST(round(julianday('now') - julianday('now', '-3 years')) AS INTEGER)",
    )
    .await;
    assert!(days == 1095 || days == 1096, "{days}");
    let days = u64::try_from(days).expect("positive");
    let floor = RetentionFloor::Years(3);
    let inside = PurgeOptions::new(Duration::from_secs((days - 1) * DAY)).with_floor(floor);
    assert!(matches!(
        t.store.purge(&inside, |_| {}).await,
        Err(SqliteError::BelowRetentionFloor { .. })
    ));
    let outside = PurgeOptions::new(Duration::from_secs((days + 1) * DAY)).with_floor(floor);
    t.store
        .purge(&outside, |_| {})
        .await
        .expect("beyond the floor");
}
