//! Conflict detection on the real server, beyond the conformance suite: what the identity
//! column holds, the reference consumer sharing the migrated table, a store on a reference
//! table that was never migrated (no detection, said so), and the partitioned layout's
//! identity index holding across a batch.

use crate::common;

use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};

const TS: &str = "2026-07-01T09:00:00Z";

/// `NAME::plain`, `NAME::partitioned` and `NAME::distributed`: the test `NAME(store)` on a
/// new store of each layout.
macro_rules! on_every_layout {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn plain() {
                super::$name(super::common::fresh_pg().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn partitioned() {
                super::$name(super::common::fresh_partitioned_pg().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn distributed() {
                super::$name(super::common::fresh_distributed_pg().await).await;
            }
        }
    };
}

fn key(subject: &str, payload: &str) -> IdempotencyKey {
    IdempotencyKey::derive(subject, TS, payload.as_bytes()).expect("key")
}

fn meta(subject: &str) -> ClaimMeta {
    ClaimMeta::new(subject).with_submission_timestamp(TS)
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
        common::claim_one(&store, &a, &meta("P-1")).await,
        ClaimOutcome::Claimed
    );
    let row: (Option<String>, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT award_id, submission_timestamp FROM {} WHERE idempotency_key = $1",
        store.table("processed_messages")
    )))
    .bind(a.to_hex())
    .fetch_one(store.pool())
    .await
    .expect("row");
    assert_eq!(row, (Some("P-1".into()), Some(TS.into())));
    assert_eq!(
        common::claim_one(&store, &b, &meta("P-1")).await,
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
        let r = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
            .bind(k.to_hex())
            .execute(store.pool())
            .await
            .expect("the reference claim");
        assert_eq!(r.rows_affected(), 1);
    }
    assert_eq!(
        common::claim_one(&store, &key("P-2", "x"), &meta("P-2")).await,
        ClaimOutcome::Claimed
    );
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_table_never_migrated_claims_without_detection_and_says_so() {
    let store = common::bare_store(|c| c).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {} (idempotency_key text primary key, award_id text, claimed_at timestamptz default now())",
        store.table("processed_messages")
    )))
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
        common::claim_one(&store, &a, &meta("R-1")).await,
        ClaimOutcome::Claimed
    );
    assert_eq!(
        common::claim_one(&store, &b, &meta("R-1")).await,
        ClaimOutcome::Claimed
    );

    // `migrate` adds the column and the index in place (the existing rows have no
    // identity) and turns detection on for this store at once.
    store.migrate().await.expect("migrate");
    assert!(store.capabilities().detects_conflicts);
    let c = key("R-2", "1");
    assert_eq!(
        common::claim_one(&store, &c, &meta("R-2")).await,
        ClaimOutcome::Claimed
    );
    assert_eq!(
        common::claim_one(&store, &key("R-2", "2"), &meta("R-2")).await,
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
        common::claim_one(&store, &c, &meta("Q-1")).await,
        ClaimOutcome::Conflict { existing: won }
    );
    assert_eq!(
        common::claim_one(&store, &lost, &meta("Q-1").without_identity()).await,
        ClaimOutcome::Claimed,
        "the process policy's claim, in the message's month"
    );
    let months: Vec<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT submission_month::text FROM {} ORDER BY 1",
        store.table("processed_messages")
    )))
    .fetch_all(store.pool())
    .await
    .expect("months");
    assert_eq!(
        months,
        [("2026-07-01".to_owned(),), ("2026-07-01".to_owned(),)]
    );
    common::drop_schema(&store).await;
}

/// Two batches holding another payload each of the same 200 submissions, claimed at once
/// in two transactions. Claimed in key order alone, each would lock the identities in its
/// own (hash) order and they would deadlock (Postgres breaks it after `deadlock_timeout`
/// with 40P01, an error for one of them); in `claim_order` (identity first) one waits for
/// the other: one batch claims every submission, the other finds 200 conflicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_of_crossing_conflicts_never_deadlock() {
    let store = common::fresh_pg().await;
    let batch = |round: u32, variant: &str| -> Vec<(IdempotencyKey, ClaimMeta)> {
        (0..200)
            .map(|i| {
                let subject = format!("X-{round}-{i}");
                (key(&subject, variant), meta(&subject))
            })
            .collect()
    };
    let run = |items: Vec<(IdempotencyKey, ClaimMeta)>| {
        let store = store.clone();
        tokio::spawn(async move {
            let mut tx = store.begin().await?;
            let out = tx.claim_batch(&items).await?;
            tx.commit().await?;
            Ok::<_, idem_engine::StoreError>(out)
        })
    };
    let count =
        |o: &[ClaimOutcome], f: fn(&ClaimOutcome) -> bool| o.iter().filter(|c| f(c)).count();
    let is_claimed: fn(&ClaimOutcome) -> bool = |c| *c == ClaimOutcome::Claimed;
    let is_conflict: fn(&ClaimOutcome) -> bool = |c| matches!(c, ClaimOutcome::Conflict { .. });
    // Three rounds on new submissions: each a fresh chance to interleave.
    for round in 0..3 {
        let (a, b) = tokio::join!(run(batch(round, "a")), run(batch(round, "b")));
        let a = a.expect("task").expect("batch a: no deadlock, no error");
        let b = b.expect("task").expect("batch b: no deadlock, no error");
        // One batch won every submission, the other met every conflict.
        let (won, lost) = if count(&a, is_claimed) == 200 {
            (&a, &b)
        } else {
            (&b, &a)
        };
        assert_eq!(count(won, is_claimed), 200, "round {round}: {a:?} {b:?}");
        assert_eq!(count(lost, is_conflict), 200, "round {round}: {lost:?}");
    }
    common::drop_schema(&store).await;
}

