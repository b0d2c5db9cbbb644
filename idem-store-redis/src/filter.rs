//! [`RedisFilter`]: a front filter of committed keys, in front of a durable store, with
//! its marks scoped to that store's identity.
//!
//! # Scoping, restores and clones
//!
//! A mark says "this key committed *in this store*". Its Redis key carries a **scope**:
//!
//! - [`RedisFilter::connect_for_store`]: the durable store's identity — a random id that
//!   `idem migrate` writes into the store (`idem_store_identity`), unique per Postgres
//!   schema or SQLite file. Stores sharing one Redis never see each other's marks, and
//!   processes on one store share theirs.
//! - [`RedisFilter::connect`] / [`RedisFilter::connect_lazy`]: a random scope of this
//!   filter value alone (clones included): only its own marks, never another process's.
//!
//! A store restored from a backup, failed over to a replica that missed commits, or
//! copied carries an identity whose marks may name keys it lacks. Each start of a filter
//! on a store, and then a heartbeat every [`RedisConfig::identity_heartbeat`], starts an
//! **identity session**: it increments the store's session counter (row locked, not yet
//! committed), registers the number in Redis with a compare (`scripts/session.lua`:
//! accepted only if above the highest number Redis has seen for that identity), then
//! commits. A number not above it means the store went back in time (or a copy is
//! running too): the identity is **rotated** to a new random id in the same transaction,
//! a warning is logged, and the old marks no longer apply. Until a session has been
//! registered — at start, and after any failed heartbeat — the filter answers nothing
//! (every lookup falls through to the durable store).
//!
//! What is automatic and what is not (docs/stores.md, "Front filter: store identity, restores
//! and clones"): a restore is caught when any session was registered after the backup's
//! snapshot (a start, or a heartbeat of a running consumer) — the usual case for a
//! backup older than one heartbeat. It is not caught, and the runbook's `idem migrate
//! --rotate-store-identity` is needed, when the old store stopped within one heartbeat
//! after the snapshot; and a consumer that keeps running across a restore serves stale
//! marks until its next heartbeat. A copy is caught at the first session of whichever
//! of the two registers second, up to one heartbeat late: rotate a copy before use.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{DoneFilter, IdempotencyKey, StoreError};

use crate::client::Conn;
use crate::config::RedisConfig;
use crate::store::DONE_MARK;

/// `scripts/session.lua`: registers a session number if above the highest seen.
const SESSION: &str = include_str!("../scripts/session.lua");

/// A durable store's identity, as [`RedisFilter::connect_for_store`] uses it: a few
/// lines over `PgStore::begin_identity_session` or `SqliteStore::begin_identity_session`.
#[async_trait]
pub trait StoreIdentitySource: Send + Sync + 'static {
    /// Starts an identity session: the store's session counter incremented in a
    /// transaction that keeps concurrent starts out until it commits or is dropped.
    async fn begin_session(&self) -> Result<Box<dyn IdentitySession>, StoreError>;
}

/// An identity session in progress (see [`StoreIdentitySource`]). Dropping it rolls back.
#[async_trait]
pub trait IdentitySession: Send {
    /// The store's id (in this transaction).
    fn store_id(&self) -> &str;
    /// The new session number (in this transaction).
    fn session(&self) -> i64;
    /// Replaces the id by a new random one with session 1, in this transaction.
    async fn rotate(&mut self) -> Result<(), StoreError>;
    /// Commits.
    async fn commit(self: Box<Self>) -> Result<(), StoreError>;
}

#[derive(Debug, Default)]
struct Scope {
    /// `{prefix}f:{scope}:`; `None` until the store's session is registered.
    marks: RwLock<Option<String>>,
    rotations: AtomicU64,
}

impl Scope {
    fn marks(&self) -> Option<String> {
        self.marks.read().map(|g| g.clone()).unwrap_or(None)
    }

    fn set(&self, marks: Option<String>) {
        if let Ok(mut g) = self.marks.write() {
            *g = marks;
        }
    }
}

