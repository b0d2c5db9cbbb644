//! Shared test setup: a fresh schema per test on the server at `IDEM_TEST_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`). A missing server fails the test.

#![allow(dead_code, unreachable_pub)]

use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use idem_engine::{
    Capabilities, ClaimStore, IdempotencyKey, OutboxEvent, OutboxWriter, StoreError,
};
use idem_store_postgres::error::map_sqlx;
use idem_store_postgres::{PartitionMonth, PgConfig, PgLayout, PgStore, PgTx};
use idem_testkit::{Effect, TestStore};
use sqlx::Row;

/// The server under test.
pub fn url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A new schema name, `idem_t_<unix seconds>_<random>`; stale ones (over an hour old)
/// are dropped by [`fresh_schema`].
pub fn schema_name() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    format!("idem_t_{secs}_{:08x}", rand::random::<u32>())
}

async fn drop_stale_schemas(store: &PgStore) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let Ok(rows) =
        sqlx::query("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idem\\_t\\_%'")
            .fetch_all(store.pool())
            .await
    else {
        return;
    };
    for row in rows {
        let name: String = row.get(0);
        let born: Option<u64> = name.split('_').nth(2).and_then(|s| s.parse().ok());
        if born.is_some_and(|b| b + 3600 < now) {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS \"{name}\" CASCADE"
            )))
            .execute(store.pool())
            .await;
        }
    }
}

/// A store on a new, empty schema (not migrated).
pub async fn bare_store(config: impl FnOnce(PgConfig) -> PgConfig) -> PgStore {
    let config = config(
        PgConfig::new(schema_name())
            .expect("valid schema")
            .with_max_connections(6),
    );
    let store = PgStore::connect(&url(), config).await.unwrap_or_else(|e| {
        panic!(
            "cannot reach the Postgres server at {} (set IDEM_TEST_POSTGRES_URL): {e}",
            url()
        )
    });
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA \"{}\"",
        store.schema()
    )))
    .execute(store.pool())
    .await
    .expect("create schema");
    store
}

/// A migrated store on a new schema, with the test `effects` table.
pub async fn fresh_pg() -> PgStore {
    fresh_pg_with(|c| c).await
}

/// Like [`fresh_pg`], with a config tweak.
pub async fn fresh_pg_with(config: impl FnOnce(PgConfig) -> PgConfig) -> PgStore {
    let store = bare_store(config).await;
    drop_stale_schemas(&store).await;
    store.migrate().await.expect("migrate");
    create_effects(&store).await;
    store
}

/// A migrated store on a new schema in the partitioned layout, with the monthly
/// partitions of 2026 (the test timestamps' year) besides the default window, and the
/// test `effects` table.
pub async fn fresh_partitioned_pg() -> PgStore {
    let store = fresh_pg_with(|c| c.with_layout(PgLayout::Partitioned)).await;
    assert_eq!(store.layout(), PgLayout::Partitioned);
    let (first, last) = (
        PartitionMonth::new(2026, 1).expect("month"),
        PartitionMonth::new(2026, 12).expect("month"),
    );
    store
        .create_partitions(first, last)
        .await
        .expect("create the partitions of 2026");
    store
}

/// A fresh partitioned [`TestPg`].
pub async fn fresh_partitioned_store() -> TestPg {
    TestPg(fresh_partitioned_pg().await)
}

/// A migrated store on a new schema in the distributed layout (`PgLayout::Distributed`:
/// the Citus-ready keys, on plain Postgres), with the test `effects` table.
pub async fn fresh_distributed_pg() -> PgStore {
    let store = fresh_pg_with(|c| c.with_layout(PgLayout::Distributed)).await;
    assert_eq!(store.layout(), PgLayout::Distributed);
    store
}

/// A fresh distributed [`TestPg`].
pub async fn fresh_distributed_store() -> TestPg {
    TestPg(fresh_distributed_pg().await)
}

/// Creates the `effects` table the [`TestStore`] writes.
pub async fn create_effects(store: &PgStore) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {} (key text NOT NULL, subject text NOT NULL, amount bigint NOT NULL)",
        store.table("effects")
    )))
    .execute(store.pool())
    .await
    .expect("create effects");
}

/// Drops the store's schema.
pub async fn drop_schema(store: &PgStore) {
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
        store.schema()
    )))
    .execute(store.pool())
    .await;
}

/// The [`TestStore`] (a newtype: both the trait and [`PgStore`] are foreign here).
#[derive(Debug, Clone)]
pub struct TestPg(pub PgStore);

/// A fresh [`TestPg`].
pub async fn fresh_store() -> TestPg {
    TestPg(fresh_pg().await)
}

#[async_trait]
impl ClaimStore for TestPg {
    type Tx = PgTx;

    async fn begin(&self) -> Result<PgTx, StoreError> {
        self.0.begin().await
    }

    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }

    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: idem_engine::RunNote,
    ) -> Result<Option<u32>, StoreError> {
        self.0.note_run(key, note).await
    }

    async fn probe(&self) -> Result<(), StoreError> {
        self.0.probe().await
    }
}

#[async_trait]
impl TestStore for TestPg {
    async fn write_effect(
        tx: &mut PgTx,
        key: &IdempotencyKey,
        subject: &str,
        amount: i64,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO {} (key, subject, amount) VALUES ($1, $2, $3)",
            tx.table("effects")
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(key.to_hex())
            .bind(subject)
            .bind(amount)
            .execute(tx.conn())
            .await
            .map_err(|e| map_sqlx(e, "write effect"))?;
        Ok(())
    }

    async fn enqueue(tx: &mut PgTx, event: &OutboxEvent) -> Result<(), StoreError> {
        OutboxWriter::enqueue(tx, event).await
    }

    /// Postgres itself refuses the row: the payload is not JSON, the column is jsonb.
    async fn enqueue_refused(tx: &mut PgTx, key: &IdempotencyKey) -> Result<(), StoreError> {
        let ev = OutboxEvent::new(*key, "effect.recorded", "refused", "this is not json {");
        let res = OutboxWriter::enqueue(tx, &ev).await;
        assert!(res.is_err(), "Postgres accepted an invalid jsonb payload");
        res
    }

    async fn effects(&self) -> Result<Vec<Effect>, StoreError> {
        let sql = format!(
            "SELECT key, subject, amount FROM {}",
            self.0.table("effects")
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(self.0.pool())
            .await
            .map_err(|e| map_sqlx(e, "read effects"))?;
        rows.into_iter()
            .map(|r| {
                let key: String = r.get(0);
                Ok(Effect {
                    key: key
                        .parse()
                        .map_err(|_| StoreError::other("bad key in effects", false))?,
                    subject: r.get(1),
                    amount: r.get(2),
                })
            })
            .collect()
    }

    async fn claim_count(&self, key: &IdempotencyKey) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE idempotency_key = $1",
            self.0.table("processed_messages")
        )))
        .bind(key.to_hex())
        .fetch_one(self.0.pool())
        .await
        .map_err(|e| map_sqlx(e, "count claims"))?;
        Ok(n.unsigned_abs())
    }
}

/// Claims `k` in a transaction of its own: commits a `Claimed`, rolls back anything else,
/// and returns the outcome.
pub async fn claim_one(
    store: &PgStore,
    k: &IdempotencyKey,
    m: &idem_engine::ClaimMeta,
) -> idem_engine::ClaimOutcome {
    use idem_engine::ClaimTx;
    let mut tx = store.begin().await.expect("begin");
    let out = tx.claim(k, m).await.expect("claim");
    if out == idem_engine::ClaimOutcome::Claimed {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    out
}
