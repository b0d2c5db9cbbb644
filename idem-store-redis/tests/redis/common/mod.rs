//! Shared helpers of the integration tests: the server address, fresh key prefixes, the
//! test stores, and `per_client!`, which runs one test body once per enabled client.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use idem_engine::{
    async_trait, Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, DoneFilter, Filtered,
    FilteredTx, IdempotencyKey, OutboxEvent, StoreError,
};
use idem_store_redis::{
    ClientKind, KeyState, RedisConfig, RedisFilter, RedisLeaseStore, RedisLeaseTx,
};
use idem_testkit::{Effect, MemoryStore, MemoryTx, TestStore};

/// Runs each listed `async fn name(kind: ClientKind)` of the enclosing file once per
/// enabled client, as `fred::name` and `redis_rs::name`.
#[macro_export]
macro_rules! per_client {
    ($($name:ident),+ $(,)?) => {
        #[cfg(feature = "fred")]
        mod fred {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(idem_store_redis::ClientKind::Fred).await;
                }
            )+
        }
        #[cfg(feature = "redis-rs")]
        mod redis_rs {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(idem_store_redis::ClientKind::RedisRs).await;
                }
            )+
        }
    };
}

/// The server under test: `IDEM_TEST_REDIS_URL`, default `redis://127.0.0.1:6379`. A
/// missing server fails the tests (it is never a skip).
pub fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A key prefix no other test uses.
pub fn fresh_prefix(tag: &str) -> String {
    format!("idem-test:{tag}:{:016x}:", rand::random::<u64>())
}

/// A configuration for `kind` with a fresh prefix and a timeout generous enough for a
/// loaded 2-core machine.
pub fn config(kind: ClientKind, tag: &str) -> RedisConfig {
    RedisConfig::new(redis_url())
        .with_key_prefix(fresh_prefix(tag))
        .with_timeout(Duration::from_secs(3))
        .with_client(kind)
}

pub fn quiet_crashes() {
    static ONCE: Once = Once::new();
    ONCE.call_once(idem_testkit::fault::quiet_injected_crashes);
}

pub fn key(n: &str) -> IdempotencyKey {
    IdempotencyKey::derive(n, "2026-07-01T09:00:00Z", n.as_bytes()).expect("valid identity")
}

pub async fn lease_store_with(config: RedisConfig) -> LeaseTestStore {
    let store = RedisLeaseStore::connect(config.clone())
        .await
        .unwrap_or_else(|e| panic!("Redis at {} must be running: {e}", config.url));
    LeaseTestStore {
        store,
        effects: Arc::default(),
    }
}

pub async fn lease_store(kind: ClientKind) -> LeaseTestStore {
    lease_store_with(config(kind, "lease")).await
}

// ---------------------------------------------------------------------------------------
// The lease store under the testkit: the business write is *elsewhere* — an in-process
// list that takes effect at once, outside any transaction, exactly as a write to another
// system would.

#[derive(Debug, Clone)]
pub struct LeaseTestStore {
    pub store: RedisLeaseStore,
    pub effects: Arc<Mutex<Vec<Effect>>>,
}

#[derive(Debug)]
pub struct LeaseTestTx {
    pub tx: RedisLeaseTx,
    effects: Arc<Mutex<Vec<Effect>>>,
}

#[async_trait]
impl ClaimStore for LeaseTestStore {
    type Tx = LeaseTestTx;

    async fn begin(&self) -> Result<LeaseTestTx, StoreError> {
        Ok(LeaseTestTx {
            tx: self.store.begin().await?,
            effects: self.effects.clone(),
        })
    }

    fn capabilities(&self) -> Capabilities {
        self.store.capabilities()
    }
}

#[async_trait]
impl ClaimTx for LeaseTestTx {
    async fn claim(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        self.tx.claim(key, meta).await
    }

    async fn claim_batch(
        &mut self,
        items: &[(IdempotencyKey, ClaimMeta)],
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        self.tx.claim_batch(items).await
    }

    async fn commit(self) -> Result<(), StoreError> {
        self.tx.commit().await
    }

    async fn rollback(self) -> Result<(), StoreError> {
        self.tx.rollback().await
    }
}

#[async_trait]
impl TestStore for LeaseTestStore {
    async fn write_effect(
        tx: &mut LeaseTestTx,
        key: &IdempotencyKey,
        subject: &str,
        amount: i64,
    ) -> Result<(), StoreError> {
        tx.effects.lock().expect("effects").push(Effect {
            key: *key,
            subject: subject.to_owned(),
            amount,
        });
        Ok(())
    }

    async fn enqueue(_tx: &mut LeaseTestTx, _event: &OutboxEvent) -> Result<(), StoreError> {
        Ok(())
    }

