//! Waiting, refusals and retention on a real server: a claim waits at most the default
//! lock timeout and answers `InProgress`; values Postgres refuses for good are
//! `Rejected` (so the gate dead-letters them); the retention floor is three calendar
//! years; the store's identity is created once, kept, and rotated on demand.

use crate::common;

use std::time::Duration;

use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, StoreError};
use idem_store_postgres::error::map_sqlx;
use idem_store_postgres::{PgConfig, PgError, PurgeOptions, DEFAULT_RETENTION_FLOOR};

fn key(s: &str) -> IdempotencyKey {
    IdempotencyKey::derive(s, "2026-07-01T09:00:00Z", b"{}").expect("key")
}

fn sqlstate(e: &StoreError) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = cur {
        if let Some(sqlx::Error::Database(db)) = s.downcast_ref::<sqlx::Error>() {
            return db.code().map(|c| c.into_owned());
        }
        cur = s.source();
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_claim_waits_a_bounded_time_then_is_in_progress() {
    assert_eq!(
        PgConfig::default().lock_timeout,
        Some(PgConfig::DEFAULT_LOCK_TIMEOUT)
    );
    assert_eq!(PgConfig::DEFAULT_LOCK_TIMEOUT, Duration::from_secs(5));
    let store = common::fresh_pg().await; // the default configuration
    let k = key("held");
    let mut holder = store.begin().await.expect("begin");
    assert_eq!(
        holder.claim(&k, &ClaimMeta::new("h")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    let mut waiter = store.begin().await.expect("begin");
    // Bounded: without the default it would wait until the holder ends (never, here).
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        waiter.claim(&k, &ClaimMeta::new("h")),
    )
    .await
    .expect("the claim waited without bound")
    .expect("claim");
    assert_eq!(out, ClaimOutcome::InProgress);
    waiter.rollback().await.expect("rollback");
    holder.commit().await.expect("commit");
    common::drop_schema(&store).await;
}

/// NUL in text (22021), an index row too big (54000) and a string too long for its
/// column (22001): refused for good, so `Rejected` and not retryable — never nacked into
/// a loop. Each transaction is rolled back and nothing is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_postgres_refuses_for_good_are_rejected() {
    let store = common::fresh_pg().await;
    let check = |e: StoreError, code: &str| {
        assert!(matches!(e, StoreError::Rejected { .. }), "{code}: {e:?}");
        assert!(!e.is_retryable(), "{code}");
        assert_eq!(sqlstate(&e).as_deref(), Some(code), "{e:?}");
        assert!(
            e.to_string().contains(code),
            "the reason names the SQLSTATE: {e}"
        );
    };

    let mut tx = store.begin().await.expect("begin");
    let e = tx
        .claim(&key("nul"), &ClaimMeta::new("A-\0-1"))
        .await
        .expect_err("NUL in text");
    check(e, "22021");
    assert!(
        tx.commit().await.is_err(),
        "an aborted transaction must not commit"
    );

    // Incompressible, so the award_id index entry cannot fit a btree page (~2700 bytes).
    let long: String = (0..3000)
        .map(|_| char::from(b'!' + rand::random::<u8>() % 90))
        .collect();
    let mut tx = store.begin().await.expect("begin");
    let e = tx
        .claim(&key("long"), &ClaimMeta::new(long))
        .await
        .expect_err("index row too big");
    check(e, "54000");
    tx.rollback().await.expect("rollback");

    let short = store.table("short_codes");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {short} (code varchar(8) NOT NULL)"
    )))
    .execute(store.pool())
    .await
    .expect("create");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&key("too-long"), &ClaimMeta::new("t"))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed
    );
    let e = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {short} (code) VALUES ($1)"
    )))
    .bind("longer than eight")
    .execute(tx.conn())
    .await
    .map_err(|e| map_sqlx(e, "write the business row"))
    .expect_err("too long");
    check(e, "22001");
    tx.rollback().await.expect("rollback");

    let claimed: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        store.table("processed_messages")
    )))
    .fetch_one(store.pool())
    .await
    .expect("count");
    assert_eq!(claimed, 0, "a refused message left a claim");
    common::drop_schema(&store).await;
}

/// `interval '3 years'` counted by the server (1095 or 1096 days, by leap days), not
/// 3×365 days: a cutoff an hour younger than three calendar years is refused, one a
/// minute older is allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retention_floor_is_three_calendar_years() {
    let store = common::fresh_pg().await;
    let three_years: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - (now() - interval '3 years'))::float8",
    )
    .fetch_one(store.pool())
    .await
    .expect("interval");
    assert!(three_years >= 1095.0 * 86_400.0);
    assert_eq!(
        PurgeOptions::new(Duration::ZERO).floor,
        DEFAULT_RETENTION_FLOOR
    );
    let young = Duration::from_secs_f64(three_years - 3600.0);
    let err = store
        .purge(&PurgeOptions::new(young).dry_run(true), |_| {})
        .await
        .expect_err("below three calendar years");
    assert!(
        matches!(err, PgError::BelowRetentionFloor { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("interval '3 years'"), "{err}");
    store
        .purge(
            &PurgeOptions::new(Duration::from_secs_f64(three_years + 60.0)).dry_run(true),
            |_| {},
        )
        .await
        .expect("older than three calendar years");
    // 3×365 days is below the floor whenever the last three years hold a leap day.
    let naive = Duration::from_secs(3 * 365 * 86_400);
    let refused = store
        .purge(&PurgeOptions::new(naive).dry_run(true), |_| {})
        .await
        .is_err();
    assert_eq!(refused, three_years > 1095.0 * 86_400.0 + 1.0);
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_identity_is_created_once_counted_and_rotated() {
    let store = common::fresh_pg().await;
    let id = store.store_identity().await.expect("identity");
    assert_eq!(id.store_id.len(), 32);
    assert_eq!(id.session, 0);
    store.migrate().await.expect("migrate again");
    assert_eq!(store.store_identity().await.expect("identity"), id, "kept");

    let s = store.begin_identity_session().await.expect("session");
    assert_eq!(s.identity().session, 1);
    s.commit().await.expect("commit");
    let s = store.begin_identity_session().await.expect("session");
    drop(s);
    assert_eq!(store.store_identity().await.expect("identity").session, 1);

    let rotated = store.rotate_store_identity().await.expect("rotate");
    assert_ne!(rotated.store_id, id.store_id);
    assert_eq!(rotated.session, 1);

    let other = common::fresh_pg().await;
    assert_ne!(
        other.store_identity().await.expect("identity").store_id,
        rotated.store_id,
        "two schemas, two identities"
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP TABLE {}",
        other.table("idem_store_identity")
    )))
    .execute(other.pool())
    .await
    .expect("drop");
    assert!(matches!(
        other.begin_identity_session().await,
        Err(StoreError::Config(_))
    ));
    common::drop_schema(&store).await;
    common::drop_schema(&other).await;
}
