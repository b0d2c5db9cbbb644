//! # idem-store-redis
//!
//! Redis for [idem](idem_core), in the two roles where it is safe:
//!
//! - [`RedisLeaseStore`]: a **lease** claim store (`SET key token NX PX lease`; commit
//!   turns the lease into a done-mark kept for the retention period; rollback deletes it
//!   if the token is still ours). On its own, with the business write elsewhere, it gives
//!   an **at-least-once** effect that is **never lost**: a crashed worker's lease expires
//!   and the redelivery runs again. It is effectively once only for handlers that are
//!   idempotent or finish within their lease. The [module docs](store) say exactly what
//!   holds.
//! - [`RedisFilter`]: a **front filter** in front of a durable, transactional store
//!   (Postgres, SQLite), used as `idem_engine::Filtered::new(durable_store, redis_filter)`.
//!   It answers `Duplicate` only for keys whose *durable commit already happened* (the
//!   mark is written after the commit), so it can never lose a message; a miss, an error,
//!   a timeout or a Redis outage falls through to the durable claim. Its marks are scoped
//!   to the durable store's identity ([`RedisFilter::connect_for_store`]), so stores
//!   sharing one Redis never see each other's marks, and a store restored from a backup
//!   gets a new identity (see [`filter`] for what is automatic and what is not).
//!
//! What this crate deliberately does not offer is the naive filter — `SET NX` *before*
//! the work — which skips a redelivery whose first attempt died before its commit and so
//! loses the message (the crate's tests show it doing exactly that).
//!
//! The lease store against a local Redis (as the crate's tests run; `IDEM_TEST_REDIS_URL`
//! names another): a second claim of a committed key is a duplicate.
//!
//! ```
//! use idem_core::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
//! use idem_store_redis::{RedisConfig, RedisLeaseStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let url = std::env::var("IDEM_TEST_REDIS_URL").unwrap_or("redis://127.0.0.1:6379".into());
//! // A prefix of its own per run, so that the example starts from nothing.
//! let prefix = format!("idem-doc-{}:", std::process::id());
//! let store = RedisLeaseStore::connect(RedisConfig::new(url).with_key_prefix(prefix)).await?;
//! let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}")?;
//! let mut tx = store.begin().await?;
//! assert_eq!(tx.claim(&key, &ClaimMeta::new("A-1")).await?, ClaimOutcome::Claimed);
//! // ... the work, within the lease ...
//! tx.commit().await?;
//! let mut again = store.begin().await?;
//! assert_eq!(again.claim(&key, &ClaimMeta::new("A-1")).await?, ClaimOutcome::Duplicate);
//! again.rollback().await?;
//! # Ok(()) }
//! ```
//!
//! ## Clients and features
//! - `redis-rs` (default): the [`redis`](https://docs.rs/redis) crate; standalone servers
//!   and Redis Cluster (`redis-cluster://host:port,host:port,…`, through its
//!   `cluster-async` connection). A batch claim is one pipeline of native `SET`s, which is
//!   the fastest form (see "Redis claims at depth 100" in docs/performance.md).
//! - `fred`: the [`fred`](https://docs.rs/fred) client instead, for teams that already use
//!   it; standalone servers and Redis Cluster. With both features on,
//!   [`RedisConfig::client`] chooses (redis-rs unless told otherwise).
//!
//! Both run the same code above a handful of pipelined operations, and the same tests.
//! Lua scripts live in `scripts/` beside this crate's sources. Needs Redis 7.0 or later.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod client;
pub mod config;
pub mod error;
pub mod filter;
pub mod store;
mod tls;

pub use config::{ClientKind, RedisConfig};

/// The Redis client of the `fred` feature, re-exported so that a client built for
/// [`RedisClient::Fred`] is of the version this crate uses.
#[cfg(feature = "fred")]
#[cfg_attr(docsrs, doc(cfg(feature = "fred")))]
pub use fred;
/// The Redis client of the `redis-rs` feature, re-exported so that a client built for
/// [`RedisClient::RedisRs`] is of the version this crate uses.
#[cfg(feature = "redis-rs")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-rs")))]
pub use redis;

/// A Redis client the application built itself — its servers, TLS settings,
/// credentials or credential provider, timeouts — for
/// [`RedisLeaseStore::from_client`] and [`RedisFilter::from_client`]. The store's own
/// settings (key prefix, lease, retention, its command timeout) still come from a
/// [`RedisConfig`], whose URL is then not used.
#[non_exhaustive]
// Built once per store and moved into it at once: the size of a variant costs nothing,
// and boxing would make every caller write `Box::new`.
#[allow(clippy::large_enum_variant)]
pub enum RedisClient {
    /// A `redis` crate client for one server (or a sentinel-resolved one).
    #[cfg(feature = "redis-rs")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis-rs")))]
    RedisRs(redis::Client),
    /// A `redis` crate client for a Redis Cluster.
    #[cfg(feature = "redis-rs")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis-rs")))]
    RedisRsCluster(redis::cluster::ClusterClient),
    /// A `fred` client (a server, a cluster or sentinels, as it was built); connected
    /// here if it is not yet.
    #[cfg(feature = "fred")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fred")))]
    Fred(fred::prelude::Client),
}

impl std::fmt::Debug for RedisClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            #[cfg(feature = "redis-rs")]
            Self::RedisRs(_) => "RedisRs",
            #[cfg(feature = "redis-rs")]
            Self::RedisRsCluster(_) => "RedisRsCluster",
            #[cfg(feature = "fred")]
            Self::Fred(_) => "Fred",
        };
        f.debug_tuple("RedisClient").field(&name).finish()
    }
}
pub use error::RedisError;
pub use filter::{IdentitySession, RedisFilter, StoreIdentitySource};
pub use store::{KeyState, RedisLeaseStore, RedisLeaseTx};

// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
