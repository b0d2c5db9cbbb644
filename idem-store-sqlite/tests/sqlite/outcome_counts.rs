//! The outcome tally (`idem_outcome_counts`, `migrations/0003_outcome_counts.sql`):
//! flushes add up, two consumers (two pools on one file) flushing at once add up, days
//! are read by whole days overlapping the window, and a database without the table (not
//! migrated yet) reads as "not recorded" until `migrate` creates it.

use crate::common;

use std::sync::Arc;

use idem_engine::record::{OutcomeCount, Timestamp};
use idem_engine::{IdempotencyKey, Outcome, OutcomeCountStore, OutcomeTally, RejectReason};
use idem_store_sqlite::{SqliteConfig, SqliteStore};

fn c(day: &str, outcome: &str, reason: &str, n: u64) -> OutcomeCount {
    OutcomeCount::new(day, outcome, reason, n)
}

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

#[tokio::test]
async fn counts_add_up_across_flushes_and_are_read_by_whole_days() {
    let t = common::fresh().await;
    let store = &t.store;
    store
        .add_outcome_counts(&[
            c("2026-07-01", "duplicate", "", 3),
            c("2026-07-01", "rejected", "not_json", 2),
        ])
        .await
        .expect("first flush");
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
                .outcome_counts("2026-07-01", "2026-07-03")
                .await
                .expect("read")
        ),
        vec![
            r("2026-07-01", "duplicate", "", 8),
            r("2026-07-01", "rejected", "not_json", 2),
            r("2026-07-02", "processed", "", 1),
        ]
    );
    let read = |since: &'static str, until: &'static str| async move {
        rows(store.outcome_counts(since, until).await.expect("read")).len()
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
    // Offsets are UTC days: 01:00+02:00 on the 2nd is the 1st, 23:00 UTC.
    assert_eq!(
        read("2026-07-02T01:00:00+02:00", "2026-07-02T00:30:00Z").await,
        3
    );
    assert_eq!(
        read("2026-07-02T03:00:00+02:00", "2026-07-02T04:00:00+02:00").await,
        1
    );
    assert!(store
        .outcome_counts("yesterday", "2026-07-02")
        .await
        .is_err());
    // Days keep one form (they sort as text).
    assert!(store
        .add_outcome_counts(&[c("2026-7-1", "duplicate", "", 1)])
        .await
        .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_flushing_at_once_add_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("idem.db");
    let path = path.to_str().expect("utf-8");
    let first = SqliteStore::connect(path, SqliteConfig::default())
        .await
        .expect("open");
    first.migrate().await.expect("migrate");
    let second = SqliteStore::connect(path, SqliteConfig::default())
        .await
        .expect("open again");
    let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").expect("key");
    let mut tasks = Vec::new();
    for (w, store) in [first.clone(), second.clone(), first.clone(), second]
        .into_iter()
        .enumerate()
    {
        tasks.push(tokio::spawn(async move {
            let sink: Arc<dyn OutcomeCountStore> = Arc::new(store);
            let tally = OutcomeTally::new();
            for i in 0..30usize {
                for (j, day) in ["2026-07-01", "2026-07-02", "2026-07-03"]
                    .iter()
                    .enumerate()
                {
                    let at = Timestamp::parse_rfc3339(day).expect("day");
                    let outcome = if (i + j + w).is_multiple_of(2) {
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
                // A busy database is a failed flush whose counts are kept: retry.
                while tally.flush(sink.as_ref()).await.is_err() {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("worker");
    }
    let got = rows(
        first
            .outcome_counts("2026-07-01", "2026-07-04")
            .await
            .expect("read"),
    );
    assert_eq!(got.iter().map(|r| r.3).sum::<u64>(), 4 * 30 * 3, "{got:?}");
    assert_eq!(got.len(), 6, "{got:?}");
}

#[tokio::test]
async fn a_database_not_migrated_yet_records_nothing_until_migrated() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("new.db");
    let store = &SqliteStore::connect(path.to_str().expect("utf-8"), SqliteConfig::default())
        .await
        .expect("open");
    assert_eq!(
        store
            .outcome_counts("2026-07-01", "2026-07-02")
            .await
            .expect("read"),
        None,
        "not recorded"
    );
    let tally = OutcomeTally::new();
    tally.record_at(
        Timestamp::parse_rfc3339("2026-07-01").expect("day"),
        &Outcome::Rejected {
            reason: RejectReason::new("too_large", "x"),
            settle: Ok(()),
        },
    );
    assert!(tally.flush(store).await.is_err(), "no table yet");
    assert!(!tally.is_empty(), "kept");
    store.migrate().await.expect("migrate");
    store.migrate().await.expect("idempotent");
    assert_eq!(tally.flush(store).await.expect("flush"), 1);
    assert_eq!(
        rows(
            store
                .outcome_counts("2026-07-01", "2026-07-02")
                .await
                .expect("read")
        ),
        vec![r("2026-07-01", "rejected", "too_large", 1)]
    );
}
