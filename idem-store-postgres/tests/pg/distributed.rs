//! The distributed layout (`PgLayout::Distributed`, `migrations/0009_distributed.sql`) on
//! plain Postgres: the keys Citus requires, layout detection, redeliveries, duplicates and
//! conflicts, concurrent claims through different connections, and the Citus step's script
//! run against stand-ins for Citus's catalog and function (no Citus here: the real
//! `create_distributed_table` is untested, docs/scale.md). The conformance suite and the
//! crash property run on this layout too (`conformance_distributed.rs`, `properties.rs`).

use crate::common;

use std::time::Duration;

use idem_engine::ident::Ident;
use idem_engine::sql::SqlText;
use idem_engine::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent, OutboxWriter,
};
use idem_store_postgres::distributed::DISTRIBUTED_TABLES;
use idem_store_postgres::sql::statement;
use idem_store_postgres::{PgConfig, PgLayout, PgStore};
use sqlx::Executor;

const TS: &str = "2026-07-01T09:00:00Z";

fn key(award: &str, payload: &str) -> IdempotencyKey {
    IdempotencyKey::derive(award, TS, payload.as_bytes()).expect("key")
}

fn meta(award: &str) -> ClaimMeta {
    ClaimMeta::new(award).with_submission_timestamp(TS)
}

/// The unique indexes of `schema.table` that do not hold `column`: what Citus refuses
/// when it distributes `table` by `column`.
async fn unique_indexes_without(store: &PgStore, table: &str, column: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT ci.relname::text FROM pg_index i \
         JOIN pg_class ci ON ci.oid = i.indexrelid \
         JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = $2 AND i.indisunique \
           AND NOT EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = i.indrelid \
                           AND a.attnum = ANY (i.indkey) AND a.attname = $3) \
         ORDER BY 1",
    )
    .bind(store.schema())
    .bind(table)
    .bind(column)
    .fetch_all(store.pool())
    .await
    .expect("read the unique indexes")
}

/// Every unique index of `schema.table`: its name and its columns in order.
async fn unique_indexes(store: &PgStore, table: &str) -> Vec<(String, Vec<String>)> {
    sqlx::query_as(
        "SELECT ci.relname::text, array_agg(a.attname::text ORDER BY k.ord) \
         FROM pg_index i \
         JOIN pg_class ci ON ci.oid = i.indexrelid \
         JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
         CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
         WHERE n.nspname = $1 AND c.relname = $2 AND i.indisunique \
         GROUP BY ci.relname ORDER BY 1",
    )
    .bind(store.schema())
    .bind(table)
    .fetch_all(store.pool())
    .await
    .expect("read the unique indexes")
}

async fn not_null(store: &PgStore, table: &str, column: &str) -> bool {
    sqlx::query_scalar(
        "SELECT a.attnotnull FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
         JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = $3",
    )
    .bind(store.schema())
    .bind(table)
    .bind(column)
    .fetch_one(store.pool())
    .await
    .expect("read the column")
}

