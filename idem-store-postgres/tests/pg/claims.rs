//! Claim behaviour beyond the conformance suite: the lock timeout, aborted transactions,
//! error mapping by SQLSTATE.

use crate::common;

use std::time::{Duration, Instant};

use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, StoreError};

fn key(n: &str) -> IdempotencyKey {
    IdempotencyKey::derive(n, "2026-07-01T09:00:00Z", n.as_bytes()).expect("key")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_held_by_a_long_transaction_is_in_progress_after_the_lock_timeout() {
    let store =
        common::fresh_pg_with(|c| c.with_lock_timeout(Some(Duration::from_millis(200)))).await;
    let k = key("held");
    let mut holder = store.begin().await.expect("begin");
    assert_eq!(
        holder.claim(&k, &ClaimMeta::new("h")).await.expect("claim"),
        ClaimOutcome::Claimed
    );

    let started = Instant::now();
    let mut waiter = store.begin().await.expect("begin");
    let other = key("free");
    assert_eq!(
        waiter
            .claim(&other, &ClaimMeta::new("f"))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed
    );
    assert_eq!(
        waiter
            .claim(&k, &ClaimMeta::new("h"))
            .await
            .expect("a lock timeout is not an error"),
        ClaimOutcome::InProgress
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(150),
        "answered before the timeout: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "waited far past the timeout: {waited:?}"
    );
    // The server aborted the waiter's transaction: committing must not pretend it worked.
    let err = waiter
        .commit()
        .await
        .expect_err("commit of an aborted transaction");
    assert!(
        matches!(err, StoreError::Conflict { .. }) && err.is_retryable(),
        "{err:?}"
    );

    // A batch blocked the same way: every key InProgress, nothing claimed.
    let mut batch_tx = store.begin().await.expect("begin");
    let out = batch_tx
        .claim_batch(&[(key("x"), ClaimMeta::new("x")), (k, ClaimMeta::new("h"))])
        .await
        .expect("batch");
    assert_eq!(
        out,
        vec![ClaimOutcome::InProgress, ClaimOutcome::InProgress]
    );
    batch_tx.rollback().await.expect("rollback");

    holder.commit().await.expect("commit");
    let mut late = store.begin().await.expect("begin");
    assert_eq!(
        late.claim(&k, &ClaimMeta::new("h")).await.expect("claim"),
        ClaimOutcome::Duplicate
    );
    assert_eq!(
        late.claim(&other, &ClaimMeta::new("f"))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed,
        "the aborted waiter's claim must not have been committed"
    );
    late.rollback().await.expect("rollback");
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_lock_timeout_a_claim_waits_for_the_holder() {
    let store = common::fresh_pg().await;
    let k = key("wait");
    let mut holder = store.begin().await.expect("begin");
    holder.claim(&k, &ClaimMeta::new("w")).await.expect("claim");
    let s2 = store.clone();
    let waiter = tokio::spawn(async move {
        let mut tx = s2.begin().await.expect("begin");
        let out = tx.claim(&k, &ClaimMeta::new("w")).await.expect("claim");
        tx.rollback().await.expect("rollback");
        out
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !waiter.is_finished(),
        "the claim did not wait for the holder"
    );
    holder.commit().await.expect("commit");
    assert_eq!(waiter.await.expect("task"), ClaimOutcome::Duplicate);
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_claims_are_in_input_order_with_repeats() {
    let store = common::fresh_pg().await;
    let keys: Vec<IdempotencyKey> = (0..100).map(|i| key(&format!("k{i}"))).collect();
    let mut tx = store.begin().await.expect("begin");
    // Claim every third key first, in the same transaction.
    for k in keys.iter().step_by(3) {
        tx.claim(k, &ClaimMeta::new("s")).await.expect("claim");
    }
    let mut items: Vec<(IdempotencyKey, ClaimMeta)> = keys
        .iter()
        .rev()
        .map(|k| (*k, ClaimMeta::new("s")))
        .collect();
    items.push((keys[1], ClaimMeta::new("s")));
    let out = tx.claim_batch(&items).await.expect("batch");
    for (i, ((k, _), o)) in items.iter().zip(&out).enumerate() {
        let idx = keys.iter().position(|x| x == k).expect("known key");
        let expected = if idx % 3 == 0 || i == items.len() - 1 {
            ClaimOutcome::Duplicate
        } else {
            ClaimOutcome::Claimed
        };
        assert_eq!(*o, expected, "position {i} (key #{idx})");
    }
    tx.commit().await.expect("commit");
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        store.table("processed_messages")
    )))
    .fetch_one(store.pool())
    .await
    .expect("count");
    assert_eq!(n, 100);
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_a_configuration_error_and_a_dead_server_is_unavailable() {
    let store = common::bare_store(|c| c).await; // not migrated
    let mut tx = store.begin().await.expect("begin");
    let err = tx
        .claim(&key("m"), &ClaimMeta::new("m"))
        .await
        .expect_err("no table");
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    assert!(!err.is_retryable());
    drop(tx);
    common::drop_schema(&store).await;

    // Nothing listens on port 1: with the default acquire timeout (30 s), the refusal is
    // the answer at once, with its reason, not a pool's timeout.
    let started = std::time::Instant::now();
    let err = idem_store_postgres::PgStore::connect(
        "postgres://postgres@127.0.0.1:1/test",
        idem_store_postgres::PgConfig::default(),
    )
    .await
    .expect_err("no server");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(err, StoreError::Unavailable { .. }), "{err:?}");
    assert!(err.is_retryable());
    let mut chain = err.to_string();
    let mut cause = std::error::Error::source(&err);
    while let Some(c) = cause {
        chain.push_str(&format!(": {c}"));
        cause = c.source();
    }
    assert!(chain.contains("refused"), "{chain}");

    // A role that does not exist is refused by the server itself, at once.
    let wrong_role = common::url().replacen("://postgres@", "://no_such_role_idem@", 1);
    assert_ne!(
        wrong_role,
        common::url(),
        "the test needs a URL with the user postgres"
    );
    let err = idem_store_postgres::PgStore::connect(
        &wrong_role,
        idem_store_postgres::PgConfig::default(),
    )
    .await
    .expect_err("no such role");
    assert!(err.to_string().contains("connect to Postgres"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unique_violations_are_recognised_by_sqlstate() {
    let store = common::fresh_pg().await;
    let t = store.table("uniq");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {t} (id int primary key)"
    )))
    .execute(store.pool())
    .await
    .expect("create");
    sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {t} VALUES (1)")))
        .execute(store.pool())
        .await
        .expect("insert");
    let e = sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {t} VALUES (1)")))
        .execute(store.pool())
        .await
        .expect_err("duplicate");
    assert!(idem_store_postgres::error::is_unique_violation(&e));
    let mapped = idem_store_postgres::error::map_sqlx(e, "insert");
    assert!(matches!(mapped, StoreError::Rejected { .. }) && !mapped.is_retryable());
    common::drop_schema(&store).await;
}