/// A [`DoneFilter`] on Redis: put it in front of a durable store with
/// `idem_engine::Filtered`. Its marks are scoped (see the [module docs](self)).
///
/// ```no_run
/// # async fn demo<S: idem_core::ClaimStore>(durable_store: S, identity: std::sync::Arc<dyn idem_store_redis::StoreIdentitySource>) -> Result<(), idem_core::StoreError> {
/// use idem_store_redis::{RedisConfig, RedisFilter};
///
/// let filter = RedisFilter::connect_for_store(RedisConfig::new("redis://127.0.0.1:6379"), identity).await?;
/// let store = idem_engine::Filtered::new(durable_store, filter);
/// // ... Gate::new(store, handler) ...; store.stats().hits() counts the filter's answers.
/// # Ok(()) }
/// ```
///
/// - [`seen`](DoneFilter::seen) is one round trip for the whole slice (`MGET` on one
///   server, pipelined `GET`s on a cluster), bounded by [`RedisConfig::timeout`]; a miss,
///   an error or a timeout falls through to the durable claim (the wrapper treats an
///   error as "not seen"). Before the store's session is registered it is an error.
/// - [`mark_done`](DoneFilter::mark_done) is one pipelined round trip of
///   `SET {prefix}f:{scope}:{key} done PX {retention}`. `idem_engine::Filtered` calls it only
///   *after* the durable commit, so Redis never says "done" for a key whose work could
///   still be lost.
/// - Redis losing marks (a restart, eviction, the end of the retention) only costs
///   speed: the durable store still answers `Duplicate`.
///
/// Clones share one connection and one scope.
#[derive(Debug, Clone)]
pub struct RedisFilter {
    conn: Conn,
    config: Arc<RedisConfig>,
    scope: Arc<Scope>,
}

impl RedisFilter {
    /// Connects (the server must answer within the configured timeout).
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid configuration; [`StoreError::Unavailable`]
    /// when the server cannot be reached.
    ///
    /// The marks are scoped to this filter value and its clones alone (a random scope):
    /// correct in front of any store, shared with no other process. In front of a durable
    /// store with an identity, use [`connect_for_store`](Self::connect_for_store).
    pub async fn connect(config: RedisConfig) -> Result<Self, StoreError> {
        let conn = Conn::open(&config, true).await?;
        Ok(Self::private(conn, config))
    }

    /// As [`connect`](Self::connect), over `client`, a client the application built
    /// itself; `config.url` is not used, the rest of `config` is.
    ///
    /// # Errors
    /// [`StoreError::Config`] for invalid settings; [`StoreError::Unavailable`] when the
    /// server cannot be reached.
    pub async fn from_client(
        client: crate::RedisClient,
        config: RedisConfig,
    ) -> Result<Self, StoreError> {
        let conn = Conn::from_client(client, &config, true).await?;
        Ok(Self::private(conn, config))
    }

    fn private(conn: Conn, config: RedisConfig) -> Self {
        let scope = Scope::default();
        scope.set(Some(marks_prefix(
            &config.key_prefix,
            &format!("p{:032x}", rand::random::<u128>()),
        )));
        Self {
            conn,
            config: Arc::new(config),
            scope: Arc::new(scope),
        }
    }

    /// Connects a filter whose marks are scoped to the durable store's identity, shared
    /// by every process on that store: registers an identity session at once (rotating
    /// the identity when the store went back in time), then again every
    /// [`RedisConfig::identity_heartbeat`] from a background task (which ends when the
    /// last clone is dropped). The filter answers nothing until a session is registered.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid configuration or a store without an
    /// identity (run `idem migrate`); [`StoreError::Unavailable`] when Redis cannot be
    /// reached. A failure of the first session for another reason is logged, and the
    /// heartbeat tries again.
    pub async fn connect_for_store(
        config: RedisConfig,
        identity: Arc<dyn StoreIdentitySource>,
    ) -> Result<Self, StoreError> {
        let conn = Conn::open(&config, true).await?;
        let filter = Self {
            conn,
            config: Arc::new(config),
            scope: Arc::new(Scope::default()),
        };
        match filter.start_session(&*identity).await {
            Ok(()) => {}
            Err(e @ StoreError::Config(_)) => return Err(e),
            Err(e) => tracing::warn!(
                target: "idem::filter",
                error = %e,
                "front filter: the store's identity session could not be registered; \
                 the filter stays off until a heartbeat succeeds"
            ),
        }
        tokio::spawn(heartbeat(
            Arc::downgrade(&filter.scope),
            filter.conn.clone(),
            filter.config.clone(),
            identity,
        ));
        Ok(filter)
    }

    /// Starts and registers one identity session (rotating the identity if Redis has seen
    /// a session as high), then scopes the marks to the identity. On error the filter
    /// answers nothing until the next success.
    ///
    /// # Errors
    /// [`StoreError`] from the store or Redis.
    pub async fn start_session(
        &self,
        identity: &dyn StoreIdentitySource,
    ) -> Result<(), StoreError> {
        let r = session(&self.conn, &self.config, &self.scope, identity).await;
        if r.is_err() {
            self.scope.set(None);
        }
        r
    }

    /// The scope of the marks (the store's id, or this filter's random scope); `None`
    /// while no identity session is registered.
    pub fn scope(&self) -> Option<String> {
        self.scope.marks().map(|m| {
            m[self.config.key_prefix.len() + 2..]
                .trim_end_matches(':')
                .to_owned()
        })
    }

