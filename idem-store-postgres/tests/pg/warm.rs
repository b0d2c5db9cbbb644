//! A claim transaction that ended cleanly keeps its connection for the next `begin`
//! (src/warm.rs): what must hold around that — the next transaction is a new one, a
//! crashed transaction's claim is released and its connection never reused open, other
//! users of the pool are never starved, and closing the pool never waits on a parked
//! connection.

use crate::common;

use std::time::Duration;

use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
use idem_store_postgres::PgTx;

fn key(n: usize) -> IdempotencyKey {
    IdempotencyKey::derive(&format!("W-{n}"), "2026-07-01T09:00:00Z", b"{}").expect("key")
}

async fn claim(tx: &mut PgTx, n: usize) -> ClaimOutcome {
    tx.claim(&key(n), &ClaimMeta::new(format!("W-{n}")))
        .await
        .expect("claim")
}

async fn backend(tx: &mut PgTx) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(tx.conn())
        .await
        .expect("pid")
}

/// The transaction's own id: a new transaction has a new one.
async fn xid(tx: &mut PgTx) -> i64 {
    sqlx::query_scalar("SELECT pg_current_xact_id()::text::bigint")
        .fetch_one(tx.conn())
        .await
        .expect("xid")
}

async fn claims(store: &idem_store_postgres::PgStore, k: &IdempotencyKey) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE idempotency_key = $1",
        store.table("processed_messages")
    )))
    .bind(k.to_hex())
    .fetch_one(store.pool())
    .await
    .expect("count")
}

#[tokio::test]
async fn a_committed_transaction_leaves_its_connection_warm_for_a_new_transaction() {
    let store = common::fresh_pg().await;
    let mut tx = store.begin().await.expect("begin");
    let pid = backend(&mut tx).await;
    let first = xid(&mut tx).await;
    assert_eq!(claim(&mut tx, 1).await, ClaimOutcome::Claimed);
    tx.commit().await.expect("commit");

    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        backend(&mut tx).await,
        pid,
        "the next begin takes the warm connection"
    );
    let second = xid(&mut tx).await;
    assert_ne!(first, second, "a new transaction, not the committed one");
    // The lock timeout of `begin` is set in the new transaction too.
    let timeout: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(tx.conn())
        .await
        .expect("show");
    assert_eq!(
        timeout, "5s",
        "begin's SET LOCAL lock_timeout (the default, 5 s)"
    );
    assert_eq!(claim(&mut tx, 1).await, ClaimOutcome::Duplicate);
    tx.rollback().await.expect("rollback");
    assert_eq!(claims(&store, &key(1)).await, 1);
    common::drop_schema(&store).await;
}

#[tokio::test]
async fn a_dropped_transaction_is_rolled_back_and_its_connection_not_reused_open() {
    let store = common::fresh_pg().await;
    // Warm one connection first, so that the crashed transaction runs on it.
    let tx = store.begin().await.expect("begin");
    tx.rollback().await.expect("rollback");

    let mut tx = store.begin().await.expect("begin");
    let crashed = backend(&mut tx).await;
    assert_eq!(claim(&mut tx, 2).await, ClaimOutcome::Claimed);
    drop(tx); // a crash before the commit

    // The claim is released: a redelivery claims it again, on whatever connection.
    for _ in 0..3 {
        let mut tx = store.begin().await.expect("begin");
        let outcome = claim(&mut tx, 2).await;
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state LIKE 'idle in transaction%'",
        )
        .bind(crashed)
        .fetch_one(tx.conn())
        .await
        .expect("activity");
        assert_eq!(
            open, 0,
            "the crashed transaction is still open on its connection"
        );
        assert_eq!(outcome, ClaimOutcome::Claimed);
        tx.rollback().await.expect("rollback");
    }
    assert_eq!(claims(&store, &key(2)).await, 0);
    common::drop_schema(&store).await;
}

#[tokio::test]
async fn parked_connections_never_starve_the_pool() {
    let store = common::fresh_pg_with(|c| {
        c.with_max_connections(2)
            .with_acquire_timeout(Duration::from_secs(2))
    })
    .await;
    // Two transactions at once, both committed: at most one connection may stay parked.
    let mut a = store.begin().await.expect("begin a");
    let mut b = store.begin().await.expect("begin b");
    a.claim(&key(3), &ClaimMeta::new("W-3"))
        .await
        .expect("claim a");
    b.claim(&key(4), &ClaimMeta::new("W-4"))
        .await
        .expect("claim b");
    a.commit().await.expect("commit a");
    b.commit().await.expect("commit b");
    // Another user of the pool still gets a connection, twice over with one held.
    let first = store
        .pool()
        .acquire()
        .await
        .expect("a connection for another user");
    let tx = store
        .begin()
        .await
        .expect("and a claim transaction beside it");
    tx.rollback().await.expect("rollback");
    drop(first);
    common::drop_schema(&store).await;
}

#[tokio::test]
async fn closing_the_pool_does_not_wait_on_a_parked_connection() {
    let store = common::fresh_pg().await;
    common::drop_schema(&store).await;
    let tx = store.begin().await.expect("begin");
    tx.rollback().await.expect("rollback");
    tokio::time::timeout(Duration::from_secs(10), store.pool().close())
        .await
        .expect("the pool closes with a connection parked");
    assert_eq!(store.pool().size(), 0);
}

#[tokio::test]
async fn a_commit_that_only_releases_a_forgotten_savepoint_is_an_error_not_a_commit() {
    let store = common::fresh_pg().await;
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(claim(&mut tx, 5).await, ClaimOutcome::Claimed);
    // A handler's nested transaction (a savepoint), never ended.
    let nested = sqlx::Connection::begin(tx.conn()).await.expect("savepoint");
    std::mem::forget(nested);
    assert!(
        tx.commit().await.is_err(),
        "the COMMIT only released the savepoint: acking now would lose the message"
    );
    assert_eq!(claims(&store, &key(5)).await, 0);
    // The store goes on with a clean transaction.
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(claim(&mut tx, 5).await, ClaimOutcome::Claimed);
    tx.commit().await.expect("commit");
    assert_eq!(claims(&store, &key(5)).await, 1);
    common::drop_schema(&store).await;
}
