//! [`RedisLeaseStore`]: a lease-based claim store.
//!
//! # What a lease store alone guarantees
//!
//! Redis cannot hold the business write: it happens elsewhere (another database, an
//! HTTP call), *outside* the claim's transaction. So this store gives:
//!
//! - **never lost**: a worker that crashes mid-work leaves its lease behind; the lease
//!   expires after [`RedisConfig::lease`] and the redelivery claims the key and runs the
//!   work again. A rollback (or dropping the transaction) frees the key at once;
//! - **at-least-once effect**, not exactly-once: a crash after the business write and
//!   before the commit, a handler that outlives its lease, or a commit whose reply is lost
//!   lets the work run twice;
//! - **effectively once** only when the handler is idempotent itself, or always finishes
//!   (write *and* commit) within its lease — extend it with
//!   [`RedisLeaseTx::extend_lease`] for long work;
//! - **no audit evidence**: Redis may lose a done-mark (a failover, a restart without
//!   persistence, eviction, or the end of [`RedisConfig::retention`]), after which a
//!   redelivery runs again. [`Capabilities`] says so: `transactional_writes` and
//!   `durable` are false;
//! - **no conflict detection**: a lease is keyed by the idempotency key alone, so the same
//!   submission resent with another payload (a new key, the same
//!   [`ClaimMeta::identity`](idem_core::ClaimMeta::identity)) is claimed and processed
//!   again; this store never answers [`ClaimOutcome::Conflict`] and
//!   `Capabilities::detects_conflicts` is false. (A second lease on the identity could not
//!   be made to commit atomically with the key's done-mark and the business write, so it is
//!   not faked.) Use a transactional store for that guarantee.
//!
//! For exactly-once *effect*, put the claim in the business database (a transactional
//! store) and, for speed, Redis in front of it as a [`RedisFilter`](crate::RedisFilter).
//!
//! # The protocol
//! - claim: `SET {prefix}l:{key} {token} NX PX {lease} GET` — set: `Claimed`; the value
//!   already there is the done-mark: `Duplicate`; it is this transaction's own token:
//!   `Duplicate` (a key claimed twice in one transaction); anything else is another
//!   worker's live lease: `InProgress` (the `idem_engine::Gate` defers the delivery
//!   with a delayed nack, never acks it);
//! - commit: a Lua compare-and-set turns each of our leases into the done-mark, kept for
//!   the retention period (`scripts/commit.lua`);
//! - rollback, or dropping the transaction: a Lua compare-and-delete removes each lease
//!   that is still ours (`scripts/release.lua`);
//! - a batch claim is one pipelined round trip; commits and rollbacks of a batch too.
//!
//! Every token is 128 random bits, fresh for each transaction. Needs Redis 7.0 or later
//! (`SET … NX … GET`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, StoreError,
};

use crate::client::Conn;
use crate::config::RedisConfig;
use crate::error::RedisError;

const COMMIT: &str = include_str!("../scripts/commit.lua");
const RELEASE: &str = include_str!("../scripts/release.lua");
const EXTEND: &str = include_str!("../scripts/extend.lua");

/// The value of a committed key (a done-mark). A lease token never equals it.
pub(crate) const DONE_MARK: &str = "done";

/// What Redis holds for a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyState {
    /// Nothing: never claimed, rolled back, expired, or past its retention.
    Free,
    /// A live lease: a worker claimed it and has not finished.
    Leased,
    /// A done-mark: committed, within the retention period.
    Done,
}

/// A claim store on Redis leases. Clones share one connection.
///
/// See the [module documentation](self) for exactly what it guarantees — in short, on
/// its own: never lost, at least once, effectively once only for idempotent handlers or
/// handlers that finish within their lease.
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::StoreError> {
/// use idem_core::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
/// use idem_store_redis::{RedisConfig, RedisLeaseStore};
///
/// let store = RedisLeaseStore::connect(RedisConfig::new("redis://127.0.0.1:6379")).await?;
/// let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").expect("valid");
/// let mut tx = store.begin().await?;
/// if tx.claim(&key, &ClaimMeta::new("A-1")).await? == ClaimOutcome::Claimed {
///     // ... the work, within the lease ...
///     tx.commit().await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RedisLeaseStore {
    conn: Conn,
    config: Arc<RedisConfig>,
}

