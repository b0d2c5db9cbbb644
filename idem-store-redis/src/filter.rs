//! [`RedisFilter`]: a front filter of committed keys, in front of a durable store.

use std::sync::Arc;

use async_trait::async_trait;
use idem_core::{DoneFilter, IdempotencyKey, StoreError};

use crate::client::Conn;
use crate::config::RedisConfig;
use crate::store::DONE_MARK;

/// A [`DoneFilter`] on Redis: put it in front of a durable store with
/// [`idem_core::Filtered`].
///
/// ```no_run
/// # async fn demo<S: idem_core::ClaimStore>(durable_store: S) -> Result<(), idem_core::StoreError> {
/// use idem_store_redis::{RedisConfig, RedisFilter};
///
/// let filter = RedisFilter::connect(RedisConfig::new("redis://127.0.0.1:6379")).await?;
/// let store = idem_core::Filtered::new(durable_store, filter);
/// // ... Gate::new(store, handler) ...; store.stats().hits() counts the filter's answers.
/// # Ok(()) }
/// ```
///
/// - [`seen`](DoneFilter::seen) is one round trip for the whole slice (`MGET` on one
///   server, pipelined `GET`s on a cluster), bounded by [`RedisConfig::timeout`]; a miss,
///   an error or a timeout falls through to the durable claim (the wrapper treats an
///   error as "not seen").
/// - [`mark_done`](DoneFilter::mark_done) is one pipelined round trip of
///   `SET {prefix}f:{key} done PX {retention}`. [`idem_core::Filtered`] calls it only
///   *after* the durable commit, so Redis never says "done" for a key whose work could
///   still be lost.
/// - Redis losing marks (a restart, eviction, the end of the retention) only costs
///   speed: the durable store still answers `Duplicate`.
///
/// Clones share one connection.
#[derive(Debug, Clone)]
pub struct RedisFilter {
    conn: Conn,
    config: Arc<RedisConfig>,
}

impl RedisFilter {
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

    /// A filter that does not wait for the server: it connects (and reconnects) in the
    /// background, and every lookup fails — falls through to the durable store — until
    /// the server answers. For a filter that must never stop the consumer from starting.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid configuration only.
    pub async fn connect_lazy(config: RedisConfig) -> Result<Self, StoreError> {
        let conn = Conn::open(&config, false).await?;
        Ok(Self {
            conn,
            config: Arc::new(config),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The Redis key of `key`'s mark: `{prefix}f:{64 hex}`.
    pub fn redis_key(&self, key: &IdempotencyKey) -> String {
        let mut s = String::with_capacity(self.config.key_prefix.len() + 66);
        s.push_str(&self.config.key_prefix);
        s.push_str("f:");
        s.push_str(&key.to_hex());
        s
    }

    fn redis_keys(&self, keys: &[IdempotencyKey]) -> Vec<String> {
        keys.iter().map(|k| self.redis_key(k)).collect()
    }
}

#[async_trait]
impl DoneFilter for RedisFilter {
    async fn seen(&self, keys: &[IdempotencyKey]) -> Result<Vec<bool>, StoreError> {
        let values = self
            .conn
            .get_many("look keys up in the front filter", &self.redis_keys(keys))
            .await?;
        Ok(values
            .into_iter()
            .map(|v| v.as_deref() == Some(DONE_MARK))
            .collect())
    }

    async fn mark_done(&self, keys: &[IdempotencyKey]) -> Result<(), StoreError> {
        self.conn
            .set_px(
                "mark keys done in the front filter",
                &self.redis_keys(keys),
                DONE_MARK,
                self.config.retention_ms(),
            )
            .await
            .map_err(Into::into)
    }
}
