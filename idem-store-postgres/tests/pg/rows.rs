//! `PgTx::insert_and_enqueue`: business rows and their outbox events in one statement,
//! with and without `pg_notify` (the parameters are numbered after the outbox's own),
//! and what a refused row or malformed columns do: abort, or refuse before sending —
//! never a row without its event, nor an event without its row.

use crate::common;

use std::time::Duration;

use idem_engine::{
    ClaimStore, ClaimTx, IdempotencyKey, OutboxBatch, OutboxEvent, OutboxSource, StoreError,
};
use idem_store_postgres::{PgColumn, PgOutboxSource, PgRows, PgStore};

fn key(n: usize) -> IdempotencyKey {
    IdempotencyKey::derive(&format!("R-{n}"), "2026-07-01T09:00:00Z", b"{}").expect("key")
}

fn event(n: usize) -> OutboxEvent {
    OutboxEvent::new(
        key(n),
        "effect.recorded",
        format!("R-{n}"),
        format!("{{\"n\":{n}}}"),
    )
}

/// Effects rows for `ns`: key, subject, amount = n.
fn rows<'a>(store: &PgStore, ns: &[usize], subjects: &'a [String]) -> PgRows<'a> {
    let table = idem_engine::sql!("{schema}.effects", schema = store.schema_ident());
    PgRows::new(table)
        .column(
            "key",
            PgColumn::OwnedText(ns.iter().map(|&n| key(n).to_hex()).collect()),
        )
        .and_then(|r| {
            r.column(
                "subject",
                PgColumn::Text(subjects.iter().map(String::as_str).collect()),
            )
        })
        .and_then(|r| {
            r.column(
                "amount",
                PgColumn::Int8(ns.iter().map(|&n| i64::try_from(n).expect("n")).collect()),
            )
        })
        .expect("columns")
}

async fn effects(store: &PgStore) -> Vec<(String, String, i64)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT key, subject, amount FROM {} ORDER BY amount",
        store.table("effects")
    )))
    .fetch_all(store.pool())
    .await
    .expect("effects")
}

async fn staged(store: &PgStore) -> Vec<String> {
    let source = PgOutboxSource::new(store.clone(), Duration::from_millis(20));
    let batch = source.lease(1000).await.expect("lease");
    let ids = batch.events().iter().map(|e| e.subject.clone()).collect();
    batch.release().await.expect("release");
    ids
}

async fn rows_and_events_commit_together(store: PgStore) {
    let ns = [1, 2, 3];
    let subjects: Vec<String> = ns.iter().map(|n| format!("R-{n}")).collect();
    let mut tx = store.begin().await.expect("begin");
    tx.insert_and_enqueue(&rows(&store, &ns, &subjects), &ns.map(event))
        .await
        .expect("rows and events");
    // A second call in the same transaction: on the notifying store within its interval,
    // this one is the quiet form (one parameter fewer before the rows').
    let four = vec!["R-4".to_owned()];
    tx.insert_and_enqueue(&rows(&store, &[4], &four), &[event(4)])
        .await
        .expect("rows and events again");
    tx.commit().await.expect("commit");
    let got = effects(&store).await;
    assert_eq!(
        got,
        (1..=4)
            .map(|n| (
                key(n).to_hex(),
                format!("R-{n}"),
                i64::try_from(n).expect("n")
            ))
            .collect::<Vec<_>>()
    );
    assert_eq!(staged(&store).await, ["R-1", "R-2", "R-3", "R-4"]);
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_and_their_events_commit_in_one_statement_with_notify() {
    rows_and_events_commit_together(common::fresh_pg().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_and_their_events_commit_in_one_statement_without_notify() {
    rows_and_events_commit_together(common::fresh_pg_with(|c| c.with_notify(false)).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_and_their_events_commit_in_one_statement_on_the_partitioned_layout() {
    rows_and_events_commit_together(common::fresh_partitioned_pg().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_of_different_lengths_are_refused_before_anything_is_sent() {
    let store = common::fresh_pg().await;
    let subjects = vec!["R-1".to_owned()];
    let uneven = rows(&store, &[1, 2], &subjects);
    let mut tx = store.begin().await.expect("begin");
    let err = tx
        .insert_and_enqueue(&uneven, &[event(1), event(2)])
        .await
        .expect_err("uneven columns");
    assert!(matches!(err, StoreError::Rejected { .. }), "{err:?}");
    let none = PgRows::new(idem_engine::sql!(
        "{schema}.effects",
        schema = store.schema_ident()
    ));
    assert!(matches!(
        tx.insert_and_enqueue(&none, &[event(1)]).await,
        Err(StoreError::Rejected { .. })
    ));
    // Nothing was sent: the transaction is still good, and holds nothing.
    tx.commit().await.expect("commit");
    assert!(effects(&store).await.is_empty());
    assert!(staged(&store).await.is_empty());
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_row_aborts_the_transaction_and_stages_no_event() {
    let store = common::fresh_pg().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE UNIQUE INDEX ON {} (key)",
        store.table("effects")
    )))
    .execute(store.pool())
    .await
    .expect("unique index");
    let subjects = vec!["R-1".to_owned(), "R-1".to_owned()];
    let mut tx = store.begin().await.expect("begin");
    // The same key twice: the business table refuses the second row.
    let err = tx
        .insert_and_enqueue(&rows(&store, &[1, 1], &subjects), &[event(1)])
        .await
        .expect_err("a unique violation");
    // A constraint the input breaks: refused for good (dead-lettered), not retried.
    assert!(
        matches!(&err, StoreError::Rejected { message, .. } if message.contains("23505")),
        "{err:?}"
    );
    let commit = tx.commit().await;
    assert!(
        matches!(commit, Err(StoreError::Conflict { .. })),
        "an aborted transaction does not commit: {commit:?}"
    );
    assert!(effects(&store).await.is_empty());
    assert!(staged(&store).await.is_empty());
    common::drop_schema(&store).await;
}