impl RedisLeaseStore {
    /// Connects (the server must answer within the configured timeout).
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid configuration; [`StoreError::Unavailable`]
    /// when the server cannot be reached.
    pub async fn connect(config: RedisConfig) -> Result<Self, StoreError> {
        let conn = Conn::open(&config, true).await?;
        Ok(Self {
            conn,
            config: Arc::new(config),
        })
    }

    /// As [`connect`](Self::connect), over `client`, a client the application built
    /// itself (TLS, credentials, its own timeouts); `config.url` is not used, the rest of
    /// `config` is. The server must answer a PING within `config.timeout`.
    ///
    /// ```no_run
    /// # #[cfg(feature = "redis-rs")]
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_store_redis::{redis, RedisClient, RedisConfig, RedisLeaseStore};
    /// let client = redis::Client::open("rediss://cache.internal:6380/0")?;
    /// let store = RedisLeaseStore::from_client(
    ///     RedisClient::RedisRs(client),
    ///     RedisConfig::new("unused://").with_key_prefix("grants:"),
    /// )
    /// .await?;
    /// # drop(store);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`StoreError::Config`] for invalid settings; [`StoreError::Unavailable`] when the
    /// server cannot be reached.
    pub async fn from_client(
        client: crate::RedisClient,
        config: RedisConfig,
    ) -> Result<Self, StoreError> {
        let conn = Conn::from_client(client, &config, true).await?;
        Ok(Self {
            conn,
            config: Arc::new(config),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The Redis key that holds `key`'s lease or done-mark: `{prefix}l:{64 hex}`.
    pub fn redis_key(&self, key: &IdempotencyKey) -> String {
        lease_key(&self.config.key_prefix, key)
    }

    /// What Redis holds for `key` now.
    ///
    /// # Errors
    /// When Redis cannot answer.
    pub async fn state(&self, key: &IdempotencyKey) -> Result<KeyState, StoreError> {
        let v = self
            .conn
            .get_many("read a key's state", &[self.redis_key(key)])
            .await?;
        Ok(match v.into_iter().next().flatten() {
            None => KeyState::Free,
            Some(v) if v == DONE_MARK => KeyState::Done,
            Some(_) => KeyState::Leased,
        })
    }
}

fn lease_key(prefix: &str, key: &IdempotencyKey) -> String {
    let mut s = String::with_capacity(prefix.len() + 66);
    s.push_str(prefix);
    s.push_str("l:");
    s.push_str(&key.to_hex());
    s
}

fn new_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

#[async_trait]
impl ClaimStore for RedisLeaseStore {
    type Tx = RedisLeaseTx;

    /// Opens a transaction with a fresh token. No round trip.
    async fn begin(&self) -> Result<RedisLeaseTx, StoreError> {
        Ok(RedisLeaseTx {
            conn: self.conn.clone(),
            config: self.config.clone(),
            token: new_token(),
            claimed: Vec::new(),
            finished: false,
        })
    }

    /// Not transactional (the business write is elsewhere), not durable (Redis is a
    /// cache), batch claims in one round trip.
    fn capabilities(&self) -> Capabilities {
        Capabilities::new(false, true, false)
    }
}

/// A claim transaction of a [`RedisLeaseStore`]: the leases it holds under its token.
///
/// Dropped without [`commit`](ClaimTx::commit) or [`rollback`](ClaimTx::rollback), it
/// releases its leases in the background (on the current Tokio runtime, best effort);
/// should the process die instead, they expire after the lease time.
#[derive(Debug)]
pub struct RedisLeaseTx {
    conn: Conn,
    config: Arc<RedisConfig>,
    token: String,
    claimed: Vec<(IdempotencyKey, String)>,
    finished: bool,
}

impl RedisLeaseTx {
    /// The keys this transaction has claimed.
    pub fn claimed(&self) -> impl Iterator<Item = &IdempotencyKey> {
        self.claimed.iter().map(|(k, _)| k)
    }

    /// Gives every lease of this transaction `ttl` more to live, from now, for a handler
    /// that needs longer than [`RedisConfig::lease`]. Returns whether every lease was
    /// still ours; `false` means one expired (and may be held by another worker): the work
    /// may now run twice, and the commit will refuse keys held by someone else.
    ///
    /// # Errors
    /// When Redis cannot answer (the leases are left as they were).
    pub async fn extend_lease(&mut self, ttl: Duration) -> Result<bool, StoreError> {
        let ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX).max(1);
        let keys: Vec<String> = self.claimed.iter().map(|(_, r)| r.clone()).collect();
        let out = self
            .conn
            .eval_each(
                "extend a lease",
                EXTEND,
                &keys,
                &[self.token.clone(), ms.to_string()],
            )
            .await?;
        Ok(out.iter().all(|&r| r == 1))
    }

    fn interpret(
        &mut self,
        key: &IdempotencyKey,
        rkey: String,
        old: Option<String>,
    ) -> ClaimOutcome {
        match old {
            None => {
                self.claimed.push((*key, rkey));
                ClaimOutcome::Claimed
            }
            Some(v) if v == DONE_MARK || v == self.token => ClaimOutcome::Duplicate,
            Some(_) => ClaimOutcome::InProgress,
        }
    }

    fn release_keys(&self) -> Vec<String> {
        self.claimed.iter().map(|(_, r)| r.clone()).collect()
    }
}

#[async_trait]
impl ClaimTx for RedisLeaseTx {
    /// One `SET … NX PX … GET`.
    async fn claim(
        &mut self,
        key: &IdempotencyKey,
        _meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        let rkey = lease_key(&self.config.key_prefix, key);
        let old = self
            .conn
            .set_nx_get(
                "claim a key",
                std::slice::from_ref(&rkey),
                &self.token,
                self.config.lease_ms(),
            )
            .await?;
        let old = old.into_iter().next().flatten();
        Ok(self.interpret(key, rkey, old))
    }

    /// One pipelined round trip of `SET … NX PX … GET`, one per item. A key repeated in
    /// `items` finds this transaction's own token the second time: `Duplicate`.
    async fn claim_batch(
        &mut self,
        items: &[(IdempotencyKey, ClaimMeta)],
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        let rkeys: Vec<String> = items
            .iter()
            .map(|(k, _)| lease_key(&self.config.key_prefix, k))
            .collect();
        let olds = self
            .conn
            .set_nx_get("claim keys", &rkeys, &self.token, self.config.lease_ms())
            .await?;
        Ok(items
            .iter()
            .zip(rkeys)
            .zip(olds)
            .map(|(((k, _), rkey), old)| self.interpret(k, rkey, old))
            .collect())
    }

    /// Turns every lease of this transaction into a done-mark kept for the retention
    /// period.
    ///
    /// # Errors
    /// A retryable [`StoreError::Conflict`] when a lease expired and another worker
    /// holds the key now (the other keys are committed); [`StoreError::Unavailable`] when
    /// Redis did not answer (the outcome is unknown: do not ack).
    async fn commit(mut self) -> Result<(), StoreError> {
        let keys = self.release_keys();
        let out = self
            .conn
            .eval_each(
                "commit claims",
                COMMIT,
                &keys,
                &[
                    self.token.clone(),
                    DONE_MARK.to_owned(),
                    self.config.retention_ms().to_string(),
                ],
            )
            .await?;
        self.finished = true;
        if let Some(((key, _), _)) = self.claimed.iter().zip(&out).find(|(_, &r)| r == 0) {
            return Err(RedisError::LeaseLost { key: key.short() }.into());
        }
        Ok(())
    }

    /// Deletes every lease that is still this transaction's.
    async fn rollback(mut self) -> Result<(), StoreError> {
        let keys = self.release_keys();
        let r = self
            .conn
            .eval_each("release claims", RELEASE, &keys, &[self.token.clone()])
            .await;
        // Tried once; if Redis did not answer, the leases expire by themselves.
        self.finished = true;
        r.map(|_| ()).map_err(Into::into)
    }
}

impl Drop for RedisLeaseTx {
    fn drop(&mut self) {
        if self.finished || self.claimed.is_empty() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let conn = self.conn.clone();
        let keys = self.release_keys();
        let token = std::mem::take(&mut self.token);
        rt.spawn(async move {
            if let Err(e) = conn
                .eval_each("release dropped claims", RELEASE, &keys, &[token])
                .await
            {
                tracing::debug!(target: "idem::redis", error = %e, "releasing a dropped transaction's leases failed; they will expire");
            }
        });
    }
}
