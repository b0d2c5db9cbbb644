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
    /// With whether its nodes may be reached over TLS.
    Cluster(Box<ClusterClient>, bool),
}

impl Target {
    /// Whether redis-rs may open a TLS connection for it (and so build a rustls
    /// configuration from the process default).
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    fn may_use_tls(&self) -> bool {
        match self {
            Self::Single(client) => matches!(
                client.get_connection_info().addr(),
                redis::ConnectionAddr::TcpTls { .. }
            ),
            Self::Cluster(_, tls) => *tls,
        }
    }
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
        let tls = nodes.iter().any(|n| crate::tls::scheme_asks_for_tls(n));
        Ok(Self::with_target(
            Target::Cluster(Box::new(client), tls),
            timeout,
        ))
    }

    /// Over a client the application built.
    pub(super) fn from_client(client: redis::Client, timeout: Duration) -> Self {
        Self::with_target(Target::Single(Box::new(client)), timeout)
    }

    /// Over a cluster client the application built (which does not tell whether its nodes
    /// speak TLS: taken as possibly TLS).
    pub(super) fn from_cluster_client(client: ClusterClient, timeout: Duration) -> Self {
        Self::with_target(Target::Cluster(Box::new(client), true), timeout)
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
        // redis-rs builds the rustls configuration of each TLS connection (this one and
        // every reconnection) from rustls's process default, and takes none.
        #[cfg(feature = "tls")]
        if self.0.target.may_use_tls() {
            crate::tls::install_default_provider_for_redis_rs();
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
            Target::Cluster(client, _) => Live::Cluster(
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
                            detail: format!("{} replies for {} commands", values.len(), idx.len()),
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
        if let Target::Cluster(..) = self.0.target {
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