    /// How many times this filter has rotated its store's identity.
    pub fn rotations(&self) -> u64 {
        self.scope.rotations.load(Ordering::Acquire)
    }

    /// A filter that does not wait for the server: it connects (and reconnects) in the
    /// background, and every lookup fails — falls through to the durable store — until
    /// the server answers. For a filter that must never stop the consumer from starting.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid configuration only.
    /// Scoped like [`connect`](Self::connect).
    pub async fn connect_lazy(config: RedisConfig) -> Result<Self, StoreError> {
        let conn = Conn::open(&config, false).await?;
        Ok(Self::private(conn, config))
    }

    /// The configuration.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The Redis key of `key`'s mark, `{prefix}f:{scope}:{64 hex}`; `None` while no
    /// identity session is registered.
    pub fn redis_key(&self, key: &IdempotencyKey) -> Option<String> {
        self.scope.marks().map(|m| format!("{m}{}", key.to_hex()))
    }

    fn redis_keys(&self, keys: &[IdempotencyKey]) -> Result<Vec<String>, StoreError> {
        let Some(m) = self.scope.marks() else {
            return Err(StoreError::Unavailable {
                message: "the front filter has no registered identity session".into(),
                source: None,
            });
        };
        Ok(keys.iter().map(|k| format!("{m}{}", k.to_hex())).collect())
    }
}

fn marks_prefix(key_prefix: &str, scope: &str) -> String {
    format!("{key_prefix}f:{scope}:")
}

/// Registers `n` as a session of `store_id`: true if above the highest seen.
async fn register(
    conn: &Conn,
    config: &RedisConfig,
    store_id: &str,
    n: i64,
) -> Result<bool, StoreError> {
    // The register outlives every mark written under it (marks live `retention`).
    let ttl = config
        .retention_ms()
        .saturating_mul(2)
        .saturating_add(config.heartbeat_ms());
    let out = conn
        .eval_each(
            "register the store's identity session",
            SESSION,
            &[format!("{}fs:{store_id}", config.key_prefix)],
            &[n.to_string(), ttl.to_string()],
        )
        .await?;
    Ok(out.first() == Some(&1))
}

async fn session(
    conn: &Conn,
    config: &RedisConfig,
    scope: &Scope,
    identity: &dyn StoreIdentitySource,
) -> Result<(), StoreError> {
    let mut s = identity.begin_session().await?;
    let mut rotated = false;
    if !register(conn, config, s.store_id(), s.session()).await? {
        // The old identity's marks stop answering now, not once the rotation is done:
        // until then every lookup falls through to the durable store.
        scope.set(None);
        let old = short(s.store_id()).to_owned();
        let stale = s.session();
        s.rotate().await?;
        if !register(conn, config, s.store_id(), s.session()).await? {
            return Err(StoreError::other(
                "a freshly rotated store identity is already registered in Redis",
                false,
            ));
        }
        rotated = true;
        tracing::warn!(
            target: "idem::filter",
            old_store_id = %old,
            new_store_id = %short(s.store_id()),
            stale_session = stale,
            "front filter: store identity rotated: session {stale} is not above the highest \
             Redis has seen for this identity, so the store was restored from a backup, \
             failed over, or copied; the old identity's marks no longer apply to it"
        );
    }
    let marks = marks_prefix(&config.key_prefix, s.store_id());
    s.commit().await?;
    scope.set(Some(marks));
    // Counted once the new identity is in use (`rotations` then `scope` reads the new one).
    if rotated {
        scope.rotations.fetch_add(1, Ordering::Release);
    }
    Ok(())
}

fn short(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

async fn heartbeat(
    scope: Weak<Scope>,
    conn: Conn,
    config: Arc<RedisConfig>,
    identity: Arc<dyn StoreIdentitySource>,
) {
    let every = config.identity_heartbeat;
    let mut wait = every;
    loop {
        tokio::time::sleep(wait).await;
        let Some(scope) = scope.upgrade() else { return };
        match session(&conn, &config, &scope, &*identity).await {
            Ok(()) => wait = every,
            Err(e) => {
                // Off until a session is registered again: the store may be coming back
                // from a restore.
                scope.set(None);
                tracing::warn!(
                    target: "idem::filter",
                    error = %e,
                    "front filter: identity heartbeat failed; the filter is off until the next \
                     one succeeds"
                );
                wait = every.min(Duration::from_secs(1));
            }
        }
    }
}

#[async_trait]
impl DoneFilter for RedisFilter {
    async fn seen(&self, keys: &[IdempotencyKey]) -> Result<Vec<bool>, StoreError> {
        let values = self
            .conn
            .get_many("look keys up in the front filter", &self.redis_keys(keys)?)
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
                &self.redis_keys(keys)?,
                DONE_MARK,
                self.config.retention_ms(),
            )
            .await
            .map_err(Into::into)
    }
}
