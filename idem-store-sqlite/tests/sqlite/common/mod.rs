//! The SQLite store under the testkit's harness: a fresh database file per test.
#![allow(unreachable_pub, dead_code)] // shared by the modules of the test binary

use async_trait::async_trait;
use idem_engine::{
    Capabilities, ClaimStore, IdempotencyKey, OutboxEvent, OutboxWriter, StoreError,
};
use idem_store_sqlite::{SqliteConfig, SqliteStore, SqliteTx};
use idem_testkit::{Effect, TestStore};
use sqlx::Row as _;

/// A store on a fresh temporary file, with an `effects` table for the harness.
#[derive(Debug, Clone)]
pub struct TestSqlite {
    pub store: SqliteStore,
    _dir: std::sync::Arc<tempfile::TempDir>,
}

pub async fn fresh() -> TestSqlite {
    open_in(tempfile::tempdir().expect("temp dir")).await
}

/// A store on a fresh file `idem.db` in `dir` (kept as long as the store).
pub async fn open_in(dir: tempfile::TempDir) -> TestSqlite {
    let path = dir.path().join("idem.db");
    let store = SqliteStore::connect(path.to_str().expect("utf-8 path"), SqliteConfig::default())
        .await
        .expect("open");
    store.migrate().await.expect("migrate");
    sqlx::query("CREATE TABLE effects (idempotency_key TEXT NOT NULL, subject TEXT NOT NULL, amount INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .expect("effects table");
    TestSqlite {
        store,
        _dir: std::sync::Arc::new(dir),
    }
}

#[async_trait]
impl ClaimStore for TestSqlite {
    type Tx = SqliteTx;

    async fn begin(&self) -> Result<SqliteTx, StoreError> {
        self.store.begin().await
    }

    fn capabilities(&self) -> Capabilities {
        self.store.capabilities()
    }

    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: idem_engine::RunNote,
    ) -> Result<Option<u32>, StoreError> {
        self.store.note_run(key, note).await
    }

    async fn probe(&self) -> Result<(), StoreError> {
        self.store.probe().await
    }
}

fn err(e: sqlx::Error) -> StoreError {
    idem_store_sqlite::map_sqlx(e, "the harness's write")
}

#[async_trait]
impl TestStore for TestSqlite {
    async fn write_effect(
        tx: &mut SqliteTx,
        key: &IdempotencyKey,
        subject: &str,
        amount: i64,
    ) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO effects (idempotency_key, subject, amount) VALUES (?, ?, ?)")
            .bind(key.to_hex())
            .bind(subject)
            .bind(amount)
            .execute(tx.conn())
            .await
            .map_err(err)?;
        Ok(())
    }

    async fn enqueue(tx: &mut SqliteTx, event: &OutboxEvent) -> Result<(), StoreError> {
        tx.enqueue(event).await
    }

    async fn enqueue_refused(tx: &mut SqliteTx, key: &IdempotencyKey) -> Result<(), StoreError> {
        // The outbox's CHECK (json_valid(payload)) refuses this: a real database error.
        let ev = OutboxEvent::new(*key, "effect.recorded", "x", b"{not json".to_vec());
        tx.enqueue(&ev).await
    }

    async fn effects(&self) -> Result<Vec<Effect>, StoreError> {
        let rows = sqlx::query("SELECT idempotency_key, subject, amount FROM effects")
            .fetch_all(self.store.pool())
            .await
            .map_err(err)?;
        rows.iter()
            .map(|r| {
                Ok(Effect {
                    key: r
                        .get::<String, _>(0)
                        .parse()
                        .map_err(|e| StoreError::other(format!("{e}"), false))?,
                    subject: r.get(1),
                    amount: r.get(2),
                })
            })
            .collect()
    }

    async fn claim_count(&self, key: &IdempotencyKey) -> Result<u64, StoreError> {
        Ok(u64::from(self.store.inspect_key(key).await?.is_some()))
    }
}
