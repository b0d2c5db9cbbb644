//! Consuming a stream through a consumer group: [`RedisStreamsConsumer`] and its
//! [`RedisStreamsAcker`].

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use fred::bytes::Bytes;
use fred::prelude::*;
use fred::types::streams::XReadResponse;
use futures::stream::BoxStream;
use futures::Stream;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};
use tokio::time::Instant;

use super::config::RedisStreamsConfig;
use super::{check_name, connect, ensure_group, BROKER, PAYLOAD_FIELD};
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

/// How often pending entries of silent consumers are looked for.
const CLAIM_EVERY: Duration = Duration::from_secs(1);

struct Shared {
    writer: Client,
    name: String,
    group: String,
    consumer: String,
    dead_letter: String,
    min_idle: Duration,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Shared {
    async fn xack(&self, ids: Vec<String>) -> Result<(), AckError> {
        let _: i64 = self
            .writer
            .xack(self.name.as_str(), self.group.as_str(), ids)
            .await
            .map_err(|e| AckError::from(BrokerError::op(BROKER, "XACK", e)))?;
        Ok(())
    }

    /// Leaves `id` pending but makes it look idle for `min_idle - delay`, so `XAUTOCLAIM`
    /// takes it again after `delay`.
    async fn release(&self, id: &str, delay: Duration) -> Result<(), AckError> {
        let idle = ms(self.min_idle.saturating_sub(delay));
        let _: Value = self
            .writer
            .xclaim(
                self.name.as_str(),
                self.group.as_str(),
                self.consumer.as_str(),
                0,
                id,
                Some(idle),
                None,
                None,
                false,
                true,
            )
            .await
            .map_err(|e| AckError::from(BrokerError::op(BROKER, "XCLAIM", e)))?;
        Ok(())
    }
}

/// Deliveries of a Redis stream's consumer group, as a stream of
/// `Result<Delivery<RedisStreamsAcker>, BrokerError>`: new entries (`XREADGROUP`) and,
/// every second, entries left pending longer than `min_idle` by any consumer of the
/// group (`XAUTOCLAIM`).
pub struct RedisStreamsConsumer {
    inner: BoxStream<'static, Result<Delivery<RedisStreamsAcker>, BrokerError>>,
    name: String,
    consumer: String,
}

impl std::fmt::Debug for RedisStreamsConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamsConsumer")
            .field("name", &self.name)
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

struct Reader {
    reader: Client,
    shared: Arc<Shared>,
    buf: VecDeque<Delivery<RedisStreamsAcker>>,
    cursor: String,
    next_claim: Instant,
    count: u64,
    block: Duration,
}

type Entry = (String, HashMap<String, Value>);

impl Reader {
    fn push(&mut self, entries: Vec<Entry>) {
        for (id, mut fields) in entries {
            let payload = fields
                .remove(PAYLOAD_FIELD)
                .map(value_bytes)
                .unwrap_or_default();
            let mut headers: Headers = fields
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&value_bytes(v)).into_owned()))
                .collect();
            headers.sort();
            self.buf.push_back(Delivery {
                payload,
                headers,
                attempt: None,
                acker: RedisStreamsAcker {
                    id,
                    shared: Arc::clone(&self.shared),
                },
            });
        }
    }
}

impl crate::pull::Pull for Reader {
    type Acker = RedisStreamsAcker;

    async fn next(&mut self) -> Result<Delivery<RedisStreamsAcker>, BrokerError> {
        let s = Arc::clone(&self.shared);
        loop {
            if let Some(d) = self.buf.pop_front() {
                return Ok(d);
            }
            if Instant::now() >= self.next_claim {
                let (cursor, entries): (String, Vec<Entry>) = self
                    .reader
                    .xautoclaim_values(
                        s.name.as_str(),
                        s.group.as_str(),
                        s.consumer.as_str(),
                        ms(s.min_idle),
                        self.cursor.as_str(),
                        Some(self.count),
                        false,
                    )
                    .await
                    .map_err(|e| BrokerError::op(BROKER, "XAUTOCLAIM", e))?;
                if cursor == "0-0" {
                    // The whole pending list was scanned: look again in a while.
                    self.next_claim = Instant::now() + CLAIM_EVERY;
                }
                self.cursor = cursor;
                if !entries.is_empty() {
                    tracing::debug!(target: "idem::broker", broker = BROKER, claimed = entries.len(), "took over idle pending entries");
                }
                self.push(entries);
                continue;
            }
            let until_claim = self.next_claim.saturating_duration_since(Instant::now());
            let block = self.block.min(until_claim).max(Duration::from_millis(1));
            let raw: Value = self
                .reader
                .xreadgroup(
                    s.group.as_str(),
                    s.consumer.as_str(),
                    Some(self.count),
                    Some(ms(block)),
                    false,
                    s.name.as_str(),
                    ">",
                )
                .await
                .map_err(|e| BrokerError::op(BROKER, "XREADGROUP", e))?;
            if raw.is_null() {
                // The block time passed with nothing new.
                continue;
            }
            let resp: XReadResponse<String, String, String, Value> = raw
                .into_xread_response()
                .map_err(|e| BrokerError::op(BROKER, "XREADGROUP reply", e))?;
            for (_key, entries) in resp {
                self.push(entries);
            }
        }
    }
}

