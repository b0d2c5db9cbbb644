//! The partitioned layout on the real server: claims are filed by the month of their
//! submission timestamp, a redelivery meets its first claim whatever the partitions did in
//! between, and purge drops whole old partitions (fast, never below the floor, never a
//! partition holding a claim made after the cutoff).

use crate::common;

use std::time::{Duration, Instant};

use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
use idem_store_postgres::{PartitionMonth, PgError, PgLayout, PgStore, PurgeOptions};

const DAY: u64 = 86_400;

fn month(year: i32, m: u32) -> PartitionMonth {
    PartitionMonth::new(year, m).expect("month")
}

fn meta(subject: &str, ts: &str) -> ClaimMeta {
    ClaimMeta::new(subject).with_submission_timestamp(ts)
}

fn key(subject: &str, ts: &str) -> IdempotencyKey {
    IdempotencyKey::derive(subject, ts, b"{}").expect("key")
}

async fn claim(store: &PgStore, subject: &str, ts: &str) -> ClaimOutcome {
    let mut tx = store.begin().await.expect("begin");
    let outcome = tx
        .claim(&key(subject, ts), &meta(subject, ts))
        .await
        .expect("claim");
    if outcome == ClaimOutcome::Claimed {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    outcome
}

/// The partition holding `subject`'s claim.
async fn partition_of(store: &PgStore, subject: &str) -> String {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT tableoid::regclass::text FROM {} WHERE award_id = $1",
        store.table("processed_messages")
    )))
    .bind(subject)
    .fetch_one(store.pool())
    .await
    .expect("find the claim")
}

async fn count(store: &PgStore, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        store.table(table)
    )))
    .fetch_one(store.pool())
    .await
    .expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_filed_by_submission_month_and_redeliveries_meet_them() {
    let store = common::fresh_partitioned_pg().await;
    assert_eq!(
        claim(&store, "A-1", "2026-07-01T09:00:00Z").await,
        ClaimOutcome::Claimed
    );
    assert!(
        partition_of(&store, "A-1")
            .await
            .ends_with("processed_messages_p202607"),
        "filed in {}",
        partition_of(&store, "A-1").await
    );
    // A timestamp that does not parse goes to the default partition, and dedups there.
    assert_eq!(
        claim(&store, "A-2", "last tuesday").await,
        ClaimOutcome::Claimed
    );
    assert!(partition_of(&store, "A-2")
        .await
        .ends_with("processed_messages_default"));
    assert_eq!(
        claim(&store, "A-2", "last tuesday").await,
        ClaimOutcome::Duplicate
    );
    // A redelivery, claimed later: the same month, the same partition, a duplicate.
    assert_eq!(
        claim(&store, "A-1", "2026-07-01T09:00:00Z").await,
        ClaimOutcome::Duplicate
    );

    // A month without a partition: the claim goes to the default partition; creating the
    // month's partition later moves it there, and the redelivery still meets it.
    let far = "2031-05-20T10:00:00+02:00";
    assert_eq!(claim(&store, "A-3", far).await, ClaimOutcome::Claimed);
    assert!(partition_of(&store, "A-3")
        .await
        .ends_with("processed_messages_default"));
    let created = store
        .create_partitions(month(2031, 5), month(2031, 5))
        .await
        .expect("create a partition over rows of the default one");
    assert_eq!(created, vec!["processed_messages_p203105".to_owned()]);
    assert!(partition_of(&store, "A-3")
        .await
        .ends_with("processed_messages_p203105"));
    assert_eq!(claim(&store, "A-3", far).await, ClaimOutcome::Duplicate);
    assert_eq!(count(&store, "processed_messages").await, 3);

    // Batch claims file each key under its own month, and dedup across the batch.
    let mut tx = store.begin().await.expect("begin");
    let items = vec![
        (
            key("A-1", "2026-07-01T09:00:00Z"),
            meta("A-1", "2026-07-01T09:00:00Z"),
        ),
        (
            key("B-1", "2026-03-05T00:00:00Z"),
            meta("B-1", "2026-03-05T00:00:00Z"),
        ),
        (key("B-2", "garbage"), meta("B-2", "garbage")),
        (
            key("B-1", "2026-03-05T00:00:00Z"),
            meta("B-1", "2026-03-05T00:00:00Z"),
        ),
    ];
    let outcomes = tx.claim_batch(&items).await.expect("batch");
    assert_eq!(
        outcomes,
        vec![
            ClaimOutcome::Duplicate,
            ClaimOutcome::Claimed,
            ClaimOutcome::Claimed,
            ClaimOutcome::Duplicate
        ]
    );
    tx.commit().await.expect("commit");
    assert!(partition_of(&store, "B-1")
        .await
        .ends_with("processed_messages_p202603"));

    // Migrating again is a no-op; a plain-layout schema is not converted by asking.
    store.migrate().await.expect("migrate again");
    let plain = common::fresh_pg().await;
    let again = PgStore::connect(
        &common::url(),
        plain.config().clone().with_layout(PgLayout::Partitioned),
    )
    .await
    .expect("connect");
    assert_eq!(again.layout(), PgLayout::Plain, "the table's layout wins");
    let err = again
        .migrate()
        .await
        .expect_err("plain table, partitioned asked");
    assert!(err.to_string().contains("plain table"), "{err}");
    common::drop_schema(&plain).await;
    common::drop_schema(&store).await;
}

