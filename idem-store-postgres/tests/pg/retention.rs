//! Retention: old dedup records and old *published* outbox rows go, in batches; young
//! and unpublished rows stay; the floor is enforced; a dry run deletes nothing.

use crate::common;

use std::time::Duration;

use idem_engine::{ClaimMeta, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent, OutboxWriter};
use idem_store_postgres::{PgError, PgStore, PurgeOptions, PurgeTable};

const DAY: u64 = 86_400;

fn key(n: usize) -> IdempotencyKey {
    IdempotencyKey::derive(&format!("R-{n}"), "2026-07-01T09:00:00Z", b"{}").expect("key")
}

/// Commits `n` claims with one outbox event each, then ages the first `old` of them by
/// `age_days` and marks the first `published` events published.
async fn seed(store: &PgStore, n: usize, old: usize, age_days: u64, published: usize) {
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
    let keys: Vec<String> = (0..old).map(|i| key(i).to_hex()).collect();
    let age = format!("{age_days} days");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET claimed_at = now() - $2::interval WHERE idempotency_key = ANY($1)",
        store.table("processed_messages")
    )))
    .bind(&keys)
    .bind(&age)
    .execute(store.pool())
    .await
    .expect("age claims");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET created_at = now() - $2::interval WHERE idempotency_key = ANY($1)",
        store.table("outbox")
    )))
    .bind(&keys)
    .bind(&age)
    .execute(store.pool())
    .await
    .expect("age events");
    let pub_keys: Vec<String> = (0..published).map(|i| key(i).to_hex()).collect();
    // As the relay marks them: published, and out of its queue.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH p AS (UPDATE {} SET published_at = now() WHERE idempotency_key = ANY($1) \
         RETURNING id) DELETE FROM {} WHERE id IN (SELECT id FROM p)",
        store.table("outbox"),
        store.table("outbox_pending")
    )))
    .bind(&pub_keys)
    .execute(store.pool())
    .await
    .expect("publish");
}

async fn count(store: &PgStore, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        store.table(table)
    )))
    .fetch_one(store.pool())
    .await
    .expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_deletes_old_records_and_published_events_in_batches() {
    let store = common::fresh_pg().await;
    // 20 claims: 12 are four years old; of their events, 8 are published.
    seed(&store, 20, 12, 4 * 365, 8).await;

    // A dry run counts and deletes nothing.
    let opts = PurgeOptions::new(Duration::from_secs(3 * 365 * DAY + DAY)).with_batch_size(5);
    let dry = store
        .purge(&opts.clone().dry_run(true), |_| {})
        .await
        .expect("dry run");
    assert_eq!((dry.dedup_records, dry.outbox_events), (12, 8));
    assert!(dry.dry_run);
    assert_eq!(count(&store, "processed_messages").await, 20);
    assert_eq!(count(&store, "outbox").await, 20);

    let mut progress = Vec::new();
    let report = store
        .purge(&opts, |p| {
            progress.push((p.table, p.rows_so_far, p.batch_rows))
        })
        .await
        .expect("purge");
    assert_eq!((report.dedup_records, report.outbox_events), (12, 8));
    assert_eq!(count(&store, "processed_messages").await, 8);
    // The 4 old unpublished events stay, as do the 8 young ones.
    assert_eq!(count(&store, "outbox").await, 12);
    let unpublished: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE published_at IS NULL",
        store.table("outbox")
    )))
    .fetch_one(store.pool())
    .await
    .expect("count");
    assert_eq!(unpublished, 12, "an unpublished event was purged");
    // Bounded batches of 5: 5, 5, 2 records, then 5, 3 events.
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
    // The young keys are still claimed: a redelivery of one is a duplicate.
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&key(15), &ClaimMeta::new("R-15"))
            .await
            .expect("claim"),
        idem_engine::ClaimOutcome::Duplicate
    );
    // A purged key can be claimed again (the accepted cost of retention).
    assert_eq!(
        tx.claim(&key(0), &ClaimMeta::new("R-0"))
            .await
            .expect("claim"),
        idem_engine::ClaimOutcome::Claimed
    );
    tx.rollback().await.expect("rollback");
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_below_the_floor_is_refused_unless_allowed() {
    let store = common::fresh_pg().await;
    seed(&store, 4, 2, 30, 2).await;
    let opts = PurgeOptions::new(Duration::from_secs(7 * DAY));
    let err = store
        .purge(&opts, |_| {})
        .await
        .expect_err("below the floor");
    assert!(
        matches!(err, PgError::BelowRetentionFloor { .. }),
        "got {err:?}"
    );
    assert!(!err.is_retryable());
    assert_eq!(
        count(&store, "processed_messages").await,
        4,
        "a refused purge deleted rows"
    );

    let report = store
        .purge(&opts.clone().allow_below_floor(true), |_| {})
        .await
        .expect("allowed purge");
    assert_eq!((report.dedup_records, report.outbox_events), (2, 2));
    assert_eq!(count(&store, "processed_messages").await, 2);

    // A lower floor, configured, needs no override.
    let report = store
        .purge(
            &PurgeOptions::new(Duration::from_secs(7 * DAY)).with_floor(Duration::from_secs(DAY)),
            |_| {},
        )
        .await
        .expect("purge above a configured floor");
    assert_eq!(report.dedup_records, 0);
    common::drop_schema(&store).await;
}

