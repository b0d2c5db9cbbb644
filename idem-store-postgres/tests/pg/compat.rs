//! The store works on a `processed_messages` created by another program with only the
//! reference columns, and on a reference `outbox` (which `migrate` upgrades in place).

use crate::common;

use std::time::Duration;

use idem_engine::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxBatch, OutboxEvent,
    OutboxSource, OutboxWriter,
};
use idem_store_postgres::{PgConfig, PgOutboxSource, PgStore};

async fn columns(store: &PgStore, table: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position",
    )
    .bind(store.schema())
    .bind(table)
    .fetch_all(store.pool())
    .await
    .expect("columns")
}

async fn reference_processed_messages(store: &PgStore) {
    // As the reference program creates it.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {} (idempotency_key text primary key, award_id text, claimed_at timestamptz default now())",
        store.table("processed_messages")
    )))
    .execute(store.pool())
    .await
    .expect("create reference table");
}

fn key(n: &str) -> IdempotencyKey {
    IdempotencyKey::derive(n, "2026-07-01T09:00:00Z", n.as_bytes()).expect("key")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_work_on_a_reference_table_without_any_migration() {
    let store = common::bare_store(|c| c).await;
    reference_processed_messages(&store).await;
    // A row the other program wrote: our claim of the same key is a duplicate.
    let theirs = key("theirs");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (idempotency_key, award_id) VALUES ($1, 'A-1')",
        store.table("processed_messages")
    )))
    .bind(theirs.to_hex())
    .execute(store.pool())
    .await
    .expect("their row");

    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&theirs, &ClaimMeta::new("A-1"))
            .await
            .expect("claim"),
        ClaimOutcome::Duplicate,
        "a key the other program claimed must be a duplicate"
    );
    let ours = key("ours");
    assert_eq!(
        tx.claim(&ours, &ClaimMeta::new("A-2"))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed
    );
    let batch = tx
        .claim_batch(&[
            (key("b1"), ClaimMeta::new("A-3")),
            (theirs, ClaimMeta::new("A-1")),
        ])
        .await
        .expect("batch");
    assert_eq!(batch, vec![ClaimOutcome::Claimed, ClaimOutcome::Duplicate]);
    tx.commit().await.expect("commit");

    // What the other program reads back: its three columns, filled.
    let row: (String, Option<String>, bool) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT idempotency_key, award_id, claimed_at IS NOT NULL FROM {} WHERE idempotency_key = $1",
        store.table("processed_messages")
    )))
    .bind(ours.to_hex())
    .fetch_one(store.pool())
    .await
    .expect("our row");
    assert_eq!(row, (ours.to_hex(), Some("A-2".to_owned()), true));
    assert_eq!(
        columns(&store, "processed_messages").await,
        ["idempotency_key", "award_id", "claimed_at"]
    );
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_keeps_a_reference_table_and_upgrades_a_reference_outbox() {
    let store = common::bare_store(|c| c).await;
    reference_processed_messages(&store).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {} (event_type text, payload jsonb, created_at timestamptz default now())",
        store.table("outbox")
    )))
    .execute(store.pool())
    .await
    .expect("reference outbox");
    // A row the other program left behind (no event id: not relayed by us).
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (event_type, payload) VALUES ('disbursement.recorded', '{{\"award_id\":\"A-0\"}}')",
        store.table("outbox")
    )))
    .execute(store.pool())
    .await
    .expect("their event");

    store.migrate().await.expect("migrate");
    store.migrate().await.expect("migrate is idempotent");
    assert_eq!(
        columns(&store, "processed_messages").await,
        [
            "idempotency_key",
            "award_id",
            "claimed_at",
            "submission_timestamp"
        ],
        "migrate keeps the reference columns and adds only the nullable identity column"
    );
    // The reference consumer's own claim still works on the migrated table, twice over
    // for one identity (it records none, so it is never in conflict).
    for n in ["ref-1", "ref-2"] {
        let inserted = sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (idempotency_key, award_id) VALUES ($1, 'A-9') \
             ON CONFLICT (idempotency_key) DO NOTHING",
            store.table("processed_messages")
        )))
        .bind(key(n).to_hex())
        .execute(store.pool())
        .await
        .expect("the reference claim");
        assert_eq!(inserted.rows_affected(), 1);
    }

    let k = key("after-migrate");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &ClaimMeta::new("A-5")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    let ev = OutboxEvent::new(k, "disbursement.recorded", "A-5", "{\"award_id\":\"A-5\"}");
    tx.enqueue(&ev)
        .await
        .expect("enqueue into the upgraded outbox");
    tx.commit().await.expect("commit");

    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(20));
    let batch = source.lease(10).await.expect("lease");
    assert_eq!(batch.events().len(), 1, "only our event is relayed");
    assert_eq!(batch.events()[0].event_id, ev.event_id);
    batch.mark_published().await.expect("mark");
    common::drop_schema(&store).await;
}