fn cols(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| (*s).to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_unique_index_of_the_distributed_tables_holds_its_distribution_column() {
    let store = common::fresh_distributed_pg().await;
    for (table, column) in DISTRIBUTED_TABLES {
        assert_eq!(
            unique_indexes_without(&store, table, column).await,
            Vec::<String>::new(),
            "{table}: unique indexes without {column} (Citus would refuse to distribute it)"
        );
        assert!(
            not_null(&store, table, column).await,
            "{table}.{column} is NOT NULL"
        );
    }
    // The keys themselves, so that the check above is not passed by having no index.
    assert_eq!(
        unique_indexes(&store, "processed_messages").await,
        vec![
            (
                "processed_messages_identity_key".to_owned(),
                cols(&["award_id", "submission_timestamp"])
            ),
            (
                "processed_messages_pkey".to_owned(),
                cols(&["award_id", "idempotency_key"])
            ),
        ]
    );
    assert_eq!(
        unique_indexes(&store, "disbursements").await,
        vec![(
            "disbursements_pkey".to_owned(),
            cols(&["award_id", "idempotency_key"])
        )]
    );
    assert_eq!(
        unique_indexes(&store, "outbox").await,
        vec![
            (
                "outbox_event_id_key".to_owned(),
                cols(&["subject", "event_id"])
            ),
            ("outbox_pkey".to_owned(), cols(&["subject", "id"])),
        ]
    );

    // The same check on the plain layout finds the indexes Citus would refuse.
    let plain = common::fresh_pg().await;
    assert_eq!(
        unique_indexes_without(&plain, "processed_messages", "award_id").await,
        vec!["processed_messages_pkey".to_owned()]
    );
    assert_eq!(
        unique_indexes_without(&plain, "outbox", "subject").await,
        vec!["outbox_event_id_key".to_owned(), "outbox_pkey".to_owned()]
    );
    common::drop_schema(&plain).await;
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_opened_on_a_distributed_schema_finds_its_layout_and_no_other_is_forced_on_it() {
    let store = common::fresh_distributed_pg().await;
    store.migrate().await.expect("migrating again is a no-op");
    // Opened with the default configuration, as `idem consume` and `idem demo` open it.
    let opened = PgStore::connect(
        &common::url(),
        PgConfig::new(store.schema()).expect("schema"),
    )
    .await
    .expect("connect");
    assert_eq!(opened.layout(), PgLayout::Distributed);
    assert!(opened.capabilities().detects_conflicts);
    opened
        .migrate()
        .await
        .expect("migrate with the default config");
    let k = key("D-1", "{}");
    let mut tx = opened.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &meta("D-1")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");
    assert_eq!(
        opened.partitions().await.expect("partitions"),
        vec![],
        "not partitioned"
    );

    // Another layout asked of it is refused, not half-applied.
    let partitioned = PgStore::connect(
        &common::url(),
        PgConfig::new(store.schema())
            .expect("schema")
            .with_layout(PgLayout::Partitioned),
    )
    .await
    .expect("connect");
    assert_eq!(
        partitioned.layout(),
        PgLayout::Distributed,
        "the table's wins"
    );
    let err = partitioned.migrate().await.expect_err("partitioned asked");
    assert!(err.to_string().contains("distributed table"), "{err}");

    // And the distributed layout is not forced on a plain table.
    let plain = common::fresh_pg().await;
    let again = PgStore::connect(
        &common::url(),
        plain.config().clone().with_layout(PgLayout::Distributed),
    )
    .await
    .expect("connect");
    assert_eq!(again.layout(), PgLayout::Plain);
    let err = again
        .migrate()
        .await
        .expect_err("distributed asked of a plain table");
    assert!(err.to_string().contains("plain table"), "{err}");
    assert_eq!(
        unique_indexes_without(&plain, "processed_messages", "award_id").await,
        vec!["processed_messages_pkey".to_owned()],
        "the plain table is unchanged"
    );
    assert_eq!(
        "distributed".parse::<PgLayout>().ok(),
        Some(PgLayout::Distributed)
    );
    assert_eq!(PgLayout::Distributed.to_string(), "distributed");
    common::drop_schema(&plain).await;
    common::drop_schema(&store).await;
}

async fn count(store: &PgStore, table: &str, filter: &str, value: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE {filter} = $1",
        store.table(table)
    )))
    .bind(value)
    .fetch_one(store.pool())
    .await
    .expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redeliveries_duplicates_and_conflicts_are_caught_on_the_distributed_layout() {
    let store = common::fresh_distributed_pg().await;
    let k = key("D-7", "{\"amount_cents\":100}");
    let event = OutboxEvent::new(k, "disbursement.recorded", "D-7", r#"{"award_id":"D-7"}"#);

    // The first delivery: claim, disbursement, outbox event, one commit.
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &meta("D-7")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (award_id, amount_cents, idempotency_key) VALUES ($1, 100, $2)",
        store.table("disbursements")
    )))
    .bind("D-7")
    .bind(k.to_hex())
    .execute(tx.conn())
    .await
    .expect("disbursement");
    tx.enqueue(&event).await.expect("enqueue");
    tx.commit().await.expect("commit");

    // A redelivery (same key, same award) is a duplicate, and so is a claim without the
    // timestamp.
    assert_eq!(
        common::claim_one(&store, &k, &meta("D-7")).await,
        ClaimOutcome::Duplicate
    );
    assert_eq!(
        common::claim_one(&store, &k, &ClaimMeta::new("D-7")).await,
        ClaimOutcome::Duplicate
    );
    // Another payload of the same identity (award + timestamp) is a conflict.
    let other = key("D-7", "{\"amount_cents\":999}");
    assert_eq!(
        common::claim_one(&store, &other, &meta("D-7")).await,
        ClaimOutcome::Conflict { existing: k }
    );
    // In a batch: the redelivery, a new key, the new key again, the conflict.
    let fresh = IdempotencyKey::derive("D-8", TS, b"{}").expect("key");
    let mut tx = store.begin().await.expect("begin");
    let outcomes = tx
        .claim_batch(&[
            (k, meta("D-7")),
            (fresh, meta("D-8")),
            (fresh, meta("D-8")),
            (other, meta("D-7")),
        ])
        .await
        .expect("batch");
    assert_eq!(
        outcomes,
        vec![
            ClaimOutcome::Duplicate,
            ClaimOutcome::Claimed,
            ClaimOutcome::Duplicate,
            ClaimOutcome::Conflict { existing: k }
        ]
    );
    // The same event again (a handler re-run after a crash writes it again): stored once,
    // on the outbox's (subject, event_id) target, in a batch too.
    tx.enqueue(&event).await.expect("enqueue again");
    tx.enqueue_many(&[event.clone(), event.clone()])
        .await
        .expect("enqueue many");
    tx.commit().await.expect("commit");
    assert_eq!(
        count(&store, "processed_messages", "idempotency_key", &k.to_hex()).await,
        1
    );
    assert_eq!(
        count(
            &store,
            "processed_messages",
            "idempotency_key",
            &fresh.to_hex()
        )
        .await,
        1
    );
    assert_eq!(
        count(&store, "outbox", "event_id", &event.event_id.to_string()).await,
        1
    );

    // The disbursement's key refuses a second row of one submission.
    let err = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (award_id, amount_cents, idempotency_key) VALUES ($1, 100, $2)",
        store.table("disbursements")
    )))
    .bind("D-7")
    .bind(k.to_hex())
    .execute(store.pool())
    .await
    .expect_err("a second disbursement of one key");
    assert_eq!(
        err.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("23505")
    );

    // Without the identity column (a table not migrated to 0006), the claim's own target,
    // ON CONFLICT (award_id, idempotency_key), catches the redelivery.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE {} DROP COLUMN submission_timestamp",
        store.table("processed_messages")
    )))
    .execute(store.pool())
    .await
    .expect("drop the identity column");
    let bare = PgStore::connect(&common::url(), store.config().clone())
        .await
        .expect("connect");
    assert_eq!(bare.layout(), PgLayout::Distributed);
    assert!(!bare.capabilities().detects_conflicts);
    assert_eq!(
        common::claim_one(&bare, &k, &meta("D-7")).await,
        ClaimOutcome::Duplicate
    );
    let third = key("D-9", "{}");
    let mut tx = bare.begin().await.expect("begin");
    assert_eq!(
        tx.claim_batch(&[(k, meta("D-7")), (third, meta("D-9")), (third, meta("D-9"))])
            .await
            .expect("batch"),
        vec![
            ClaimOutcome::Duplicate,
            ClaimOutcome::Claimed,
            ClaimOutcome::Duplicate
        ]
    );
    tx.commit().await.expect("commit");
    assert_eq!(
        common::claim_one(&bare, &third, &meta("D-9")).await,
        ClaimOutcome::Duplicate
    );
    // The audit questions still find the claims (the key's own index, 0009's audit set).
    let record = store
        .inspect_key(&k)
        .await
        .expect("inspect")
        .expect("found");
    assert_eq!(record.award_id.as_deref(), Some("D-7"));
    assert_eq!(record.events.len(), 1);
    common::drop_schema(&store).await;
}

