//! The one place that knows the client libraries: a handful of pipelined operations,
//! implemented once for `fred` and once for `redis` (redis-rs). Everything above this
//! module is client-agnostic, so both clients run the same store, filter and tests.

use std::future::Future;
use std::time::Duration;

use crate::config::{ClientKind, RedisConfig};
use crate::error::RedisError;

#[cfg(feature = "fred")]
const CLAIM_BATCH: &str = include_str!("../scripts/claim_batch.lua");

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
        #[cfg(feature = "tls")]
        if crate::tls::scheme_asks_for_tls(&url) {
            // Both clients build their TLS configurations from rustls's process default.
            crate::tls::install_default_provider();
        }
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
        // The client may speak TLS: both clients build their TLS configurations from
        // rustls's process default.
        #[cfg(feature = "tls")]
        crate::tls::install_default_provider();
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
mod fred_impl {
    use std::time::Duration;

    use fred::prelude::*;
    use fred::types::CustomCommand;

    use crate::error::RedisError;

    pub(super) fn map_err(action: &'static str, e: Error) -> RedisError {
        match e.kind() {
            ErrorKind::IO | ErrorKind::Canceled | ErrorKind::Timeout | ErrorKind::Routing => {
                RedisError::Unavailable {
                    action,
                    source: Box::new(e),
                }
            }
            ErrorKind::Config | ErrorKind::Url => RedisError::Config(e.to_string()),
            // "CLUSTERDOWN", "LOADING", "TRYAGAIN", "MASTERDOWN", "BUSY": the server will
            // answer later.
            _ if ["CLUSTERDOWN", "LOADING", "TRYAGAIN", "MASTERDOWN", "BUSY"]
                .iter()
                .any(|p| e.details().starts_with(p)) =>
            {
                RedisError::Unavailable {
                    action,
                    source: Box::new(e),
                }
            }
            _ => RedisError::Refused {
                action,
                source: Box::new(e),
            },
        }
    }

    /// `tls`: files given with a `rediss://` URL (else fred's own TLS configuration, on
    /// the system's roots).
    #[cfg_attr(not(feature = "tls"), allow(unused_variables))]
    pub(super) async fn open(
        url: &str,
        tls: &crate::tls::TlsFiles,
        timeout: Duration,
        wait: bool,
    ) -> Result<Client, RedisError> {
        #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
        let mut config = Config::from_url(url)
            .map_err(|e| RedisError::Config(format!("{:?}: {e}", idem_core::Redacted(url))))?;
        #[cfg(feature = "tls")]
        if !tls.is_empty() {
            config.tls = Some(crate::tls::rustls_config(tls)?.into());
        }
        config.fail_fast = wait;
        let client = Builder::from_config(config)
            .with_connection_config(|c| {
                c.connection_timeout = timeout.max(Duration::from_millis(500));
                c.internal_command_timeout = timeout.max(Duration::from_secs(2));
                // Our own timeout bounds every call; a command is not re-sent behind it.
                c.max_command_attempts = 1;
            })
            .with_performance_config(|p| {
                p.default_command_timeout = timeout;
            })
            // Keep reconnecting forever, at most every 2 s: a Redis outage must end by
            // itself, while every command in the meantime fails within the timeout.
            .set_policy(ReconnectPolicy::new_exponential(0, 50, 2_000, 2))
            .build()
            .map_err(|e| RedisError::Config(e.to_string()))?;
        if wait {
            client.init().await.map_err(|e| map_err("connect", e))?;
        } else {
            // The handle is the connection task; dropping it detaches, the task runs on.
            drop(client.connect());
        }
        Ok(client)
    }

    pub(super) async fn ping(c: &Client, action: &'static str) -> Result<(), RedisError> {
        let _: String = c.ping(None).await.map_err(|e| map_err(action, e))?;
        Ok(())
    }

    fn collect<T>(
        action: &'static str,
        results: Vec<Result<Value, Error>>,
        mut f: impl FnMut(Value) -> Result<T, RedisError>,
    ) -> Result<Vec<T>, RedisError> {
        results
            .into_iter()
            .map(|r| r.map_err(|e| map_err(action, e)).and_then(&mut f))
            .collect()
    }

