//! Conflict detection on SQLite beyond the conformance suite: a `processed_messages` made
//! by another program's consumer with only the reference columns is given the identity
//! column by `migrate`, then detects conflicts; migrating twice is harmless.

use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
use idem_store_sqlite::{SqliteConfig, SqliteStore};

const TS: &str = "2026-07-01T09:00:00Z";

async fn claim_one(store: &SqliteStore, k: &IdempotencyKey, m: &ClaimMeta) -> ClaimOutcome {
    let mut tx = store.begin().await.expect("begin");
    let out = tx.claim(k, m).await.expect("claim");
    if out == ClaimOutcome::Claimed {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    out
}

#[tokio::test]
async fn a_reference_table_is_given_the_identity_column_and_then_detects_conflicts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("shared.db");
    let store = SqliteStore::connect(path.to_str().expect("utf-8"), SqliteConfig::default())
        .await
        .expect("open");
    // The reference columns, with a claim of the other program in it.
    sqlx::raw_sql(
        "CREATE TABLE processed_messages (idempotency_key TEXT PRIMARY KEY, award_id TEXT, \
         claimed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))); \
         INSERT INTO processed_messages (idempotency_key, award_id) VALUES ('old', 'S-1');",
    )
    .execute(store.pool())
    .await
    .expect("reference table");
    store.migrate().await.expect("migrate");
    store.migrate().await.expect("migrate again");
    assert!(store.capabilities().detects_conflicts);

    let meta = ClaimMeta::new("S-1").with_submission_timestamp(TS);
    let a = IdempotencyKey::derive("S-1", TS, b"{\"amount_cents\":1}").expect("key");
    let b = IdempotencyKey::derive("S-1", TS, b"{\"amount_cents\": 1}").expect("key");
    assert_eq!(claim_one(&store, &a, &meta).await, ClaimOutcome::Claimed);
    assert_eq!(
        claim_one(&store, &b, &meta).await,
        ClaimOutcome::Conflict { existing: a },
        "a space added is another key of the same identity"
    );
    assert_eq!(
        claim_one(&store, &b, &meta.clone().without_identity()).await,
        ClaimOutcome::Claimed
    );
    assert_eq!(claim_one(&store, &b, &meta).await, ClaimOutcome::Duplicate);
    let n: i64 =
        sqlx::query_scalar("SELECT count(*) FROM processed_messages WHERE award_id = 'S-1'")
            .fetch_one(store.pool())
            .await
            .expect("count");
    assert_eq!(
        n, 3,
        "the other program's row, a, and b claimed without identity"
    );
}