/// What `waiter` answers when `key` is claimed by another transaction, uncommitted, as it
/// starts, and committed while it waits on that claim: `waiter` is spawned, must still be
/// waiting after 300 ms (its statement began with the claim invisible to it), and is
/// awaited once the claim is committed.
async fn committed_while_it_waits<T: Send + 'static>(
    store: &idem_store_postgres::PgStore,
    key: &IdempotencyKey,
    held: &ClaimMeta,
    waiter: impl std::future::Future<Output = Result<T, idem_engine::StoreError>> + Send + 'static,
) -> T {
    let mut first = store.begin().await.expect("begin");
    assert_eq!(
        first.claim(key, held).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    let waiting = tokio::spawn(waiter);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "the waiter waits for the uncommitted claim"
    );
    first.commit().await.expect("commit");
    waiting.await.expect("task").expect("waiter")
}

/// A batch claim answers a refused key from the rows its own statement can see; a row
/// committed while the statement waited on it is not among them. Such a key must still
/// come back `Duplicate` or `Conflict` (classified by a statement of its own), never
/// `InProgress`, which would nack a message whose effect is already committed.
async fn a_batch_refused_by_a_claim_committed_while_it_waited_is_classified(
    store: idem_store_postgres::PgStore,
) {
    let (a, b) = (key("W-1", "1"), key("W-1", "2"));
    let fresh = key("W-2", "1");
    let waiter = {
        let store = store.clone();
        async move {
            let mut tx = store.begin().await?;
            // The same key, another payload of the same submission, and a new one.
            let out = tx
                .claim_batch(&[(a, meta("W-1")), (fresh, meta("W-2"))])
                .await?;
            let mut other = store.begin().await?;
            let conflict = other.claim_batch(&[(b, meta("W-1"))]).await?;
            other.rollback().await?;
            tx.commit().await?;
            Ok::<_, idem_engine::StoreError>((out, conflict))
        }
    };
    let (out, conflict) = committed_while_it_waits(&store, &a, &meta("W-1"), waiter).await;
    assert_eq!(out, [ClaimOutcome::Duplicate, ClaimOutcome::Claimed]);
    assert_eq!(conflict, [ClaimOutcome::Conflict { existing: a }]);
    common::drop_schema(&store).await;
}

on_every_layout!(a_batch_refused_by_a_claim_committed_while_it_waited_is_classified);

/// One claim answers a redelivery from its own statement, when the key's row is in that
/// statement's snapshot; a row committed while the claim waited on it is not. Such a key
/// must still come back `Duplicate` (classified by a statement of its own), never
/// `InProgress` or `Conflict`; and a claim refused by the identity's row alone is a
/// `Conflict`, never a `Duplicate`.
async fn a_claim_refused_by_a_claim_committed_while_it_waited_is_classified(
    store: idem_store_postgres::PgStore,
) {
    let (a, b) = (key("S-1", "1"), key("S-1", "2"));
    let waiter = {
        let store = store.clone();
        async move {
            let mut tx = store.begin().await?;
            let out = tx.claim(&a, &meta("S-1")).await?;
            tx.rollback().await?;
            Ok::<_, idem_engine::StoreError>(out)
        }
    };
    assert_eq!(
        committed_while_it_waits(&store, &a, &meta("S-1"), waiter).await,
        ClaimOutcome::Duplicate
    );
    // Committed before it began: in the claim's own snapshot.
    assert_eq!(
        common::claim_one(&store, &a, &meta("S-1")).await,
        ClaimOutcome::Duplicate
    );
    // Another payload of the same submission: refused by the identity's row alone.
    assert_eq!(
        common::claim_one(&store, &b, &meta("S-1")).await,
        ClaimOutcome::Conflict { existing: a }
    );
    common::drop_schema(&store).await;
}

on_every_layout!(a_claim_refused_by_a_claim_committed_while_it_waited_is_classified);

/// The key's own row decides before the identity's, as in a classification of its own: a
/// batch item whose identity row was committed long ago, and whose key another consumer
/// (the process policy's claim without identity) committed while the batch waited on it,
/// is a `Duplicate` — its effect is committed — not a `Conflict` with the older row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_committed_while_the_batch_waited_is_a_duplicate_before_an_older_conflict() {
    let store = common::fresh_pg().await;
    let (a, b) = (key("V-1", "1"), key("V-1", "2"));
    assert_eq!(
        common::claim_one(&store, &a, &meta("V-1")).await,
        ClaimOutcome::Claimed
    );
    let waiter = {
        let store = store.clone();
        async move {
            let mut tx = store.begin().await?;
            let out = tx.claim_batch(&[(b, meta("V-1"))]).await?;
            tx.rollback().await?;
            Ok::<_, idem_engine::StoreError>(out)
        }
    };
    let held = meta("V-1").without_identity();
    let out = committed_while_it_waits(&store, &b, &held, waiter).await;
    assert_eq!(out, [ClaimOutcome::Duplicate]);
    common::drop_schema(&store).await;
}