    fn opt_string(action: &'static str, v: Value) -> Result<Option<String>, RedisError> {
        match v {
            Value::Null => Ok(None),
            other => other
                .convert::<String>()
                .map(Some)
                .map_err(|e| RedisError::UnexpectedReply {
                    action,
                    detail: e.to_string(),
                }),
        }
    }

    pub(super) async fn set_nx_get(
        c: &Client,
        action: &'static str,
        keys: &[String],
        value: &str,
        px: i64,
    ) -> Result<Vec<Option<String>>, RedisError> {
        if let [k] = keys {
            let v: Value = c
                .set(
                    k.as_str(),
                    value,
                    Some(Expiration::PX(px)),
                    Some(SetOptions::NX),
                    true,
                )
                .await
                .map_err(|e| map_err(action, e))?;
            return Ok(vec![opt_string(action, v)?]);
        }
        // The token once, shared by every command (a reference count, not a copy each).
        let value = Value::from(value);
        let p = c.pipeline();
        for k in keys {
            let () = p
                .set(
                    k.as_str(),
                    value.clone(),
                    Some(Expiration::PX(px)),
                    Some(SetOptions::NX),
                    true,
                )
                .await
                .map_err(|e| map_err(action, e))?;
        }
        collect(action, p.try_all::<Value>().await, |v| {
            opt_string(action, v)
        })
    }

    pub(super) async fn eval_multi(
        c: &Client,
        action: &'static str,
        script: &'static str,
        keys: &[String],
        value: &str,
        px: i64,
    ) -> Result<Vec<Option<String>>, RedisError> {
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let v: Value = c
            .eval(script, keys, vec![Value::from(value), Value::from(px)])
            .await
            .map_err(|e| map_err(action, e))?;
        match v {
            Value::Array(items) => items.into_iter().map(|v| opt_string(action, v)).collect(),
            other => Err(RedisError::UnexpectedReply {
                action,
                detail: format!("the batch script answered {:?}", other.kind()),
            }),
        }
    }

    pub(super) async fn set_px(
        c: &Client,
        action: &'static str,
        keys: &[String],
        value: &str,
        px: i64,
    ) -> Result<(), RedisError> {
        let p = c.pipeline();
        for k in keys {
            let () = p
                .set(k.as_str(), value, Some(Expiration::PX(px)), None, false)
                .await
                .map_err(|e| map_err(action, e))?;
        }
        collect(action, p.try_all::<Value>().await, |_| Ok(()))?;
        Ok(())
    }

    pub(super) async fn get_many(
        c: &Client,
        action: &'static str,
        keys: &[String],
        cluster: bool,
    ) -> Result<Vec<Option<String>>, RedisError> {
        if !cluster {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let v: Value = c.mget(keys).await.map_err(|e| map_err(action, e))?;
            return match v {
                Value::Array(items) => items.into_iter().map(|v| opt_string(action, v)).collect(),
                other => Err(RedisError::UnexpectedReply {
                    action,
                    detail: format!("MGET answered {:?}", other.kind()),
                }),
            };
        }
        let p = c.pipeline();
        for k in keys {
            let () = p.get(k.as_str()).await.map_err(|e| map_err(action, e))?;
        }
        collect(action, p.try_all::<Value>().await, |v| {
            opt_string(action, v)
        })
    }

    pub(super) async fn eval_each(
        c: &Client,
        action: &'static str,
        script: &'static str,
        keys: &[String],
        args: &[String],
    ) -> Result<Vec<i64>, RedisError> {
        // Pipelines have no `eval` in fred 10: a custom command, routed by the key's slot.
        let p = c.pipeline();
        for k in keys {
            let cmd =
                CustomCommand::new_static("EVAL", fred::util::redis_keyslot(k.as_bytes()), false);
            let mut cmd_args: Vec<Value> = Vec::with_capacity(3 + args.len());
            cmd_args.push(script.into());
            cmd_args.push(1_i64.into());
            cmd_args.push(k.as_str().into());
            cmd_args.extend(args.iter().map(|a| Value::from(a.as_str())));
            let () = p
                .custom(cmd, cmd_args)
                .await
                .map_err(|e| map_err(action, e))?;
        }
        collect(action, p.try_all::<Value>().await, |v| {
            v.convert::<i64>().map_err(|e| RedisError::UnexpectedReply {
                action,
                detail: e.to_string(),
            })
        })
    }
}

