//! The store's DDL and bookkeeping at the edges of what the server does: a claim moved out
//! of the default partition keeps every column (its identity included); `migrate` on a
//! migrated schema takes no lock, and on one needing DDL gives up within its lock timeout
//! instead of queueing the claim writers behind an open transaction; the append-only guard
//! covers every partition; a tally flush whose result was unknown is not counted twice.

use crate::common;

use std::time::{Duration, Instant};

use idem_engine::record::OutcomeCount;
use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
use idem_engine::{GateObserver, Outcome, OutcomeTally, RejectReason};
use idem_store_postgres::APPEND_ONLY_SQLSTATE;
use idem_store_postgres::{error::sqlstate, PartitionMonth, PgStore, PurgeOptions};
use sqlx::{Connection, PgConnection};

fn month(year: i32, m: u32) -> PartitionMonth {
    PartitionMonth::new(year, m).expect("month")
}

fn key(subject: &str, ts: &str, payload: &str) -> IdempotencyKey {
    IdempotencyKey::derive(subject, ts, payload.as_bytes()).expect("key")
}

fn meta(subject: &str, ts: &str) -> ClaimMeta {
    ClaimMeta::new(subject).with_submission_timestamp(ts)
}

/// Claims `key` and commits when claimed; the outcome.
async fn claim(store: &PgStore, key: &IdempotencyKey, meta: &ClaimMeta) -> ClaimOutcome {
    let mut tx = store.begin().await.expect("begin");
    let outcome = tx.claim(key, meta).await.expect("claim");
    if outcome == ClaimOutcome::Claimed {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    outcome
}

/// A connection of its own (not the store's pool).
async fn connect() -> PgConnection {
    PgConnection::connect(&common::url())
        .await
        .expect("connect")
}

/// A transaction left open, idle, after reading `table`: it holds an ACCESS SHARE lock
/// on it until dropped.
async fn idle_reader(store: &PgStore, table: &str) -> PgConnection {
    let mut c = connect().await;
    sqlx::query("BEGIN").execute(&mut c).await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        store.table(table)
    )))
    .execute(&mut c)
    .await
    .expect("read");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_moved_out_of_the_default_partition_keeps_its_identity() {
    let store = common::fresh_partitioned_pg().await;
    let ts = "2031-05-20T10:00:00+02:00";
    let first = key("A-1", ts, "{\"amount_cents\":100}");
    assert_eq!(
        claim(&store, &first, &meta("A-1", ts)).await,
        ClaimOutcome::Claimed
    );
    let pm = store.table("processed_messages");
    let read = format!(
        "SELECT tableoid::regclass::text, submission_timestamp, claimed_at::text \
         FROM {pm} WHERE idempotency_key = $1"
    );
    let before: (String, Option<String>, String) =
        sqlx::query_as(sqlx::AssertSqlSafe(read.clone()))
            .bind(first.to_hex())
            .fetch_one(store.pool())
            .await
            .expect("the claim");
    assert!(
        before.0.ends_with("processed_messages_default"),
        "{before:?}"
    );
    assert_eq!(before.1.as_deref(), Some(ts), "claimed with its identity");

    let created = store
        .create_partitions(month(2031, 5), month(2031, 5))
        .await
        .expect("create the month's partition over a row of the default one");
    assert_eq!(created, vec!["processed_messages_p203105".to_owned()]);
    let after: (String, Option<String>, String) = sqlx::query_as(sqlx::AssertSqlSafe(read))
        .bind(first.to_hex())
        .fetch_one(store.pool())
        .await
        .expect("the moved claim");
    assert!(after.0.ends_with("processed_messages_p203105"), "{after:?}");
    assert_eq!(
        after.1.as_deref(),
        Some(ts),
        "the identity moved with the row"
    );
    assert_eq!(after.2, before.2, "claimed_at moved unchanged");

    // A conflicting resubmission (same award and timestamp, another payload) meets it.
    let other = key("A-1", ts, "{\"amount_cents\":9999}");
    assert_eq!(
        claim(&store, &other, &meta("A-1", ts)).await,
        ClaimOutcome::Conflict { existing: first }
    );
    assert_eq!(
        claim(&store, &first, &meta("A-1", ts)).await,
        ClaimOutcome::Duplicate
    );
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_on_a_migrated_schema_takes_no_lock_beside_an_open_transaction() {
    let store = common::fresh_pg().await;
    let reader = idle_reader(&store, "processed_messages").await;
    let outbox_reader = idle_reader(&store, "outbox").await;

    let started = Instant::now();
    let migrate = {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let k = key("M-1", "2026-07-01T09:00:00Z", "{}");
    let claimed = tokio::time::timeout(
        Duration::from_secs(3),
        claim(&store, &k, &meta("M-1", "2026-07-01T09:00:00Z")),
    )
    .await
    .expect("a claim commits while migrate runs beside an open transaction");
    assert_eq!(claimed, ClaimOutcome::Claimed);
    tokio::time::timeout(Duration::from_secs(3), migrate)
        .await
        .expect("migrate of a migrated schema does not wait for the open transaction")
        .expect("join")
        .expect("migrate");
    assert!(started.elapsed() < Duration::from_secs(3));
    // And so does the append-only step, once applied.
    drop((reader, outbox_reader));
    store.migrate_append_only().await.expect("append-only");
    let reader = idle_reader(&store, "processed_messages").await;
    tokio::time::timeout(Duration::from_secs(3), store.migrate_append_only())
        .await
        .expect("append-only of a guarded table does not wait for the open transaction")
        .expect("append-only");
    drop(reader);
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_needing_ddl_gives_up_within_its_lock_timeout_and_never_blocks_writers_longer() {
    // Claims that wait for their lock as long as it takes, to measure the wait.
    let store = common::fresh_pg_with(|c| c.with_lock_timeout(Some(Duration::from_secs(60)))).await;
    // Something a migration creates is missing: the script must run, and it locks
    // processed_messages.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP INDEX {}",
        store.table("outbox_moved_aside_idx")
    )))
    .execute(store.pool())
    .await
    .expect("drop an index");
    let reader = idle_reader(&store, "processed_messages").await;

    let started = Instant::now();
    let migrate = {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    // Writers during the migration: each waits at most about one lock timeout.
    let mut longest = Duration::ZERO;
    let mut n = 0;
    while !migrate.is_finished() && started.elapsed() < Duration::from_secs(40) {
        n += 1;
        let subject = format!("W-{n}");
        let k = key(&subject, "2026-07-01T09:00:00Z", "{}");
        let t = Instant::now();
        let outcome = tokio::time::timeout(
            Duration::from_secs(30),
            claim(&store, &k, &meta(&subject, "2026-07-01T09:00:00Z")),
        )
        .await
        .expect("a writer is never queued for long behind the migration");
        assert_eq!(outcome, ClaimOutcome::Claimed);
        longest = longest.max(t.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let err = tokio::time::timeout(Duration::from_secs(5), migrate)
        .await
        .expect("migrate gives up within its bound instead of hanging")
        .expect("join")
        .expect_err("the DDL cannot get its lock while the reader stays open");
    let msg = err.to_string();
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "{:?}",
        started.elapsed()
    );
    assert!(msg.contains("55P03"), "names the SQLSTATE: {msg}");
    assert!(msg.contains("processed_messages"), "names the table: {msg}");
    assert!(
        msg.contains("idle in transaction"),
        "names the blocker: {msg}"
    );
    assert!(n >= 2, "writers ran during the migration ({n})");
    assert!(
        longest < Duration::from_secs(5),
        "a writer waited {longest:?} behind the migration"
    );

    // Once the reader ends, the same migrate succeeds and recreates what was missing.
    drop(reader);
    store.migrate().await.expect("migrate");
    let back: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(store.table("outbox_moved_aside_idx"))
        .fetch_one(store.pool())
        .await
        .expect("look up");
    assert!(back);
    common::drop_schema(&store).await;
}

async fn refused(store: &PgStore, sql: &str) {
    let err = sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(store.pool())
        .await
        .expect_err(&format!("{sql} must be refused"));
    assert_eq!(
        sqlstate(&err).as_deref(),
        Some(APPEND_ONLY_SQLSTATE),
        "{sql}: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_append_only_guard_covers_every_partition_and_purge_still_works() {
    let store = common::fresh_partitioned_pg().await;
    store.migrate_append_only().await.expect("append-only");
    // A partition created after the guard.
    store
        .create_partitions(month(2031, 1), month(2031, 1))
        .await
        .expect("a later partition");
    let ts = "2026-07-01T09:00:00Z";
    let later = "2031-01-10T09:00:00Z";
    for (subject, t) in [("A-1", ts), ("A-2", "last tuesday"), ("A-3", later)] {
        assert_eq!(
            claim(&store, &key(subject, t, "{}"), &meta(subject, t)).await,
            ClaimOutcome::Claimed
        );
    }
    // A row in the default partition whose month gets its partition later: moved, and
    // its new partition is guarded too.
    let moved = "2032-03-01T09:00:00Z";
    assert_eq!(
        claim(&store, &key("A-4", moved, "{}"), &meta("A-4", moved)).await,
        ClaimOutcome::Claimed
    );
    store
        .create_partitions(month(2032, 3), month(2032, 3))
        .await
        .expect("a partition over a row of the default one, under the guard");
    for part in [
        "processed_messages_default",
        "processed_messages_p202607",
        "processed_messages_p203101",
        "processed_messages_p203203",
    ] {
        let t = store.table(part);
        refused(&store, &format!("TRUNCATE {t}")).await;
        refused(&store, &format!("DELETE FROM {t}")).await;
        refused(&store, &format!("UPDATE {t} SET award_id = 'X'")).await;
    }
    refused(
        &store,
        &format!("TRUNCATE {}", store.table("processed_messages")),
    )
    .await;
    let pm = store.table("processed_messages");
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {pm}")))
        .fetch_one(store.pool())
        .await
        .expect("count");
    assert_eq!(n, 4, "nothing was removed");
    // The guard is idempotent, and a second run changes nothing.
    store.migrate_append_only().await.expect("idempotent");

    // Retention still removes what is old.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let opts = PurgeOptions::new(Duration::ZERO)
        .allow_below_floor(true)
        .with_batch_size(1);
    store.purge(&opts, |_| {}).await.expect("purge");
    common::drop_schema(&store).await;
}

fn rejected() -> Outcome {
    Outcome::Rejected {
        reason: RejectReason::new("not_json", "x"),
        settle: Ok(()),
    }
}

async fn not_json_today(store: &PgStore) -> u64 {
    let today = idem_engine::record::Timestamp::now().day();
    let counts: Vec<OutcomeCount> = store
        .outcome_counts(&today, "infinity")
        .await
        .expect("read")
        .expect("table");
    counts
        .iter()
        .filter(|c| c.outcome == "rejected" && c.reason == "not_json")
        .map(|c| c.count)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_dropped_while_it_waited_is_not_counted_twice() {
    let store = common::fresh_pg().await;
    let tally = OutcomeTally::new();
    tally.outcome(&rejected());
    assert_eq!(tally.flush(&store).await.expect("first flush"), 1);
    assert_eq!(not_json_today(&store).await, 1);

    // Another transaction holds the tally's row: the next flush waits on it, and is
    // dropped by the caller's timeout (its counts kept for the next flush).
    let mut holder = connect().await;
    sqlx::query("BEGIN")
        .execute(&mut holder)
        .await
        .expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET count = count WHERE outcome = 'rejected'",
        store.table("idem_outcome_counts")
    )))
    .execute(&mut holder)
    .await
    .expect("hold the row");
    tally.outcome(&rejected());
    tally.outcome(&rejected());
    assert!(
        tokio::time::timeout(Duration::from_millis(800), tally.flush(&store))
            .await
            .is_err(),
        "the flush waits for the row"
    );
    // The holder ends: whatever the dropped flush's statement does on the server now, the
    // next flush writes its counts once.
    sqlx::query("COMMIT")
        .execute(&mut holder)
        .await
        .expect("commit");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut tries = 0;
    while tally.flush(&store).await.is_err() {
        tries += 1;
        assert!(tries < 20, "the flush succeeds once the row is free");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(tally.is_empty());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(not_json_today(&store).await, 3, "counted once");
    common::drop_schema(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_flush_applied_twice_adds_once() {
    use idem_engine::tally::FlushId;
    use idem_engine::OutcomeCountStore;
    let store = common::fresh_pg().await;
    let sink: &dyn OutcomeCountStore = &store;
    let today = idem_engine::record::Timestamp::now().day();
    let counts = [OutcomeCount::new(today, "rejected", "not_json", 2)];
    let id = FlushId::new("c".repeat(32), 1);
    sink.add_outcome_counts(&id, &counts).await.expect("flush");
    sink.add_outcome_counts(&id, &counts).await.expect("again");
    assert_eq!(not_json_today(&store).await, 2, "added once");
    sink.add_outcome_counts(&FlushId::new("c".repeat(32), 2), &counts)
        .await
        .expect("the next flush");
    assert_eq!(not_json_today(&store).await, 4);
    common::drop_schema(&store).await;
}
