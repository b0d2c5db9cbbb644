//! The one place that knows the client libraries: a handful of pipelined operations,
//! implemented once for `fred` and once for `redis` (redis-rs). Everything above this
//! module is client-agnostic, so both clients run the same store, filter and tests.

use std::future::Future;
use std::time::Duration;

use crate::config::{ClientKind, RedisConfig};
use crate::error::RedisError;

#[cfg(feature = "fred")]
const CLAIM_BATCH: &str = include_str!("../../scripts/claim_batch.lua");

#[cfg(not(any(feature = "fred", feature = "redis-rs")))]
compile_error!("idem-store-redis needs a client: enable the `fred` or the `redis-rs` feature");

/// A connection handle, cheap to clone (clones share the connection).
#[derive(Clone)]
pub(crate) struct Conn {
    inner: Inner,
    timeout: Duration,
    cluster: bool,
}

#[derive(Clone)]
enum Inner {
    #[cfg(feature = "fred")]
    Fred(fred::prelude::Client),
    #[cfg(feature = "redis-rs")]
    RedisRs(rs::Lazy),
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let client = match &self.inner {
            #[cfg(feature = "fred")]
            Inner::Fred(_) => "fred",
            #[cfg(feature = "redis-rs")]
            Inner::RedisRs(_) => "redis-rs",
        };
        f.debug_struct("Conn")
            .field("client", &client)
            .field("cluster", &self.cluster)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Conn {
    /// Connects. With `wait`, the first connection must succeed (and answer PING) within
    /// the timeout; without, the handle is returned at once and connects (and reconnects)
    /// in the background, every command failing until then.
    pub(crate) async fn open(config: &RedisConfig, wait: bool) -> Result<Self, RedisError> {
        config.validate()?;
        let url = config.normalized_url()?;
        let cluster = config.is_cluster();
        // Checked by `validate`: TLS files only with a TLS URL, which needs the feature.
        let tls = config.tls_files()?;
        let inner = match config.client {
            #[cfg(feature = "fred")]
            ClientKind::Fred => {
                Inner::Fred(fred_impl::open(&url, &tls, config.timeout, wait).await?)
            }
            #[cfg(feature = "redis-rs")]
            ClientKind::RedisRs if cluster => Inner::RedisRs(rs::Lazy::new_cluster(
                &config.cluster_nodes()?,
                &tls,
                config.timeout,
            )?),
            #[cfg(feature = "redis-rs")]
            ClientKind::RedisRs => Inner::RedisRs(rs::Lazy::new(&url, &tls, config.timeout)?),
        };
        let conn = Self {
            inner,
            timeout: config.timeout,
            cluster,
        };
        if wait {
            conn.ping().await?;
        }
        Ok(conn)
    }

    /// A handle over `client`, a client the application built itself; its settings other
    /// than the URL (prefix, timeouts) from `config`. With `wait`, the server must answer
    /// a PING within the timeout.
    pub(crate) async fn from_client(
        client: crate::RedisClient,
        config: &RedisConfig,
        wait: bool,
    ) -> Result<Self, RedisError> {
        config.validate_settings()?;
        let timeout = config.timeout;
        let (inner, cluster) = match client {
            #[cfg(feature = "fred")]
            crate::RedisClient::Fred(c) => {
                use fred::interfaces::ClientLike as _;
                if !c.is_connected() {
                    if wait {
                        c.init()
                            .await
                            .map_err(|e| fred_impl::map_err("connect", e))?;
                    } else {
                        drop(c.connect());
                    }
                }
                let cluster = c.is_clustered();
                (Inner::Fred(c), cluster)
            }
            #[cfg(feature = "redis-rs")]
            crate::RedisClient::RedisRs(c) => {
                (Inner::RedisRs(rs::Lazy::from_client(c, timeout)), false)
            }
            #[cfg(feature = "redis-rs")]
            crate::RedisClient::RedisRsCluster(c) => (
                Inner::RedisRs(rs::Lazy::from_cluster_client(c, timeout)),
                true,
            ),
        };
        let conn = Self {
            inner,
            timeout,
            cluster,
        };
        if wait {
            conn.ping().await?;
        }
        Ok(conn)
    }

    async fn bounded<T, F>(&self, action: &'static str, f: F) -> Result<T, RedisError>
    where
        F: Future<Output = Result<T, RedisError>>,
    {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => r,
            Err(_) => Err(RedisError::Timeout {
                action,
                timeout: self.timeout,
            }),
        }
    }

    /// `PING`.
    pub(crate) async fn ping(&self) -> Result<(), RedisError> {
        const A: &str = "ping the server";
        self.bounded(A, async {
            match &self.inner {
                #[cfg(feature = "fred")]
                Inner::Fred(c) => fred_impl::ping(c, A).await,
                #[cfg(feature = "redis-rs")]
                Inner::RedisRs(c) => c.ping(A).await,
            }
        })
        .await
    }

    /// `SET key value NX PX ms GET` for each key, in one pipelined round trip: `None`
    /// where the key was set, the value already there otherwise.
    pub(crate) async fn set_nx_get(
        &self,
        action: &'static str,
        keys: &[String],
        value: &str,
        px: i64,
    ) -> Result<Vec<Option<String>>, RedisError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        // Each claim is one native `SET … NX PX … GET`, atomic by itself; a batch needs no
        // atomicity across keys (another worker may claim any key between two commands,
        // and each answer says who holds it; a key repeated in the batch finds our own
        // token the second time). redis-rs sends a batch as one pipelined write (one per
        // slot on a cluster) and reads the replies with little work per command: the
        // fastest form. fred spends more per pipelined command (a command object, a
        // responder, and in a `Pipeline` a copy of each command and a socket flush after
        // each) than the server does on the SET, so on one server it sends a batch as one
        // `EVAL` of `scripts/claim_batch.lua` (one command; the script's loop costs the
        // server more per key than a native SET, but less than fred's per-command work).
        // On a cluster, whose keys live in different slots, fred pipelines native SETs.
        // (`scripts/bench-redis`; see "Redis claims at depth 100" in docs/performance.md.)
        #[cfg(feature = "fred")]
        let script = !self.cluster && keys.len() > 1;
        let out = self
            .bounded(action, async {
                match &self.inner {
                    #[cfg(feature = "fred")]
                    Inner::Fred(c) if script => {
                        fred_impl::eval_multi(c, action, CLAIM_BATCH, keys, value, px).await
                    }
                    #[cfg(feature = "fred")]
                    Inner::Fred(c) => fred_impl::set_nx_get(c, action, keys, value, px).await,
                    #[cfg(feature = "redis-rs")]
                    Inner::RedisRs(c) => c.set_nx_get(action, keys, value, px).await,
                }
            })
            .await?;
        check_len(action, keys.len(), out)
    }