#[cfg(feature = "redis-rs")]
mod rs {
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::Duration;

    use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
    use redis::cluster::ClusterClient;
    use redis::cluster_async::ClusterConnection;
    use redis::cluster_routing::Slot;
    use redis::{FromRedisValue, Pipeline};
    use tokio::sync::Mutex;

    use crate::error::RedisError;

    /// Where the connection goes: one server, or a cluster's nodes.
    #[derive(Clone)]
    enum Target {
        Single(Box<redis::Client>),
        Cluster(Box<ClusterClient>),
    }

    /// A live connection: redis-rs's connection manager (one server), or its cluster
    /// connection (which follows the slot map and reconnects to each node).
    #[derive(Clone)]
    enum Live {
        Single(ConnectionManager),
        Cluster(ClusterConnection),
    }

    /// A connection made on first use (so a handle to a server that is down can be had,
    /// and works once the server is up), which then reconnects by itself.
    #[derive(Clone)]
    pub(super) struct Lazy(Arc<Shared>);

    struct Shared {
        target: Target,
        timeout: Duration,
        conn: Mutex<Option<Live>>,
    }

    /// Sorts a redis-rs error into this crate's kinds. A server error inside a pipeline
    /// comes back as one error whose kind is that of the first failing command (an
    /// unknown code, such as `WRONGTYPE`, is `Extension`: refused); a reply that does not
    /// convert to the expected type is `Parse` (the 0.x `TypeError`).
    fn map_err(action: &'static str, e: redis::RedisError) -> RedisError {
        use redis::{ErrorKind as K, ServerErrorKind as S};
        if e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_timeout()
            || matches!(
                e.kind(),
                K::Server(S::BusyLoading | S::TryAgain | S::ClusterDown | S::MasterDown)
            )
        {
            RedisError::Unavailable {
                action,
                source: Box::new(e),
            }
        } else if matches!(e.kind(), K::Parse | K::UnexpectedReturnType) {
            RedisError::UnexpectedReply {
                action,
                detail: e.to_string(),
            }
        } else {
            RedisError::Refused {
                action,
                source: Box::new(e),
            }
        }
    }

    impl Lazy {
        /// `tls`: files given with a `rediss://` URL (else redis-rs's own TLS
        /// configuration, on the system's roots).
        #[cfg_attr(not(feature = "tls"), allow(unused_variables))]
        pub(super) fn new(
            url: &str,
            tls: &crate::tls::TlsFiles,
            timeout: Duration,
        ) -> Result<Self, RedisError> {
            #[cfg(feature = "tls")]
            let client = if tls.is_empty() {
                redis::Client::open(url)
            } else {
                redis::Client::build_with_tls(url, crate::tls::redis_rs_certificates(tls)?)
            };
            #[cfg(not(feature = "tls"))]
            let client = redis::Client::open(url);
            let client = client
                .map_err(|e| RedisError::Config(format!("{:?}: {e}", idem_core::Redacted(url))))?;
            Ok(Self::with_target(Target::Single(Box::new(client)), timeout))
        }

        /// A cluster client on `nodes` (one `redis://host:port` each; any subset of the
        /// cluster, the rest is discovered).
        #[cfg_attr(not(feature = "tls"), allow(unused_variables))]
        pub(super) fn new_cluster(
            nodes: &[String],
            tls: &crate::tls::TlsFiles,
            timeout: Duration,
        ) -> Result<Self, RedisError> {
            #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
            let mut builder = ClusterClient::builder(nodes.iter().map(String::as_str));
            #[cfg(feature = "tls")]
            if !tls.is_empty() {
                builder = builder.certs(crate::tls::redis_rs_certificates(tls)?);
            }
            let client = builder
                .connection_timeout(timeout.max(Duration::from_millis(500)))
                .response_timeout(timeout)
                // Our own timeout bounds every call; within it, a redirection (MOVED, ASK)
                // or a node that reconnects is tried again.
                .retries(2)
                .build()
                .map_err(|e| RedisError::Config(format!("{nodes:?}: {e}")))?;
            Ok(Self::with_target(
                Target::Cluster(Box::new(client)),
                timeout,
            ))
        }

