//! Appending to a stream: [`RedisStreamsPublisher`] for the relay, [`publish_raw`] for
//! bodies as they are, and [`pending_count`].

use std::collections::HashMap;

use async_trait::async_trait;
use fred::bytes::Bytes;
use fred::prelude::*;
use idem_core::{OutboxEvent, PublishError, Publisher};

use super::config::RedisStreamsConfig;
use super::{check_name, connect, ensure_group, redis_err, BROKER, PAYLOAD_FIELD};
use crate::BrokerError;

/// How many `XADD`s go in one pipeline.
const PIPELINE: usize = 1_000;

/// Appends outbox events to a Redis stream: `XADD NAME * payload … idem-event-id …
/// idem-event-type …`, pipelined, each reply checked.
pub struct RedisStreamsPublisher {
    client: Client,
    name: String,
    /// How long each `XADD` may go unanswered.
    command_timeout: std::time::Duration,
}

impl std::fmt::Debug for RedisStreamsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamsPublisher")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl RedisStreamsPublisher {
    /// Connects to the server that holds stream `name`.
    ///
    /// # Errors
    /// The server cannot be reached; an invalid URL or name.
    pub async fn connect(url: &str, name: &str) -> Result<Self, BrokerError> {
        check_name(name)?;
        let client = connect(url).await?;
        Self::from_client(client, &RedisStreamsConfig::new(url, name)).await
    }

    /// As [`connect`](Self::connect), through `client`: a client the application built
    /// and connected (`init`) itself, with its own servers, TLS settings, credentials
    /// and reconnect policy, shared with its other uses. Entries go to stream
    /// `config.name`; each `XADD` is timed out after `config.command_timeout`.
    /// `config.url` and the consumer settings of `config` are not used.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use fred::prelude::{Builder, ClientLike, Config};
    /// use idem_broker::redis_streams::{RedisStreamsConfig, RedisStreamsPublisher};
    ///
    /// let client = Builder::from_config(Config::from_url("redis://127.0.0.1:6379/0")?).build()?;
    /// client.init().await?;
    /// let config = RedisStreamsConfig::new("redis://127.0.0.1:6379/0", "grants");
    /// let publisher = RedisStreamsPublisher::from_client(client, &config).await?;
    /// publisher.publish_raw(&[b"{}".to_vec()]).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// An invalid name.
    pub async fn from_client(
        client: Client,
        config: &RedisStreamsConfig,
    ) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        Ok(Self {
            client,
            name: config.name.clone(),
            command_timeout: config.command_timeout,
        })
    }

    async fn add_all(&self, entries: Vec<Vec<(String, Value)>>) -> Result<(), BrokerError> {
        let timeout = self.command_timeout;
        let options = Options {
            timeout: Some(timeout),
            ..Options::default()
        };
        let mut entries = entries.into_iter().peekable();
        while entries.peek().is_some() {
            let pipeline = self.client.pipeline().with_options(&options);
            for fields in entries.by_ref().take(PIPELINE) {
                let _: () = pipeline
                    .xadd(self.name.as_str(), false, None::<()>, "*", fields)
                    .await
                    .map_err(|e| redis_err("XADD", timeout, e))?;
            }
            let results: Vec<Result<Value, Error>> = pipeline.try_all().await;
            for r in results {
                r.map_err(|e| redis_err("XADD", timeout, e))?;
            }
        }
        Ok(())
    }

    /// As [`publish_raw`](Self::publish_raw), each entry with `headers` as fields
    /// beside the body (a header named [`PAYLOAD_FIELD`] is left out: that field is the
    /// body).
    ///
    /// # Errors
    /// As [`publish_raw`](Self::publish_raw).
    pub async fn publish_raw_with_headers(
        &self,
        bodies: &[Vec<u8>],
        headers: &[(String, String)],
    ) -> Result<(), BrokerError> {
        let entries = bodies
            .iter()
            .map(|b| {
                let mut fields: Vec<(String, Value)> = headers
                    .iter()
                    .filter(|(k, _)| k != PAYLOAD_FIELD)
                    .map(|(k, v)| (k.clone(), Value::from(v.clone())))
                    .collect();
                fields.push((
                    PAYLOAD_FIELD.to_owned(),
                    Value::Bytes(Bytes::copy_from_slice(b)),
                ));
                fields
            })
            .collect();
        self.add_all(entries).await
    }
}

#[async_trait]
impl Publisher for RedisStreamsPublisher {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        let entries = events
            .iter()
            .map(|e| {
                let mut fields: Vec<(String, Value)> = e
                    .headers()
                    .into_iter()
                    .map(|(k, v)| (k, Value::from(v)))
                    .collect();
                fields.push((
                    PAYLOAD_FIELD.to_owned(),
                    Value::Bytes(Bytes::copy_from_slice(&e.payload)),
                ));
                fields
            })
            .collect();
        self.add_all(entries).await.map_err(Into::into)
    }
}

crate::raw::raw_publishing! {
    /// Appends each body as it is, in order.
    ///
    /// # Errors
    /// A refused or failed `XADD`; bodies before it may have been appended.
    method of RedisStreamsPublisher;
    /// Appends each body to stream `name` as it is (see
    /// [`RedisStreamsPublisher::publish_raw`]).
    ///
    /// # Errors
    /// As [`RedisStreamsPublisher::connect`] and [`RedisStreamsPublisher::publish_raw`].
    fn publish_raw(url: &str, name: &str);
}

/// What group `group` of stream `name` has not settled: its lag (entries not yet
/// delivered to the group) plus its pending entries (delivered, not acked). The stream
/// and group are created if missing.
///
/// # Errors
/// The server cannot be reached, or reports no lag (Redis older than 7).
pub async fn pending_count(url: &str, name: &str, group: &str) -> Result<u64, BrokerError> {
    check_name(name)?;
    let client = connect(url).await?;
    ensure_group(&client, name, group).await?;
    let groups: Vec<HashMap<String, Value>> = client
        .xinfo_groups(name)
        .await
        .map_err(|e| BrokerError::op(BROKER, "XINFO GROUPS", e))?;
    let info = groups
        .into_iter()
        .find(|g| g.get("name").and_then(Value::as_str).as_deref() == Some(group))
        .ok_or_else(|| BrokerError::Operation {
            broker: BROKER,
            action: "XINFO GROUPS",
            retryable: true,
            source: format!("group {group:?} not found").into(),
        })?;
    let num = |k: &str| info.get(k).and_then(Value::as_u64);
    let pending = num("pending").unwrap_or(0);
    let lag = match num("lag") {
        Some(lag) => lag,
        None => {
            // No lag (Redis < 7, or an entry deleted inside the group's range).
            let len: u64 = client
                .xlen(name)
                .await
                .map_err(|e| BrokerError::op(BROKER, "XLEN", e))?;
            len.saturating_sub(num("entries-read").unwrap_or(0))
        }
    };
    let _ = client.quit().await;
    Ok(lag + pending)
}
