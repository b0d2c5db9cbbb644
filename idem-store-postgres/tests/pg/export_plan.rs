//! `export_audit` at the size of real evidence: every page is an index seek, so a page
//! late in a 200,000-record window examines as many rows as the first one (no "Rows
//! Removed by Filter" proportional to its offset), under the generic plan a prepared
//! statement switches to after a few executions; and the whole window comes out once,
//! in order.

use crate::common;

use idem_store_postgres::PgStore;
use sqlx::{Connection, Row};

const N: i64 = 200_000;
/// Claims per `claimed_at` value (a batch commits its claims with one timestamp).
const TIE: i64 = 50;
const PAGE: i64 = 1000;

/// `N` claims, `TIE` per second from 2026-07-01, keys that sort apart from time.
async fn seed(store: &PgStore) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (idempotency_key, award_id, claimed_at) \
         SELECT md5(i::text) || md5((-i)::text), 'A-' || i, \
                timestamptz '2026-07-01T00:00:00Z' + (i / $2) * interval '1 second' \
         FROM generate_series(0, $1 - 1) AS i",
        store.table("processed_messages")
    )))
    .bind(N)
    .bind(TIE)
    .execute(store.pool())
    .await
    .expect("seed claims");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ANALYZE {}",
        store.table("processed_messages")
    )))
    .execute(store.pool())
    .await
    .expect("analyze");
}

/// The sum of a numeric field over every node of an `EXPLAIN (FORMAT JSON)` text.
fn sum_field(plan: &str, field: &str) -> i64 {
    plan.split(&format!("\"{field}\": "))
        .skip(1)
        .map(|s| {
            s.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse::<i64>()
                .unwrap_or(0)
        })
        .sum()
}

/// The plan of the next-page query after the record at `offset`, executed as a generic
/// plan: (rows removed by filters, rows read by scans, the plan text).
async fn page_plan(store: &PgStore, offset: i64) -> (i64, i64, String) {
    let pool = store.pool();
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT to_char(claimed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), idempotency_key \
         FROM {} ORDER BY claimed_at, idempotency_key OFFSET $1 LIMIT 1",
        store.table("processed_messages")
    )))
    .bind(offset)
    .fetch_one(pool)
    .await
    .expect("cursor");
    let (at, key): (String, String) = (row.get(0), row.get(1));
    let mut conn = pool.acquire().await.expect("connection");
    let mut tx = conn.begin().await.expect("begin");
    sqlx::query("SET LOCAL plan_cache_mode = force_generic_plan")
        .execute(&mut *tx)
        .await
        .expect("generic plans");
    let name = format!("export_page_{offset}");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "PREPARE {name}(text, text, text, bigint) AS {}",
        store.export_page_sql(false)
    )))
    .execute(&mut *tx)
    .await
    .expect("prepare");
    // EXPLAIN's column is `json`, whose wire form is its text.
    let plan: String = sqlx::query(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {name}('{at}', '{key}', '2100-01-01T00:00:00Z', {PAGE})"
    )))
    .fetch_one(&mut *tx)
    .await
    .expect("explain")
    .try_get_unchecked(0)
    .expect("plan text");
    tx.rollback().await.expect("rollback");
    let removed = sum_field(&plan, "Rows Removed by Filter");
    // Rows the scan nodes returned (the leaf under the sort).
    let scanned: i64 = plan
        .split("\"Node Type\": \"")
        .skip(1)
        .filter(|s| s.contains("Scan"))
        .map(|s| {
            let scan_node = s.split("\"Node Type\"").next().unwrap_or(s);
            sum_field(scan_node, "Actual Rows")
        })
        .max()
        .unwrap_or(0);
    (removed, scanned, plan)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_export_page_examines_no_more_rows_than_an_early_one() {
    let store = common::fresh_pg().await;
    seed(&store).await;
    let (early_removed, early_scanned, early) = page_plan(&store, PAGE).await;
    let (late_removed, late_scanned, late) = page_plan(&store, N - 10 * PAGE).await;
    for plan in [&early, &late] {
        assert!(plan.contains("Index"), "not an index scan:\n{plan}");
        assert!(!plan.contains("Seq Scan"), "a sequential scan:\n{plan}");
    }
    // A page reads its rows plus at most one tie group of the cursor's timestamp.
    for (removed, scanned, plan) in [
        (early_removed, early_scanned, &early),
        (late_removed, late_scanned, &late),
    ] {
        assert!(removed < TIE, "rows removed by filter: {removed}\n{plan}");
        assert!(
            scanned <= PAGE + TIE,
            "rows scanned for one page: {scanned}\n{plan}"
        );
    }
    assert!(
        late_removed + late_scanned <= early_removed + early_scanned + TIE,
        "late page {late_removed}+{late_scanned} vs early {early_removed}+{early_scanned}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_window_is_exported_once_in_order() {
    let store = common::fresh_pg().await;
    seed(&store).await;
    let mut last: Option<(i64, String)> = None;
    let mut n = 0i64;
    let summary = store
        .export_audit(
            "2026-07-01T00:00:00Z",
            "2026-07-02T00:00:00Z",
            PAGE as usize,
            |r| {
                let at = r.claimed_at.expect("claimed_at").unix_micros();
                let this = (at, r.key.clone());
                if let Some(prev) = &last {
                    assert!(*prev < this, "out of order: {prev:?} then {this:?}");
                }
                last = Some(this);
                n += 1;
                Ok(())
            },
        )
        .await
        .expect("export");
    assert_eq!(n, N);
    assert_eq!(summary.claims, N as u64);
    assert_eq!(summary.pages, (N / PAGE + 1) as u64);
}