/// Fills the partitions of `months` with `per_month` claims each, claimed in that month
/// (one statement per month, `generate_series`).
async fn fill(store: &PgStore, months: &[PartitionMonth], per_month: i64) {
    for m in months {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (idempotency_key, award_id, claimed_at, submission_month) \
             SELECT md5($1 || g::text) || md5(g::text), 'OLD-' || g, $2::date + interval '1 day', $2::date \
             FROM generate_series(1, $3) g",
            store.table("processed_messages")
        )))
        .bind(m.to_string())
        .bind(m.first_day())
        .bind(per_month)
        .execute(store.pool())
        .await
        .expect("fill a partition");
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ANALYZE {}",
        store.table("processed_messages")
    )))
    .execute(store.pool())
    .await
    .expect("analyze");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_drops_old_partitions_whole_and_keeps_recent_rows() {
    let store = common::fresh_partitioned_pg().await;
    store.migrate_append_only().await.expect("append-only");
    let old: Vec<PartitionMonth> = (1..=6).map(|m| month(2021, m)).collect();
    store
        .create_partitions(old[0], old[5])
        .await
        .expect("old partitions");
    fill(&store, &old, 100_000).await;
    // Recent claims, through the store.
    for i in 0..20 {
        let subject = format!("NEW-{i}");
        assert_eq!(
            claim(&store, &subject, "2026-07-01T09:00:00Z").await,
            ClaimOutcome::Claimed
        );
    }
    // A late message with an old timestamp, claimed now: its partition must stay.
    assert_eq!(
        claim(&store, "LATE-1", "2021-03-10T08:00:00Z").await,
        ClaimOutcome::Claimed
    );
    // Default partition: one old row (unparsable timestamp), one recent.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (idempotency_key, award_id, claimed_at, submission_month) VALUES \
         ('old-unparsed', 'U-OLD', now() - interval '5 years', '-infinity'), \
         ('new-unparsed', 'U-NEW', now(), '-infinity')",
        store.table("processed_messages")
    )))
    .execute(store.pool())
    .await
    .expect("default rows");
    let before = count(&store, "processed_messages").await;
    assert_eq!(before, 600_000 + 20 + 1 + 2);

    let opts = PurgeOptions::new(Duration::from_secs(3 * 366 * DAY));
    let dry = store
        .purge(&opts.clone().dry_run(true), |_| {})
        .await
        .expect("dry run");
    assert_eq!(dry.partitions_dropped.len(), 5, "{dry:?}");
    assert_eq!(
        count(&store, "processed_messages").await,
        before,
        "a dry run dropped rows"
    );

    let started = Instant::now();
    let report = store.purge(&opts, |_| {}).await.expect("purge");
    let elapsed = started.elapsed();
    eprintln!("purge of 500,000 rows in 5 partitions: {elapsed:?} ({report:?})");
    let expected: Vec<String> = [1, 2, 4, 5, 6]
        .iter()
        .map(|&m| month(2021, m).partition_name())
        .collect();
    assert_eq!(report.partitions_dropped, expected);
    assert_eq!(
        report.partitions_kept,
        vec![month(2021, 3).partition_name()]
    );
    assert!(
        report.partition_rows_estimate >= 400_000,
        "estimate {}",
        report.partition_rows_estimate
    );
    assert_eq!(
        report.dedup_records, 1,
        "only the old default-partition row goes row by row"
    );
    assert!(
        elapsed < Duration::from_secs(1),
        "dropping partitions took {elapsed:?}: it must not depend on their size"
    );

    // The partitions are gone from the catalog; what is left is the kept month, the
    // recent rows and the recent default-partition row.
    let left = store.partitions().await.expect("partitions");
    for name in &expected {
        assert!(
            !left.iter().any(|m| &m.partition_name() == name),
            "{name} still attached"
        );
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(store.table(name))
            .fetch_one(store.pool())
            .await
            .expect("regclass");
        assert!(!exists, "{name} detached but not dropped");
    }
    assert!(left.contains(&month(2021, 3)));
    assert_eq!(
        count(&store, "processed_messages").await,
        100_000 + 1 + 20 + 1,
        "rows other than the dropped partitions' were touched"
    );
    for i in 0..20 {
        let subject = format!("NEW-{i}");
        assert_eq!(
            claim(&store, &subject, "2026-07-01T09:00:00Z").await,
            ClaimOutcome::Duplicate,
            "a recent claim was purged"
        );
    }
    assert_eq!(
        claim(&store, "LATE-1", "2021-03-10T08:00:00Z").await,
        ClaimOutcome::Duplicate
    );
    let unparsed: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT award_id FROM {} ORDER BY 1",
        store.table("processed_messages_default")
    )))
    .fetch_all(store.pool())
    .await
    .expect("default rows");
    assert_eq!(unparsed, vec!["U-NEW".to_owned()]);
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_of_partitions_below_the_floor_is_refused() {
    let store = common::fresh_partitioned_pg().await;
    let old: Vec<PartitionMonth> = (1..=2).map(|m| month(2021, m)).collect();
    store
        .create_partitions(old[0], old[1])
        .await
        .expect("old partitions");
    fill(&store, &old, 1_000).await;
    let before = store.partitions().await.expect("partitions");
    for opts in [
        PurgeOptions::new(Duration::from_secs(7 * DAY)),
        PurgeOptions::new(Duration::from_secs(7 * DAY)).dry_run(true),
        PurgeOptions::new(Duration::from_secs(2 * 365 * DAY)),
    ] {
        let err = store
            .purge(&opts, |_| {})
            .await
            .expect_err("below the floor");
        assert!(
            matches!(err, PgError::BelowRetentionFloor { .. }),
            "got {err:?}"
        );
    }
    assert_eq!(
        store.partitions().await.expect("partitions"),
        before,
        "a refused purge dropped a partition"
    );
    assert_eq!(count(&store, "processed_messages").await, 2_000);
    // The same cutoff, explicitly allowed, drops them.
    let report = store
        .purge(
            &PurgeOptions::new(Duration::from_secs(7 * DAY)).allow_below_floor(true),
            |_| {},
        )
        .await
        .expect("allowed");
    assert!(report.partitions_dropped.contains(&old[0].partition_name()));
    assert_eq!(count(&store, "processed_messages").await, 0);
    common::drop_schema(&store).await;
}