        /// Over a client the application built.
        pub(super) fn from_client(client: redis::Client, timeout: Duration) -> Self {
            Self::with_target(Target::Single(Box::new(client)), timeout)
        }

        /// Over a cluster client the application built.
        pub(super) fn from_cluster_client(client: ClusterClient, timeout: Duration) -> Self {
            Self::with_target(Target::Cluster(Box::new(client)), timeout)
        }

        fn with_target(target: Target, timeout: Duration) -> Self {
            Self(Arc::new(Shared {
                target,
                timeout,
                conn: Mutex::new(None),
            }))
        }

        async fn conn(&self, action: &'static str) -> Result<Live, RedisError> {
            let timeout = self.0.timeout;
            let mut slot = self.0.conn.lock().await;
            if let Some(c) = slot.as_ref() {
                return Ok(c.clone());
            }
            let live = match &self.0.target {
                Target::Single(client) => {
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(timeout.max(Duration::from_millis(500))))
                        .set_response_timeout(Some(timeout))
                        .set_number_of_retries(1)
                        .set_max_delay(Duration::from_secs(2));
                    Live::Single(
                        ConnectionManager::new_with_config((**client).clone(), config)
                            .await
                            .map_err(|e| map_err(action, e))?,
                    )
                }
                Target::Cluster(client) => Live::Cluster(
                    client
                        .get_async_connection()
                        .await
                        .map_err(|e| map_err(action, e))?,
                ),
            };
            *slot = Some(live.clone());
            Ok(live)
        }

        /// One command per key, built by `add`, converted to `T`; the first server error
        /// fails the call.
        async fn per_key<T: FromRedisValue>(
            &self,
            action: &'static str,
            keys: &[String],
            add: impl Fn(&mut Pipeline, &String),
        ) -> Result<Vec<T>, RedisError> {
            self.per_key_raw(action, keys, add)
                .await?
                .into_iter()
                .map(|v| convert(action, v))
                .collect()
        }

        /// One command per key, built by `add`, in one pipeline on one server; each reply
        /// as it came, a server error as `Value::ServerError`. On a cluster every command
        /// must reach the node of its key's slot: one pipeline per slot (commands on one
        /// key keep their order), all in flight at once.
        async fn per_key_raw(
            &self,
            action: &'static str,
            keys: &[String],
            add: impl Fn(&mut Pipeline, &String),
        ) -> Result<Vec<redis::Value>, RedisError> {
            match self.conn(action).await? {
                Live::Single(mut c) => {
                    let mut p = redis::pipe();
                    p.ignore_errors();
                    for k in keys {
                        add(&mut p, k);
                    }
                    p.query_async(&mut c).await.map_err(|e| map_err(action, e))
                }
                Live::Cluster(c) => {
                    let mut groups: HashMap<Slot, Vec<usize>> = HashMap::new();
                    for (i, k) in keys.iter().enumerate() {
                        groups.entry(Slot::for_key(k)).or_default().push(i);
                    }
                    let sends = groups.into_values().map(|idx| {
                        let mut c = c.clone();
                        let mut p = redis::pipe();
                        p.ignore_errors();
                        for &i in &idx {
                            add(&mut p, &keys[i]);
                        }
                        async move {
                            let r: Vec<redis::Value> = p.query_async(&mut c).await?;
                            Ok::<_, redis::RedisError>((idx, r))
                        }
                    });
                    let mut out = vec![redis::Value::Nil; keys.len()];
                    for r in futures::future::join_all(sends).await {
                        let (idx, values) = r.map_err(|e| map_err(action, e))?;
                        if values.len() != idx.len() {
                            return Err(RedisError::UnexpectedReply {
                                action,
                                detail: format!(
                                    "{} replies for {} commands",
                                    values.len(),
                                    idx.len()
                                ),
                            });
                        }
                        for (i, v) in idx.into_iter().zip(values) {
                            out[i] = v;
                        }
                    }
                    Ok(out)
                }
            }
        }