/// An event still in the relay's queue is never purged, whatever its `published_at` says
/// (set by hand, or by another program that does not know of the queue): only
/// the relay's own mark, which takes the event out of the queue, makes it purgeable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_still_in_the_relay_queue_is_not_purged() {
    let store = common::fresh_pg().await;
    // 20 claims: 12 four years old; 8 of their events published by the relay.
    seed(&store, 20, 12, 4 * 365, 8).await;
    // Two more old events marked published behind the relay's back: still queued.
    let behind: Vec<String> = (8..10).map(|i| key(i).to_hex()).collect();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET published_at = now() WHERE idempotency_key = ANY($1)",
        store.table("outbox")
    )))
    .bind(&behind)
    .execute(store.pool())
    .await
    .expect("publish behind the relay's back");
    let opts = PurgeOptions::new(Duration::from_secs(3 * 365 * DAY + DAY)).with_batch_size(5);
    let dry = store
        .purge(&opts.clone().dry_run(true), |_| {})
        .await
        .expect("dry run");
    assert_eq!(dry.outbox_events, 8, "a queued event counted as purgeable");
    let report = store.purge(&opts, |_| {}).await.expect("purge");
    assert_eq!(report.outbox_events, 8, "a queued event was purged");
    let queued: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {} p JOIN {} o USING (id)",
        store.table("outbox_pending"),
        store.table("outbox")
    )))
    .fetch_one(store.pool())
    .await
    .expect("count");
    assert_eq!(queued, 12, "every queued event keeps its outbox row");
    common::drop_schema(&store).await;
}

/// The retention floor's cutoff as the audit report computes it
/// ([`RetentionFloor::cutoff`](idem_engine::retention::RetentionFloor::cutoff)) is the
/// server's `t - make_interval(years => N)`, the one a purge checks, to the microsecond:
/// leap days counted, a 29 February going back to the 28th.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_floors_cutoff_is_the_servers_calendar_years() {
    use idem_engine::record::Timestamp;
    use idem_engine::retention::RetentionFloor;
    let store = common::fresh_pg().await;
    for (at, years) in [
        ("2028-03-01T12:00:00.123456Z", 3),
        ("2028-02-29T00:00:00Z", 3),
        ("2028-02-29T23:59:59Z", 4),
        ("2027-12-31T23:59:59.999999Z", 1),
        ("2026-12-06T13:00:00Z", 3),
    ] {
        let t = Timestamp::parse_rfc3339(at).expect("timestamp");
        let server: i64 = sqlx::query_scalar(
            "SELECT (extract(epoch FROM ($1::timestamptz AT TIME ZONE 'UTC' - make_interval(years => $2)) AT TIME ZONE 'UTC') * 1000000)::int8",
        )
        .bind(at)
        .bind(years)
        .fetch_one(store.pool())
        .await
        .expect("the server's cutoff");
        let ours = RetentionFloor::Years(u32::try_from(years).expect("years")).cutoff(t);
        assert_eq!(ours.unix_micros(), server, "{at} minus {years} years");
    }
}
