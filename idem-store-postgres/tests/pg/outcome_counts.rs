//! The outcome tally (`idem_outcome_counts`, `migrations/0008_outcome_counts.sql`) on a
//! real server: flushes add up, two consumers flushing at once add up (and never
//! deadlock), a schema that needs quoting works, a schema without the table (not migrated
//! yet) reads as "not recorded", and `audit_stats` carries the counts of the days
//! overlapping its window.

use crate::common;

use std::sync::Arc;

use idem_engine::record::{BusinessTable, OutcomeCount, Timestamp};
use idem_engine::{IdempotencyKey, Outcome, OutcomeCountStore, OutcomeTally, RejectReason};
use idem_store_postgres::{PgConfig, PgStore};

fn c(day: &str, outcome: &str, reason: &str, n: u64) -> OutcomeCount {
    OutcomeCount::new(day, outcome, reason, n)
}

/// `(day, outcome, reason, count)` of what the store reads back.
fn rows(counts: Option<Vec<OutcomeCount>>) -> Vec<(String, String, String, u64)> {
    counts
        .expect("the outcome table exists")
        .into_iter()
        .map(|c| (c.day, c.outcome, c.reason, c.count))
        .collect()
}

fn r(day: &str, outcome: &str, reason: &str, n: u64) -> (String, String, String, u64) {
    (day.into(), outcome.into(), reason.into(), n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_add_up_across_flushes_and_are_read_by_whole_days() {
    let store = common::fresh_pg().await;
    store
        .add_outcome_counts(&[
            c("2026-07-01", "duplicate", "", 3),
            c("2026-07-01", "rejected", "not_json", 2),
        ])
        .await
        .expect("first flush");
    // The same row twice in one flush, and a row that exists: they add.
    store
        .add_outcome_counts(&[
            c("2026-07-01", "duplicate", "", 4),
            c("2026-07-02", "processed", "", 1),
            c("2026-07-01", "duplicate", "", 1),
        ])
        .await
        .expect("second flush");
    store.add_outcome_counts(&[]).await.expect("nothing");
    assert_eq!(
        rows(
            store
                .outcome_counts("2026-07-01T00:00:00Z", "2026-07-03T00:00:00Z")
                .await
                .expect("read")
        ),
        vec![
            r("2026-07-01", "duplicate", "", 8),
            r("2026-07-01", "rejected", "not_json", 2),
            r("2026-07-02", "processed", "", 1),
        ]
    );
    // Whole days overlapping the window: a window ending at midnight leaves that day out,
    // one a second later takes it in; one starting mid-day takes its day in.
    let read = |since: &'static str, until: &'static str| {
        let store = store.clone();
        async move { rows(store.outcome_counts(since, until).await.expect("read")).len() }
    };
    assert_eq!(
        read("2026-07-01T00:00:00Z", "2026-07-02T00:00:00Z").await,
        2
    );
    assert_eq!(
        read("2026-07-01T00:00:00Z", "2026-07-02T00:00:01Z").await,
        3
    );
    assert_eq!(
        read("2026-07-02T12:00:00Z", "2026-07-09T00:00:00Z").await,
        1
    );
    assert_eq!(
        read("2026-06-01T00:00:00Z", "2026-07-01T00:00:00Z").await,
        0
    );
    // A bad bound is the caller's error, not a store error.
    let err = store
        .outcome_counts("not a time", "2026-07-02T00:00:00Z")
        .await
        .expect_err("bad bound");
    assert!(
        matches!(err, idem_store_postgres::PgError::InvalidTimestamp { .. }),
        "{err:?}"
    );
    // The report's read carries them.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {} (idempotency_key text, amount bigint, subject text)",
        store.table("biz")
    )))
    .execute(store.pool())
    .await
    .expect("business table");
    let stats = store
        .audit_stats(
            "2026-07-01T00:00:00Z",
            "2026-07-02T00:00:00Z",
            &BusinessTable::new("biz", "amount", "subject").expect("table"),
            Timestamp::now(),
            0,
        )
        .await
        .expect("audit stats");
    assert_eq!(rows(stats.outcomes).len(), 2);
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_flushing_at_once_add_up() {
    let first = common::fresh_pg().await;
    // A second consumer: its own pool on the same schema.
    let second = PgStore::connect(
        &common::url(),
        PgConfig::new(first.schema())
            .expect("schema")
            .with_max_connections(4),
    )
    .await
    .expect("connect");
    let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").expect("key");
    let days = ["2026-07-01", "2026-07-02", "2026-07-03"];
    let mut tasks = Vec::new();
    for (w, store) in [first.clone(), second.clone(), first.clone(), second]
        .into_iter()
        .enumerate()
    {
        tasks.push(tokio::spawn(async move {
            let sink: Arc<dyn OutcomeCountStore> = Arc::new(store);
            let tally = OutcomeTally::new();
            for i in 0..40u32 {
                // Rows in a different order from each worker: the statement must still
                // lock them in one order.
                for (j, day) in days.iter().enumerate() {
                    let at = Timestamp::parse_rfc3339(day).expect("day");
                    let outcome = if (i as usize + j + w).is_multiple_of(2) {
                        Outcome::Duplicate {
                            key,
                            settle: Ok(()),
                        }
                    } else {
                        Outcome::Rejected {
                            reason: RejectReason::new("not_json", "x"),
                            settle: Ok(()),
                        }
                    };
                    tally.record_at(at, &outcome);
                }
                tally.flush(sink.as_ref()).await.expect("flush");
            }
            assert!(tally.is_empty());
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
    let got = rows(
        first
            .outcome_counts("2026-07-01T00:00:00Z", "2026-07-04T00:00:00Z")
            .await
            .expect("read"),
    );
    let total: u64 = got.iter().map(|r| r.3).sum();
    assert_eq!(total, 4 * 40 * 3, "{got:?}");
    assert_eq!(got.len(), 6, "{got:?}");
    common::drop_schema(&first).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_are_quoted_kept_apart_and_not_recorded_until_migrated() {
    // A schema name that only works quoted (upper case).
    let name = format!("Idem_Outcomes_{:08x}", rand::random::<u32>());
    let mixed = PgStore::connect(&common::url(), PgConfig::new(&name).expect("schema"))
        .await
        .expect("connect");
    mixed.migrate().await.expect("migrate");
    mixed
        .add_outcome_counts(&[c("2026-07-01", "conflict", "conflict", 2)])
        .await
        .expect("add");
    assert_eq!(
        rows(
            mixed
                .outcome_counts("2026-07-01T00:00:00Z", "2026-07-02T00:00:00Z")
                .await
                .expect("read")
        ),
        vec![r("2026-07-01", "conflict", "conflict", 2)]
    );

    // A schema not migrated yet: it reads as not recorded, a flush fails (and is kept),
    // and migrate creates the table.
    let other = common::bare_store(|c| c).await;
    assert_eq!(
        other
            .outcome_counts("2026-07-01T00:00:00Z", "2026-07-02T00:00:00Z")
            .await
            .expect("read"),
        None
    );
    let tally = OutcomeTally::new();
    tally.record_at(
        Timestamp::parse_rfc3339("2026-07-01").expect("day"),
        &Outcome::Rejected {
            reason: RejectReason::new("not_json", "x"),
            settle: Ok(()),
        },
    );
    assert!(tally.flush(&other).await.is_err(), "no table to write to");
    assert!(!tally.is_empty(), "kept for the next flush");
    other.migrate().await.expect("migrate");
    assert_eq!(tally.flush(&other).await.expect("flush"), 1);
    assert_eq!(
        rows(
            other
                .outcome_counts("2026-07-01T00:00:00Z", "2026-07-02T00:00:00Z")
                .await
                .expect("read")
        ),
        vec![r("2026-07-01", "rejected", "not_json", 1)],
        "its own counts, not another schema's"
    );
    // The table's name is quoted with the schema's: no other table is touched.
    assert!(mixed
        .table("idem_outcome_counts")
        .starts_with(&format!("\"{name}\".")));
    common::drop_schema(&mixed).await;
    common::drop_schema(&other).await;
}