        pub(super) async fn ping(&self, action: &'static str) -> Result<(), RedisError> {
            let mut cmd = redis::cmd("PING");
            match self.conn(action).await? {
                Live::Single(mut c) => query_ping(&mut c, &mut cmd, action).await,
                // PING on a cluster goes to every node; any answer but an error will do.
                Live::Cluster(mut c) => query_ping(&mut c, &mut cmd, action).await,
            }
        }

        pub(super) async fn set_nx_get(
            &self,
            action: &'static str,
            keys: &[String],
            value: &str,
            px: i64,
        ) -> Result<Vec<Option<String>>, RedisError> {
            self.per_key(action, keys, |p, k| {
                p.cmd("SET")
                    .arg(k)
                    .arg(value)
                    .arg("NX")
                    .arg("PX")
                    .arg(px)
                    .arg("GET");
            })
            .await
        }

        pub(super) async fn set_px(
            &self,
            action: &'static str,
            keys: &[String],
            value: &str,
            px: i64,
        ) -> Result<(), RedisError> {
            let _: Vec<redis::Value> = self
                .per_key(action, keys, |p, k| {
                    p.cmd("SET").arg(k).arg(value).arg("PX").arg(px);
                })
                .await?;
            Ok(())
        }

        pub(super) async fn get_many(
            &self,
            action: &'static str,
            keys: &[String],
        ) -> Result<Vec<Option<String>>, RedisError> {
            if let Target::Cluster(_) = self.0.target {
                return self
                    .per_key(action, keys, |p, k| {
                        p.cmd("GET").arg(k);
                    })
                    .await;
            }
            let Live::Single(mut c) = self.conn(action).await? else {
                unreachable!("a standalone target has a standalone connection")
            };
            redis::cmd("MGET")
                .arg(keys)
                .query_async(&mut c)
                .await
                .map_err(|e| map_err(action, e))
        }

        /// `EVALSHA` of `script` for each key; the commands the server answers `NOSCRIPT`
        /// (a restarted or flushed script cache; a cluster node that never ran it) are sent
        /// again as `EVAL`, which also caches the script. Only those: the others ran.
        pub(super) async fn eval_each(
            &self,
            action: &'static str,
            script: &'static str,
            keys: &[String],
            args: &[String],
        ) -> Result<Vec<i64>, RedisError> {
            let sha = redis::Script::new(script).get_hash().to_owned();
            let mut out = self
                .per_key_raw(action, keys, |p, k| {
                    p.cmd("EVALSHA").arg(&sha).arg(1).arg(k).arg(args);
                })
                .await?;
            let missing: Vec<usize> = out
                .iter()
                .enumerate()
                .filter(|(_, v)| {
                    matches!(v, redis::Value::ServerError(e)
                        if e.kind() == Some(redis::ServerErrorKind::NoScript))
                })
                .map(|(i, _)| i)
                .collect();
            if !missing.is_empty() {
                let again: Vec<String> = missing.iter().map(|&i| keys[i].clone()).collect();
                let values = self
                    .per_key_raw(action, &again, |p, k| {
                        p.cmd("EVAL").arg(script).arg(1).arg(k).arg(args);
                    })
                    .await?;
                for (i, v) in missing.into_iter().zip(values) {
                    out[i] = v;
                }
            }
            out.into_iter().map(|v| convert(action, v)).collect()
        }
    }

    /// One reply as `T`; a server error is mapped like any other.
    fn convert<T: FromRedisValue>(action: &'static str, v: redis::Value) -> Result<T, RedisError> {
        match v {
            redis::Value::ServerError(e) => Err(map_err(action, e.into())),
            v => T::from_redis_value(v).map_err(|e| map_err(action, e.into())),
        }
    }

    async fn query_ping<C: ConnectionLike>(
        c: &mut C,
        cmd: &mut redis::Cmd,
        action: &'static str,
    ) -> Result<(), RedisError> {
        let _: redis::Value = cmd.query_async(c).await.map_err(|e| map_err(action, e))?;
        Ok(())
    }
}

