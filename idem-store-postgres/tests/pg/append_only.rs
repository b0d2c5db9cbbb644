//! The optional append-only migration: UPDATE / DELETE / TRUNCATE of dedup records are
//! refused with a clear error; claims and retention still work.

use crate::common;

use std::time::Duration;

use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
use idem_store_postgres::{error::sqlstate, PgStore, PurgeOptions, APPEND_ONLY_SQLSTATE};

async fn claim(store: &PgStore, award: &str) -> IdempotencyKey {
    let key = IdempotencyKey::derive(award, "2026-07-01T09:00:00Z", b"{}").expect("key");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&key, &ClaimMeta::new(award)).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");
    key
}

async fn count(store: &PgStore) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        store.table("processed_messages")
    )))
    .fetch_one(store.pool())
    .await
    .expect("count")
}

async fn refused(store: &PgStore, sql: &str) {
    let err = sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(store.pool())
        .await
        .expect_err(&format!("{sql} must be refused"));
    assert_eq!(
        sqlstate(&err).as_deref(),
        Some(APPEND_ONLY_SQLSTATE),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("append-only"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_and_deletes_are_refused_but_purge_works() {
    let store = common::fresh_pg().await;
    store.migrate_append_only().await.expect("append-only");
    store.migrate_append_only().await.expect("idempotent");
    store
        .migrate()
        .await
        .expect("the base migration still runs after it");

    let k1 = claim(&store, "A-1").await;
    let _k2 = claim(&store, "A-2").await;
    // A duplicate claim is an INSERT … ON CONFLICT DO NOTHING: still a Duplicate.
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k1, &ClaimMeta::new("A-1")).await.expect("claim"),
        ClaimOutcome::Duplicate
    );
    tx.rollback().await.expect("rollback");

    let pm = store.table("processed_messages");
    refused(&store, &format!("UPDATE {pm} SET award_id = 'X'")).await;
    refused(
        &store,
        &format!("UPDATE {pm} SET claimed_at = now() - interval '10 years'"),
    )
    .await;
    refused(&store, &format!("DELETE FROM {pm}")).await;
    refused(&store, &format!("DELETE FROM {pm} WHERE award_id = 'A-1'")).await;
    refused(&store, &format!("TRUNCATE {pm}")).await;
    // The purge marker outside a transaction does not stick.
    sqlx::query("SELECT set_config('idem.purge', 'on', true)")
        .execute(store.pool())
        .await
        .expect("set_config");
    refused(&store, &format!("DELETE FROM {pm}")).await;
    assert_eq!(count(&store).await, 2, "nothing was changed");

    // Retention (the purge path) still deletes, in batches.
    let opts = PurgeOptions::new(Duration::ZERO)
        .allow_below_floor(true)
        .with_batch_size(1);
    // Claimed "now": a cutoff of now() - 0 may equal the claim time; wait a little.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let report = store.purge(&opts, |_| {}).await.expect("purge");
    assert_eq!(report.dedup_records, 2);
    assert_eq!(count(&store).await, 0);
    common::drop_schema(&store).await;
}