#[tokio::test]
async fn invalid_schema_names_are_refused() {
    for bad in ["", "1abc", "a-b", "a\"b", "a b", "x;drop", &"a".repeat(64)] {
        assert!(PgConfig::new(bad).is_err(), "{bad:?} accepted");
    }
    assert!(PgConfig::new("A_b_9").is_ok());
    let mut c = PgConfig::default();
    assert_eq!(c.schema, "public");
    c.schema = "no good".into();
    let err = PgStore::connect(&common::url(), c)
        .await
        .expect_err("invalid schema");
    assert!(matches!(err, idem_engine::StoreError::Config(_)), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_names_are_quoted_and_qualified() {
    let store = common::fresh_pg().await;
    assert_eq!(
        store.table("disbursements"),
        format!("\"{}\".\"disbursements\"", store.schema())
    );
    assert_eq!(
        store.table("we\"ird"),
        format!("\"{}\".\"we\"\"ird\"", store.schema())
    );
    common::drop_schema(&store).await;
}

/// Every migration is plain ASCII, comments included: the server converts the whole script
/// to the database's encoding, and a `LATIN1` database refuses characters it has no
/// equivalent for (SQLSTATE 22P05) — a dash or an ellipsis in a comment would stop
/// `migrate` there (`idem-cli/tests/cli/refused_bodies.rs` runs one on such a database).
#[test]
fn every_migration_is_ascii() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("migrations") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "sql") {
            let text = std::fs::read_to_string(&path).expect("read");
            for (n, line) in text.lines().enumerate() {
                assert!(
                    line.is_ascii(),
                    "{}:{}: not ASCII: {line}",
                    path.display(),
                    n + 1
                );
            }
            seen += 1;
        }
    }
    assert!(
        seen >= 10,
        "only {seen} migrations found in {}",
        dir.display()
    );
}

/// The collation of each `(table, column)` of `store`'s schema named in `wanted`, and of
/// each column of the indexes on them ("default" where none is set).
async fn collations(store: &PgStore, wanted: &[(&str, &str)]) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (table, column) in wanted {
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT a.attname::text, coalesce(c.collname::text, 'default') \
               FROM pg_attribute a LEFT JOIN pg_collation c ON c.oid = a.attcollation \
              WHERE a.attrelid = to_regclass($1) AND a.attname = $2",
        )
        .bind(store.table(table))
        .bind(*column)
        .fetch_all(store.pool())
        .await
        .expect("collation");
        assert_eq!(rows.len(), 1, "{table}.{column} exists");
        out.push(((*table).to_owned(), rows[0].0.clone(), rows[0].1.clone()));
    }
    out
}

const KEY_COLUMNS: &[(&str, &str)] = &[
    ("processed_messages", "idempotency_key"),
    ("processed_messages", "award_id"),
    ("processed_messages", "submission_timestamp"),
    ("outbox", "event_id"),
    ("outbox", "subject"),
    ("outbox", "idempotency_key"),
    ("outbox_pending", "subject"),
];

/// Every index on those columns, with the collation it compares by, for `store`'s schema.
async fn index_collations(store: &PgStore) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT ic.relname::text || '.' || a.attname::text, coalesce(co.collname::text, 'default') \
           FROM pg_index i \
           JOIN pg_class ic ON ic.oid = i.indexrelid \
           JOIN pg_class t ON t.oid = i.indrelid \
           JOIN pg_namespace n ON n.oid = t.relnamespace \
           JOIN LATERAL unnest(i.indkey::int2[], i.indcollation::oid[]) AS k(attnum, coll) ON true \
           JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.attnum \
           LEFT JOIN pg_collation co ON co.oid = k.coll \
          WHERE n.nspname = $1 AND t.relname IN ('processed_messages', 'outbox', 'outbox_pending') \
            AND a.atttypid = 'text'::regtype \
          ORDER BY 1",
    )
    .bind(store.schema())
    .fetch_all(store.pool())
    .await
    .expect("index collations")
}

/// A new schema compares its keys, event ids, award ids and subjects byte by byte
/// (COLLATE "C"), in the tables and in every index on them, whatever the database's
/// default collation: in a database whose default is a language's, each index insert would
/// otherwise go through it (migrations/0001_tables.sql).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_schema_compares_its_keys_byte_by_byte() {
    for store in [
        common::fresh_pg().await,
        common::fresh_partitioned_pg().await,
    ] {
        let layout = store.layout();
        for (table, column, collation) in collations(&store, KEY_COLUMNS).await {
            assert_eq!(collation, "C", "{layout:?}: {table}.{column}");
        }
        let indexes = index_collations(&store).await;
        for name in [
            "processed_messages_pkey.idempotency_key",
            "processed_messages_identity_key.award_id",
            "processed_messages_identity_key.submission_timestamp",
            "outbox_event_id_key.event_id",
            "outbox_pending_subject_idx.subject",
        ] {
            let found = indexes.iter().find(|(n, _)| n == name);
            assert_eq!(
                found.map(|(_, c)| c.as_str()),
                Some("C"),
                "{layout:?}: {name} in {indexes:?}"
            );
        }
        common::drop_schema(&store).await;
    }
}

/// The reference design's table, made by another program, keeps its columns' collation
/// through `migrate` (no rewrite, no long lock), and claims and conflicts work on it as on
/// a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_tables_columns_keep_their_collation() {
    let store = common::bare_store(|c| c).await;
    reference_processed_messages(&store).await;
    store
        .migrate()
        .await
        .expect("migrate over the reference table");
    let got = collations(&store, &[("processed_messages", "idempotency_key")]).await;
    assert_eq!(
        got[0].2, "default",
        "the reference table's key column is left as it was"
    );
    // The column 0006 adds is byte-wise beside the reference's default-collated award id,
    // and the identity index spans both.
    let got = collations(&store, &[("processed_messages", "submission_timestamp")]).await;
    assert_eq!(got[0].2, "C");
    let meta = ClaimMeta::new("A-1").with_submission_timestamp("2026-07-01T09:00:00Z");
    let first = key("one");
    assert_eq!(
        common::claim_one(&store, &first, &meta).await,
        ClaimOutcome::Claimed
    );
    assert_eq!(
        common::claim_one(&store, &first, &meta).await,
        ClaimOutcome::Duplicate
    );
    assert!(
        matches!(
            common::claim_one(&store, &key("changed"), &meta).await,
            ClaimOutcome::Conflict { .. }
        ),
        "a changed resubmission of the same identity is a conflict"
    );
    common::drop_schema(&store).await;
}