    /// `SET key value PX ms` for each key, in one pipelined round trip.
    pub(crate) async fn set_px(
        &self,
        action: &'static str,
        keys: &[String],
        value: &str,
        px: i64,
    ) -> Result<(), RedisError> {
        if keys.is_empty() {
            return Ok(());
        }
        self.bounded(action, async {
            match &self.inner {
                #[cfg(feature = "fred")]
                Inner::Fred(c) => fred_impl::set_px(c, action, keys, value, px).await,
                #[cfg(feature = "redis-rs")]
                Inner::RedisRs(c) => c.set_px(action, keys, value, px).await,
            }
        })
        .await
    }

    /// The value of each key, in one round trip (`MGET` on one server, pipelined `GET`s
    /// on a cluster, where keys live in different slots).
    pub(crate) async fn get_many(
        &self,
        action: &'static str,
        keys: &[String],
    ) -> Result<Vec<Option<String>>, RedisError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let cluster = self.cluster;
        let out = self
            .bounded(action, async {
                match &self.inner {
                    #[cfg(feature = "fred")]
                    Inner::Fred(c) => fred_impl::get_many(c, action, keys, cluster).await,
                    #[cfg(feature = "redis-rs")]
                    Inner::RedisRs(c) => {
                        let _ = cluster;
                        c.get_many(action, keys).await
                    }
                }
            })
            .await?;
        check_len(action, keys.len(), out)
    }

    /// `script` run on each key (`KEYS[1]`) with `args`, in one pipelined round trip;
    /// each script returns an integer. redis-rs sends `EVALSHA` and, for the commands the
    /// server answers `NOSCRIPT` (a restarted server has an empty script cache), `EVAL` in
    /// a second round trip; fred sends `EVAL` (these scripts are a few hundred bytes).
    pub(crate) async fn eval_each(
        &self,
        action: &'static str,
        script: &'static str,
        keys: &[String],
        args: &[String],
    ) -> Result<Vec<i64>, RedisError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let out = self
            .bounded(action, async {
                match &self.inner {
                    #[cfg(feature = "fred")]
                    Inner::Fred(c) => fred_impl::eval_each(c, action, script, keys, args).await,
                    #[cfg(feature = "redis-rs")]
                    Inner::RedisRs(c) => c.eval_each(action, script, keys, args).await,
                }
            })
            .await?;
        check_len(action, keys.len(), out)
    }
}

fn check_len<T>(action: &'static str, want: usize, v: Vec<T>) -> Result<Vec<T>, RedisError> {
    if v.len() == want {
        Ok(v)
    } else {
        Err(RedisError::UnexpectedReply {
            action,
            detail: format!("{} replies for {want} commands", v.len()),
        })
    }
}

#[cfg(feature = "fred")]
mod fred_impl;

#[cfg(feature = "redis-rs")]
mod rs;

/// The redis-rs error mapping against the server at `IDEM_TEST_REDIS_URL` (default
/// `redis://127.0.0.1:6379`): real replies of the client version in use, not made-up
/// errors, so a change in how the client reports them fails here.
#[cfg(all(test, feature = "redis-rs"))]
mod rs_tests;
