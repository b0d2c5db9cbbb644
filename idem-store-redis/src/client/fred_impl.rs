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

/// `tls`: files given with a `rediss://` URL. A TLS URL's connector is idem's rustls
/// configuration (`tls::rustls_config`, the `ring` provider named in it), never the one
/// fred would build from rustls's process default (`tls::plain_twin` says why).
#[cfg_attr(not(feature = "tls"), allow(unused_variables))]
pub(super) async fn open(
    url: &str,
    tls: &crate::tls::TlsFiles,
    timeout: Duration,
    wait: bool,
) -> Result<Client, RedisError> {
    let unreadable = |e: Error| RedisError::Config(format!("{:?}: {e}", idem_core::Redacted(url)));
    #[cfg(feature = "tls")]
    let mut config = match crate::tls::plain_twin(url) {
        Some(plain) => {
            let mut config = Config::from_url(&plain).map_err(unreadable)?;
            config.tls = Some(crate::tls::rustls_config(tls)?.into());
            config
        }
        None => Config::from_url(url).map_err(unreadable)?,
    };
    // A TLS URL is refused before (`RedisConfig::validate`).
    #[cfg(not(feature = "tls"))]
    let mut config = Config::from_url(url).map_err(unreadable)?;
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
        let cmd = CustomCommand::new_static("EVAL", fred::util::redis_keyslot(k.as_bytes()), false);
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