    async fn enqueue_refused(
        _tx: &mut LeaseTestTx,
        _key: &IdempotencyKey,
    ) -> Result<(), StoreError> {
        Err(StoreError::Rejected {
            message: "outbox refused".into(),
            source: None,
        })
    }

    async fn effects(&self) -> Result<Vec<Effect>, StoreError> {
        Ok(self.effects.lock().expect("effects").clone())
    }

    async fn claim_count(&self, key: &IdempotencyKey) -> Result<u64, StoreError> {
        Ok(u64::from(self.store.state(key).await? == KeyState::Done))
    }
}

// ---------------------------------------------------------------------------------------
// Our front filter in front of the in-memory transactional store.

#[derive(Debug, Clone)]
pub struct FilteredMem(pub Filtered<MemoryStore, RedisFilter>);

impl FilteredMem {
    pub fn new(filter: RedisFilter) -> Self {
        Self(Filtered::new(MemoryStore::new(), filter))
    }
}

#[async_trait]
impl ClaimStore for FilteredMem {
    type Tx = FilteredTx<MemoryTx, RedisFilter>;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
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
}

#[async_trait]
impl TestStore for FilteredMem {
    async fn write_effect(
        tx: &mut Self::Tx,
        key: &IdempotencyKey,
        subject: &str,
        amount: i64,
    ) -> Result<(), StoreError> {
        <MemoryStore as TestStore>::write_effect(tx.inner_mut(), key, subject, amount).await
    }

    async fn enqueue(tx: &mut Self::Tx, event: &OutboxEvent) -> Result<(), StoreError> {
        <MemoryStore as TestStore>::enqueue(tx.inner_mut(), event).await
    }

    async fn enqueue_refused(tx: &mut Self::Tx, key: &IdempotencyKey) -> Result<(), StoreError> {
        <MemoryStore as TestStore>::enqueue_refused(tx.inner_mut(), key).await
    }

    async fn effects(&self) -> Result<Vec<Effect>, StoreError> {
        self.0.inner().effects().await
    }

    async fn claim_count(&self, key: &IdempotencyKey) -> Result<u64, StoreError> {
        TestStore::claim_count(self.0.inner(), key).await
    }
}

// ---------------------------------------------------------------------------------------
// The NAIVE filter this crate exists to avoid: it marks a key done in Redis at claim time,
// *before* the durable commit.

#[derive(Debug, Clone)]
pub struct NaiveFiltered {
    pub store: MemoryStore,
    pub filter: RedisFilter,
}

#[derive(Debug)]
pub struct NaiveTx {
    inner: MemoryTx,
    filter: RedisFilter,
}

#[async_trait]
impl ClaimStore for NaiveFiltered {
    type Tx = NaiveTx;

    async fn begin(&self) -> Result<NaiveTx, StoreError> {
        Ok(NaiveTx {
            inner: self.store.begin().await?,
            filter: self.filter.clone(),
        })
    }

    fn capabilities(&self) -> Capabilities {
        self.store.capabilities()
    }
}

#[async_trait]
impl ClaimTx for NaiveTx {
    async fn claim(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        let keys = std::slice::from_ref(key);
        if self.filter.seen(keys).await.map(|v| v[0]).unwrap_or(false) {
            return Ok(ClaimOutcome::Duplicate);
        }
        // The mistake: "SET NX before the work".
        let _ = self.filter.mark_done(keys).await;
        self.inner.claim(key, meta).await
    }

    async fn commit(self) -> Result<(), StoreError> {
        self.inner.commit().await
    }

    async fn rollback(self) -> Result<(), StoreError> {
        self.inner.rollback().await
    }
}

#[async_trait]
impl TestStore for NaiveFiltered {
    async fn write_effect(
        tx: &mut NaiveTx,
        key: &IdempotencyKey,
        subject: &str,
        amount: i64,
    ) -> Result<(), StoreError> {
        <MemoryStore as TestStore>::write_effect(&mut tx.inner, key, subject, amount).await
    }

    async fn enqueue(tx: &mut NaiveTx, event: &OutboxEvent) -> Result<(), StoreError> {
        <MemoryStore as TestStore>::enqueue(&mut tx.inner, event).await
    }

    async fn enqueue_refused(tx: &mut NaiveTx, key: &IdempotencyKey) -> Result<(), StoreError> {
        <MemoryStore as TestStore>::enqueue_refused(&mut tx.inner, key).await
    }

    async fn effects(&self) -> Result<Vec<Effect>, StoreError> {
        self.store.effects().await
    }

    async fn claim_count(&self, key: &IdempotencyKey) -> Result<u64, StoreError> {
        TestStore::claim_count(&self.store, key).await
    }
}