/// The redis-rs error mapping against the server at `IDEM_TEST_REDIS_URL` (default
/// `redis://127.0.0.1:6379`): real replies of the client version in use, not made-up
/// errors, so a change in how the client reports them fails here.
#[cfg(all(test, feature = "redis-rs"))]
mod rs_tests {
    use std::time::Duration;

    use super::rs::Lazy;
    use crate::error::RedisError;

    fn url() -> String {
        std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }

    fn fresh_key(tag: &str) -> String {
        format!("idem-test:rs-errors:{tag}:{:016x}", rand::random::<u64>())
    }

    #[tokio::test]
    async fn a_wrong_type_inside_a_pipeline_is_refused() {
        let c = Lazy::new(&url(), &Default::default(), Duration::from_secs(3)).expect("url");
        let list = fresh_key("list");
        let free = fresh_key("free");
        // A list under the key: `SET … GET` answers WRONGTYPE for it.
        c.eval_each(
            "setup",
            "redis.call('RPUSH', KEYS[1], 'x'); redis.call('PEXPIRE', KEYS[1], 60000); return 1",
            std::slice::from_ref(&list),
            &[],
        )
        .await
        .expect("setup");
        let err = c
            .set_nx_get("claim", &[free, list], "token", 60_000)
            .await
            .expect_err("WRONGTYPE");
        assert!(
            matches!(
                err,
                RedisError::Refused {
                    action: "claim",
                    ..
                }
            ) && !err.is_retryable(),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn a_reply_of_the_wrong_type_is_unexpected() {
        let c = Lazy::new(&url(), &Default::default(), Duration::from_secs(3)).expect("url");
        let err = c
            .eval_each("check", "return 'not a number'", &[fresh_key("any")], &[])
            .await
            .expect_err("a string where an integer was expected");
        assert!(
            matches!(
                err,
                RedisError::UnexpectedReply {
                    action: "check",
                    ..
                }
            ),
            "{err:?}"
        );
    }

    /// A script the server has never cached: the `EVALSHA`s answer `NOSCRIPT` and go
    /// again as `EVAL`, which caches it, so the next call's `EVALSHA`s run it at once.
    #[tokio::test]
    async fn a_script_the_server_has_not_cached_is_sent_again_whole() {
        let c = Lazy::new(&url(), &Default::default(), Duration::from_secs(3)).expect("url");
        let script: &'static str = Box::leak(
            format!(
                "-- {:032x}\nreturn tonumber(ARGV[1]) + redis.call('EXISTS', KEYS[1])",
                rand::random::<u128>()
            )
            .into_boxed_str(),
        );
        let sha = redis::Script::new(script).get_hash().to_owned();
        let mut direct = redis::Client::open(url())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        let cached = || redis::cmd("SCRIPT").arg("EXISTS").arg(&sha).clone();
        let before: Vec<i64> = cached().query_async(&mut direct).await.expect("exists");
        assert_eq!(before, [0]);
        let keys = [fresh_key("a"), fresh_key("b")];
        let args = ["41".to_owned()];
        assert_eq!(
            c.eval_each("run", script, &keys, &args).await.expect("run"),
            [41, 41]
        );
        let after: Vec<i64> = cached().query_async(&mut direct).await.expect("exists");
        assert_eq!(after, [1]);
        assert_eq!(
            c.eval_each("run", script, &keys, &args).await.expect("run"),
            [41, 41]
        );
    }

    #[tokio::test]
    async fn a_closed_port_is_unavailable() {
        // Port 1 on loopback: nothing listens there, the connection is refused.
        let c = Lazy::new(
            "redis://127.0.0.1:1",
            &Default::default(),
            Duration::from_secs(1),
        )
        .expect("url");
        let err = c.ping("ping").await.expect_err("nothing listens");
        assert!(
            matches!(err, RedisError::Unavailable { action: "ping", .. }) && err.is_retryable(),
            "{err:?}"
        );
    }
}