fn value_bytes(v: Value) -> Vec<u8> {
    match v {
        Value::Bytes(b) => b.to_vec(),
        Value::String(s) => s.as_bytes().to_vec(),
        Value::Null => Vec::new(),
        other => other
            .as_str()
            .map(|s| s.as_bytes().to_vec())
            .unwrap_or_default(),
    }
}

impl RedisStreamsConsumer {
    /// Connects (one connection reads, blocking; one settles), creates the stream and
    /// group if missing, and starts reading.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the server cannot be reached; an invalid URL or name.
    pub async fn connect(config: &RedisStreamsConfig) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        let writer = connect(&config.url).await?;
        let reader = connect(&config.url).await?;
        ensure_group(&writer, &config.name, &config.group).await?;
        let shared = Arc::new(Shared {
            writer,
            name: config.name.clone(),
            group: config.group.clone(),
            consumer: config.consumer.clone(),
            dead_letter: dead_letter_name(&config.name),
            min_idle: config.min_idle,
        });
        let state = Reader {
            reader,
            shared,
            buf: VecDeque::new(),
            cursor: "0-0".to_owned(),
            next_claim: Instant::now(),
            count: u64::try_from(config.prefetch.max(1)).unwrap_or(u64::MAX),
            block: config.block,
        };
        Ok(Self {
            inner: crate::pull::deliveries(state),
            name: config.name.clone(),
            consumer: config.consumer.clone(),
        })
    }

    /// This consumer's name in the group.
    pub fn consumer_name(&self) -> &str {
        &self.consumer
    }
}

impl Stream for RedisStreamsConsumer {
    type Item = Result<Delivery<RedisStreamsAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// Settles one stream entry in its consumer group.
pub struct RedisStreamsAcker {
    id: String,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RedisStreamsAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamsAcker")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl RedisStreamsAcker {
    /// The entry's id.
    pub fn entry_id(&self) -> &str {
        &self.id
    }
}

#[async_trait]
impl Acker for RedisStreamsAcker {
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        self.shared.xack(vec![self.id]).await
    }

    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.shared
            .release(&self.id, delay.unwrap_or(Duration::ZERO))
            .await
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let mut fields: Vec<(String, Value)> = headers
            .iter()
            .filter(|(k, _)| k != PAYLOAD_FIELD && k != DEAD_LETTER_REASON_HEADER)
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        fields.push((
            DEAD_LETTER_REASON_HEADER.to_owned(),
            Value::from(reason.to_string()),
        ));
        fields.push((
            PAYLOAD_FIELD.to_owned(),
            Value::Bytes(Bytes::copy_from_slice(payload)),
        ));
        let added: Result<Value, Error> = self
            .shared
            .writer
            .xadd(
                self.shared.dead_letter.as_str(),
                false,
                None::<()>,
                "*",
                fields,
            )
            .await;
        match added {
            Ok(_) => self.shared.xack(vec![self.id]).await,
            // Not dead-lettered: the entry stays pending and is taken again later.
            Err(e) => Err(BrokerError::op(BROKER, "XADD dead-letter", e).into()),
        }
    }

    /// One `XACK` for the whole batch.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        let n = items.len();
        let Some((first, _)) = items.first() else {
            return Vec::new();
        };
        let shared = Arc::clone(&first.shared);
        if !items.iter().all(|(a, _)| Arc::ptr_eq(&a.shared, &shared)) {
            let mut out = Vec::with_capacity(n);
            for (a, proof) in items {
                out.push(a.ack(proof).await);
            }
            return out;
        }
        let ids: Vec<String> = items.into_iter().map(|(a, _)| a.id).collect();
        match shared.xack(ids).await {
            Ok(()) => (0..n).map(|_| Ok(())).collect(),
            Err(e) => (0..n)
                .map(|_| Err(AckError::new(e.message.clone(), e.retryable, None)))
                .collect(),
        }
    }
}
