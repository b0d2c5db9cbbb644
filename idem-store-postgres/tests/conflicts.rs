//! Conflict detection on the real server, beyond the conformance suite: what the identity
//! column holds, the reference consumer sharing the migrated table, a store on a reference
//! table that was never migrated (no detection, said so), and the partitioned layout's
//! identity index holding across a batch.

mod common;

use idem_core::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};

const TS: &str = "2026-07-01T09:00:00Z";

fn key(subject: &str, payload: &str) -> IdempotencyKey {
    IdempotencyKey::derive(subject, TS, payload.as_bytes()).expect("key")
}

fn meta(subject: &str) -> ClaimMeta {
    ClaimMeta::new(subject).with_submission_timestamp(TS)
}

async fn claim_one(
    store: &idem_store_postgres::PgStore,
    k: &IdempotencyKey,
    m: &ClaimMeta,
) -> ClaimOutcome {
    let mut tx = store.begin().await.expect("begin");
    let out = tx.claim(k, m).await.expect("claim");
    if out == ClaimOutcome::Claimed {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_table_records_the_identity_and_the_reference_consumer_still_shares_it() {
    let store = common::fresh_pg().await;
    assert!(
        store.capabilities().detects_conflicts,
        "a migrated store detects conflicts"
    );
    let (a, b) = (
        key("P-1", "{\"amount_cents\":1}"),
        key("P-1", "{\"amount_cents\":2}"),
    );
    assert_eq!(
        claim_one(&store, &a, &meta("P-1")).await,
        ClaimOutcome::Claimed
    );
    let row: (Option<String>, Option<String>) = sqlx::query_as(&format!(
        "SELECT award_id, submission_timestamp FROM {} WHERE idempotency_key = $1",
        store.table("processed_messages")
    ))
    .bind(a.to_hex())
    .fetch_one(store.pool())
    .await
    .expect("row");
    assert_eq!(row, (Some("P-1".into()), Some(TS.into())));
    assert_eq!(
        claim_one(&store, &b, &meta("P-1")).await,
        ClaimOutcome::Conflict { existing: a }
    );

    // The reference consumer's claims (no timestamp) of the same award never conflict,
    // and ours of an award it claimed are not refused by its rows either.
    let sql = format!(
        "INSERT INTO {} (idempotency_key, award_id) VALUES ($1, 'P-1') \
         ON CONFLICT (idempotency_key) DO NOTHING",
        store.table("processed_messages")
    );
    for k in [key("P-1", "ref-1"), key("P-1", "ref-2")] {
        let r = sqlx::query(&sql)
            .bind(k.to_hex())
            .execute(store.pool())
            .await
            .expect("the reference claim");
        assert_eq!(r.rows_affected(), 1);
    }
    assert_eq!(
        claim_one(&store, &key("P-2", "x"), &meta("P-2")).await,
        ClaimOutcome::Claimed
    );
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_table_never_migrated_claims_without_detection_and_says_so() {
    let store = common::bare_store(|c| c).await;
    sqlx::query(&format!(
        "CREATE TABLE {} (idempotency_key text primary key, award_id text, claimed_at timestamptz default now())",
        store.table("processed_messages")
    ))
    .execute(store.pool())
    .await
    .expect("reference table");
    // Reconnect: the store reads the table's columns at connect.
    let store = idem_store_postgres::PgStore::connect(
        &common::url(),
        idem_store_postgres::PgConfig::new(store.schema()).expect("schema"),
    )
    .await
    .expect("connect");
    assert!(!store.capabilities().detects_conflicts);
    let (a, b) = (key("R-1", "1"), key("R-1", "2"));
    assert_eq!(
        claim_one(&store, &a, &meta("R-1")).await,
        ClaimOutcome::Claimed
    );
    assert_eq!(
        claim_one(&store, &b, &meta("R-1")).await,
        ClaimOutcome::Claimed
    );

    // `migrate` adds the column and the index in place (the existing rows have no
    // identity) and turns detection on for this store at once.
    store.migrate().await.expect("migrate");
    assert!(store.capabilities().detects_conflicts);
    let c = key("R-2", "1");
    assert_eq!(
        claim_one(&store, &c, &meta("R-2")).await,
        ClaimOutcome::Claimed
    );
    assert_eq!(
        claim_one(&store, &key("R-2", "2"), &meta("R-2")).await,
        ClaimOutcome::Conflict { existing: c }
    );
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partitioned_layout_detects_conflicts_in_and_across_batches() {
    let store = common::fresh_partitioned_pg().await;
    assert!(store.capabilities().detects_conflicts);
    let (a, b, c) = (key("Q-1", "1"), key("Q-1", "2"), key("Q-1", "3"));
    let mut tx = store.begin().await.expect("begin");
    let out = tx
        .claim_batch(&[(a, meta("Q-1")), (b, meta("Q-1")), (a, meta("Q-1"))])
        .await
        .expect("batch");
    tx.commit().await.expect("commit");
    // Keys are inserted in key order: the smaller wins inside one batch.
    let (won, lost) = if a < b { (a, b) } else { (b, a) };
    let want = |k: IdempotencyKey| {
        if k == won {
            ClaimOutcome::Claimed
        } else {
            ClaimOutcome::Conflict { existing: won }
        }
    };
    assert_eq!(out[0], want(a));
    assert_eq!(out[1], want(b));
    assert_eq!(
        out[2],
        if a == won {
            ClaimOutcome::Duplicate
        } else {
            want(a)
        }
    );
    assert_eq!(
        claim_one(&store, &c, &meta("Q-1")).await,
        ClaimOutcome::Conflict { existing: won }
    );
    assert_eq!(
        claim_one(&store, &lost, &meta("Q-1").without_identity()).await,
        ClaimOutcome::Claimed,
        "the process policy's claim, in the message's month"
    );
    let months: Vec<(String,)> = sqlx::query_as(&format!(
        "SELECT submission_month::text FROM {} ORDER BY 1",
        store.table("processed_messages")
    ))
    .fetch_all(store.pool())
    .await
    .expect("months");
    assert_eq!(
        months,
        [("2026-07-01".to_owned(),), ("2026-07-01".to_owned(),)]
    );
    common::drop_schema(&store).await;
}