/// A store with a pool of its own: its connections are not the other store's.
async fn second_connection(store: &PgStore) -> PgStore {
    PgStore::connect(
        &common::url(),
        store.config().clone().with_max_connections(4),
    )
    .await
    .expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_cannot_be_claimed_twice_through_different_connections_at_once() {
    let store = common::fresh_distributed_pg().await;
    let other = second_connection(&store).await;

    // The second claim waits on the first transaction, then sees its outcome.
    for commit in [true, false] {
        let award = if commit { "C-commit" } else { "C-rollback" };
        let k = key(award, "{}");
        let mut first = store.begin().await.expect("begin");
        assert_eq!(
            first.claim(&k, &meta(award)).await.expect("claim"),
            ClaimOutcome::Claimed
        );
        let waiting = {
            let other = other.clone();
            tokio::spawn(async move {
                let mut tx = other.begin().await.expect("begin");
                let out = tx.claim(&k, &meta(award)).await.expect("claim");
                if out == ClaimOutcome::Claimed {
                    tx.commit().await.expect("commit");
                } else {
                    tx.rollback().await.expect("rollback");
                }
                out
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiting.is_finished(),
            "the second claim must wait for the first transaction"
        );
        if commit {
            first.commit().await.expect("commit");
        } else {
            first.rollback().await.expect("rollback");
        }
        let expected = if commit {
            ClaimOutcome::Duplicate
        } else {
            ClaimOutcome::Claimed
        };
        assert_eq!(waiting.await.expect("join"), expected, "{award}");
        assert_eq!(
            count(&store, "processed_messages", "idempotency_key", &k.to_hex()).await,
            1
        );
    }

    // A race: eight claims of one key at once, four through each pool; one wins.
    let k = key("C-race", "{}");
    let mut tasks = Vec::new();
    for i in 0..8 {
        let s = if i % 2 == 0 {
            store.clone()
        } else {
            other.clone()
        };
        tasks.push(tokio::spawn(async move {
            common::claim_one(&s, &k, &meta("C-race")).await
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.expect("join"));
    }
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == ClaimOutcome::Claimed)
            .count(),
        1,
        "{outcomes:?}"
    );
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, ClaimOutcome::Claimed | ClaimOutcome::Duplicate)),
        "{outcomes:?}"
    );
    assert_eq!(
        count(&store, "processed_messages", "idempotency_key", &k.to_hex()).await,
        1
    );
    other.pool().close().await;
    common::drop_schema(&store).await;
}

/// The Citus step (`migrations/0009_distributed_citus.sql`) against stand-ins for Citus's
/// `pg_dist_partition` and `create_distributed_table`, which record the calls: the four
/// tables, their distribution columns, the colocation, and no second call for a table
/// already distributed. This checks the script's own logic and SQL, not Citus: on plain
/// Postgres `migrate` does not run it (the extension is missing), and the real Citus has
/// not run it either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_citus_step_distributes_the_four_tables_colocated_once() {
    let store = common::fresh_distributed_pg().await;
    if store.citus_installed().await.expect("look for citus") {
        // On a server with Citus, migrate has run the real step.
        for (table, column) in DISTRIBUTED_TABLES {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_dist_partition WHERE logicalrelid = $1::regclass \
                 AND column_to_column_name(logicalrelid, partkey) = $2",
            )
            .bind(format!("{}.{table}", store.schema()))
            .bind(column)
            .fetch_one(store.pool())
            .await
            .expect("read pg_dist_partition");
            assert_eq!(n, 1, "{table} distributed by {column}");
        }
        common::drop_schema(&store).await;
        return;
    }
    let stub = format!("{}_citus", store.schema());
    for ddl in [
        format!("CREATE SCHEMA \"{stub}\""),
        format!(
            "CREATE TABLE \"{stub}\".pg_dist_partition \
             (n serial, logicalrelid regclass, column_name text, colocate_with text)"
        ),
        format!(
            "CREATE FUNCTION \"{stub}\".create_distributed_table(table_name regclass, \
             distribution_column text, colocate_with text DEFAULT 'default') RETURNS void \
             LANGUAGE sql AS $f$ INSERT INTO \"{stub}\".pg_dist_partition \
             (logicalrelid, column_name, colocate_with) \
             VALUES (table_name, distribution_column, colocate_with) $f$"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(ddl))
            .execute(store.pool())
            .await
            .expect("stub");
    }
    let script = SqlText::render(
        include_str!("../../migrations/0009_distributed_citus.sql"),
        &[("schema", &Ident::new(store.schema()).expect("schema"))],
    );
    for _ in 0..2 {
        let mut tx = store.pool().begin().await.expect("begin");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET LOCAL search_path TO \"{stub}\""
        )))
        .execute(&mut *tx)
        .await
        .expect("search_path");
        (&mut *tx)
            .execute(statement(script.clone()))
            .await
            .expect("the Citus step against the stubs");
        tx.commit().await.expect("commit");
    }
    let calls: Vec<(String, String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT logicalrelid::text, column_name, colocate_with FROM \"{stub}\".pg_dist_partition \
         ORDER BY n"
    )))
    .fetch_all(store.pool())
    .await
    .expect("calls");
    let s = store.schema();
    let anchor = format!("\"{s}\".processed_messages");
    assert_eq!(
        calls,
        vec![
            (
                format!("{s}.processed_messages"),
                "award_id".to_owned(),
                "default".to_owned()
            ),
            (
                format!("{s}.disbursements"),
                "award_id".to_owned(),
                anchor.clone()
            ),
            (format!("{s}.outbox"), "subject".to_owned(), anchor.clone()),
            (format!("{s}.outbox_pending"), "subject".to_owned(), anchor),
        ],
        "one call per table, the second run none"
    );
    for (i, (table, column)) in DISTRIBUTED_TABLES.iter().enumerate() {
        assert!(calls[i].0.ends_with(table) && calls[i].1 == *column);
    }
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{stub}\" CASCADE"
    )))
    .execute(store.pool())
    .await;
    common::drop_schema(&store).await;
}

/// Compile-time: `migrate` (with the Citus step) can run on a multi-threaded runtime, as
/// `idem migrate` and `idem consume` run it through `GrantDb::migrate_grants`.
#[allow(dead_code)]
fn migrate_is_send(store: &PgStore) {
    fn send<T: Send>(_: T) {}
    send(store.migrate());
}
