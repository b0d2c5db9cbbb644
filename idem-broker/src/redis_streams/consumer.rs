//! Consuming a stream through a consumer group: [`RedisStreamsConsumer`] and its
//! [`RedisStreamsAcker`].
//!
//! Every entry this consumer holds (read, waiting in a buffer, or in work) has its idle
//! time reset every third of `min_idle` by a keep-alive task (`XCLAIM … JUSTID`, only for
//! entries the group still assigns to this consumer), so `XAUTOCLAIM` by any consumer
//! takes only the entries of a consumer that stopped.
//!
//! A deferral ([`Acker::defer`]: a key held by another transaction, a store outage) is
//! held here, alive, and handed back into the consumer's stream after its delay with the
//! same attempt, re-read with `XRANGE`: it costs no delivery in the group's count, so the
//! count holds the runs of a message only (a nack, which releases the entry to be taken
//! again, and a consumer that died holding it).

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use fred::bytes::Bytes;
use fred::prelude::*;
use fred::types::streams::XReadResponse;
use futures::stream::BoxStream;
use futures::Stream;
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::config::RedisStreamsConfig;
use super::{check_name, client_for, connect_like, ensure_group, redis_err, BROKER, PAYLOAD_FIELD};
use crate::names::carried_to_dead_letter;
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

/// How often pending entries of silent consumers are looked for.
const CLAIM_EVERY: Duration = Duration::from_secs(1);

/// How often a reader whose deferrals fill the prefetch looks for one that came back.
const HELD_POLL: Duration = Duration::from_millis(20);

/// Resets the idle time of the given entries that the group still assigns to this
/// consumer; returns the ids that are no longer this consumer's (acked, or taken over).
const KEEP_ALIVE: &str = r"
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] ~= nil and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
";

/// Removes, atomically, the group's other consumers that have no pending entries and
/// have been idle at least ARGV[3] ms; returns their names.
const FORGET_IDLE: &str = r"
local removed = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for j = 1, #c, 2 do f[c[j]] = c[j + 1] end
  if f['name'] ~= ARGV[2] and tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    table.insert(removed, f['name'])
  end
end
return removed
";

struct Shared {
    writer: Client,
    name: String,
    group: String,
    consumer: String,
    dead_letter: String,
    min_idle: Duration,
    /// How long a command may go unanswered (the reads' block time comes on top).
    command_timeout: Duration,
    /// Entries taken and not settled (registration id → entry id), kept alive.
    live: Mutex<HashMap<u64, String>>,
    next_id: AtomicU64,
    /// Into the reader: deferred entries, handed back after their delay.
    held: mpsc::UnboundedSender<Held>,
    /// Deferred entries on their way back (held, or in the channel): counted against the
    /// prefetch, so deferrals that fill it stop the reads.
    holding: AtomicUsize,
}

/// A deferred entry on its way back into the consumer's stream, still registered (kept
/// alive) under `reg`.
struct Held {
    id: String,
    reg: u64,
    attempt: u32,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Shared {
    fn register(&self, entry: &str) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.live).insert(id, entry.to_owned());
        id
    }

    fn forget(&self, id: u64) {
        lock(&self.live).remove(&id);
    }

    /// One keep-alive round over every live entry.
    async fn keep_alive(&self) -> Result<(), Error> {
        let entries: Vec<String> = {
            let live = lock(&self.live);
            let mut v: Vec<String> = live.values().cloned().collect();
            v.sort();
            v.dedup();
            v
        };
        for chunk in entries.chunks(500) {
            let mut args: Vec<String> = Vec::with_capacity(chunk.len() + 2);
            args.push(self.group.clone());
            args.push(self.consumer.clone());
            args.extend(chunk.iter().cloned());
            let lost: Vec<String> = self
                .writer
                .eval(KEEP_ALIVE, vec![self.name.as_str()], args)
                .await?;
            if !lost.is_empty() {
                tracing::debug!(target: "idem::broker", broker = BROKER, lost = lost.len(), "entries no longer held by this consumer");
                lock(&self.live).retain(|_, e| !lost.contains(e));
            }
        }
        Ok(())
    }

    async fn xack(&self, ids: Vec<String>) -> Result<(), AckError> {
        let _: i64 = self
            .writer
            .xack(self.name.as_str(), self.group.as_str(), ids)
            .await
            .map_err(|e| AckError::from(redis_err("XACK", self.command_timeout, e)))?;
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
            .map_err(|e| AckError::from(redis_err("XCLAIM", self.command_timeout, e)))?;
        Ok(())
    }
}

/// Resets the idle time of every live entry every `every`, until the consumer and all
/// its ackers are gone.
fn spawn_keep_alive(shared: Weak<Shared>, every: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(shared) = shared.upgrade() else {
                return;
            };
            if let Err(e) = shared.keep_alive().await {
                tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "keep-alive (XCLAIM JUSTID) failed");
            }
        }
    });
}

/// Deliveries of a Redis stream's consumer group, as a stream of
/// `Result<Delivery<RedisStreamsAcker>, BrokerError>`: new entries (`XREADGROUP`) and,
/// every second, entries left pending longer than `min_idle` by any consumer of the
/// group (`XAUTOCLAIM`).
///
/// Every command has a timeout ([`RedisStreamsConfig::command_timeout`], with the block
/// time on top for `XREADGROUP`): a server that stops answering ends the stream with
/// [`BrokerError::Timeout`] instead of hanging it.
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
    /// Deferred entries whose delay has passed.
    held: mpsc::UnboundedReceiver<Held>,
}

type Entry = (String, HashMap<String, Value>);

impl Drop for Reader {
    /// Deferred entries handed back after the stream was dropped are let go at once.
    fn drop(&mut self) {
        while let Ok(held) = self.held.try_recv() {
            self.shared.forget(held.reg);
        }
    }
}

impl Reader {
    /// Buffers `entries`, registering each for the keep-alive; `attempts` maps an entry
    /// id to its delivery count (a new entry's is 1).
    fn push(&mut self, entries: Vec<Entry>, attempts: &HashMap<String, u64>) {
        for (id, fields) in entries {
            let attempt = attempts
                .get(&id)
                .map_or(1, |n| u32::try_from(*n).unwrap_or(u32::MAX).max(1));
            let reg = self.shared.register(&id);
            let d = delivery(&self.shared, id, fields, reg, attempt);
            self.buf.push_back(d);
        }
    }

    /// Buffers the deferred entries whose delay has passed, re-read from the stream, each
    /// with its registration (it was kept alive while held) and its attempt. An entry no
    /// longer in the stream (trimmed or deleted meanwhile) has nothing left to deliver: it
    /// is let go, and `XAUTOCLAIM` drops it from the pending list.
    async fn take_back_held(&mut self) -> Result<(), BrokerError> {
        while let Ok(held) = self.held.try_recv() {
            self.shared.holding.fetch_sub(1, Ordering::AcqRel);
            let s = Arc::clone(&self.shared);
            let found: Vec<Entry> = match self
                .reader
                .xrange_values(s.name.as_str(), held.id.as_str(), held.id.as_str(), Some(1))
                .await
            {
                Ok(found) => found,
                Err(e) => {
                    s.forget(held.reg);
                    return Err(redis_err("XRANGE (a deferred entry)", s.command_timeout, e));
                }
            };
            let Some((id, fields)) = found.into_iter().find(|(id, _)| *id == held.id) else {
                tracing::warn!(target: "idem::broker", broker = BROKER, entry = %held.id, "a deferred entry is no longer in the stream; nothing to deliver");
                s.forget(held.reg);
                continue;
            };
            self.buf
                .push_back(delivery(&s, id, fields, held.reg, held.attempt));
        }
        Ok(())
    }
}

/// The delivery of entry `id`, registered for the keep-alive under `reg`.
fn delivery(
    shared: &Arc<Shared>,
    id: String,
    mut fields: HashMap<String, Value>,
    reg: u64,
    attempt: u32,
) -> Delivery<RedisStreamsAcker> {
    let payload = fields
        .remove(PAYLOAD_FIELD)
        .map(value_bytes)
        .unwrap_or_default();
    let mut headers: Headers = fields
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&value_bytes(v)).into_owned()))
        .collect();
    headers.sort();
    Delivery {
        payload,
        headers,
        attempt: Some(attempt),
        acker: RedisStreamsAcker {
            id,
            reg,
            attempt,
            shared: Arc::clone(shared),
        },
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
            // A deferred entry comes back here at most one `block` after its delay.
            self.take_back_held().await?;
            if !self.buf.is_empty() {
                continue;
            }
            if self.shared.holding.load(Ordering::Acquire) as u64 >= self.count {
                // Deferrals fill the prefetch: nothing new is read or taken over until
                // they come back (memory stays bounded however long they wait).
                tokio::time::sleep(HELD_POLL).await;
                continue;
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
                    .map_err(|e| redis_err("XAUTOCLAIM", s.command_timeout, e))?;
                if cursor == "0-0" {
                    // The whole pending list was scanned: look again in a while.
                    self.next_claim = Instant::now() + CLAIM_EVERY;
                }
                self.cursor = cursor;
                let mut attempts = HashMap::new();
                if let (Some(first), Some(last)) = (entries.first(), entries.last()) {
                    tracing::debug!(target: "idem::broker", broker = BROKER, claimed = entries.len(), "took over idle pending entries");
                    // XAUTOCLAIM counted the delivery; read the counts back.
                    let pending: Vec<(String, String, u64, u64)> = self
                        .reader
                        .xpending(
                            s.name.as_str(),
                            s.group.as_str(),
                            (
                                first.0.as_str(),
                                last.0.as_str(),
                                self.count.max(entries.len() as u64),
                                s.consumer.as_str(),
                            ),
                        )
                        .await
                        .map_err(|e| redis_err("XPENDING", s.command_timeout, e))?;
                    attempts = pending.into_iter().map(|(id, _, _, n)| (id, n)).collect();
                }
                self.push(entries, &attempts);
                continue;
            }
            let until_claim = self.next_claim.saturating_duration_since(Instant::now());
            let block = self.block.min(until_claim).max(Duration::from_millis(1));
            // The server answers a blocking read after its block time at the latest.
            let timeout = block + s.command_timeout;
            let raw: Value = self
                .reader
                .with_options(&Options {
                    timeout: Some(timeout),
                    ..Options::default()
                })
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
                .map_err(|e| redis_err("XREADGROUP", timeout, e))?;
            if raw.is_null() {
                // The block time passed with nothing new.
                continue;
            }
            let resp: XReadResponse<String, String, String, Value> = raw
                .into_xread_response()
                .map_err(|e| BrokerError::op(BROKER, "XREADGROUP reply", e))?;
            for (_key, entries) in resp {
                self.push(entries, &HashMap::new());
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
        let client = client_for(&config.url, config.command_timeout)?;
        Self::from_client(client, config).await
    }

    /// As [`connect`](Self::connect), with the configuration of `client`, a client the
    /// application built itself: its servers (centralized, cluster or sentinel), TLS
    /// settings, credentials or credential provider, connection settings and reconnect
    /// policy. The consumer opens two connections of its own with that configuration
    /// (one blocks in `XREADGROUP`, one settles), each command timed out after
    /// `config.command_timeout`; `client` itself is not used and need not be connected.
    /// `config.url` is not used; everything else in `config` is.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use fred::prelude::{Builder, Config};
    /// use futures::StreamExt;
    /// use idem_broker::redis_streams::{RedisStreamsConfig, RedisStreamsConsumer};
    ///
    /// let client = Builder::from_config(Config::from_url("redis://127.0.0.1:6379/0")?)
    ///     .with_connection_config(|c| c.connection_timeout = std::time::Duration::from_secs(2))
    ///     .build()?;
    /// let config =
    ///     RedisStreamsConfig::new("redis://127.0.0.1:6379/0", "grants").with_group("billing");
    /// let mut deliveries = RedisStreamsConsumer::from_client(client, &config).await?;
    /// while let Some(delivery) = deliveries.next().await {
    ///     let delivery = delivery?;
    ///     // hand it to an `idem_engine::Gate`, which acks only after the commit
    /// #   drop(delivery);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the server cannot be reached; an invalid name.
    pub async fn from_client(
        client: Client,
        config: &RedisStreamsConfig,
    ) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        let writer = connect_like(&client, config.command_timeout).await?;
        let reader = connect_like(&client, config.command_timeout).await?;
        ensure_group(&writer, &config.name, &config.group).await?;
        let removed: Vec<String> = writer
            .eval(
                FORGET_IDLE,
                vec![config.name.as_str()],
                vec![
                    config.group.clone(),
                    config.consumer.clone(),
                    ms(config.forget_after).to_string(),
                ],
            )
            .await
            .map_err(|e| {
                redis_err(
                    "XGROUP DELCONSUMER (idle consumers)",
                    config.command_timeout,
                    e,
                )
            })?;
        if !removed.is_empty() {
            tracing::info!(target: "idem::broker", broker = BROKER, removed = removed.len(), "removed idle consumers with nothing pending from the group");
        }
        let (held_tx, held_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            writer,
            name: config.name.clone(),
            group: config.group.clone(),
            consumer: config.consumer.clone(),
            dead_letter: dead_letter_name(&config.name),
            min_idle: config.min_idle,
            command_timeout: config.command_timeout,
            live: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            held: held_tx,
            holding: AtomicUsize::new(0),
        });
        spawn_keep_alive(Arc::downgrade(&shared), config.keep_alive_every());
        let state = Reader {
            reader,
            shared,
            buf: VecDeque::new(),
            cursor: "0-0".to_owned(),
            next_claim: Instant::now(),
            count: u64::try_from(config.prefetch.max(1)).unwrap_or(u64::MAX),
            block: config.block,
            held: held_rx,
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

/// Settles one stream entry in its consumer group. While it lives unsettled, the entry
/// is kept alive; dropped unsettled, the keep-alive stops and the entry is taken over
/// (by any consumer of the group) once idle for `min_idle`.
pub struct RedisStreamsAcker {
    id: String,
    reg: u64,
    attempt: u32,
    shared: Arc<Shared>,
}

impl Drop for RedisStreamsAcker {
    fn drop(&mut self) {
        self.shared.forget(self.reg);
    }
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
        self.shared.forget(self.reg);
        self.shared.xack(vec![self.id.clone()]).await
    }

    /// Releases the entry: it stays pending, made to look idle so that `XAUTOCLAIM` (by
    /// any consumer of the group) takes it again after `delay`, which counts a delivery —
    /// the attempt that failed.
    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.shared.forget(self.reg);
        self.shared
            .release(&self.id, delay.unwrap_or(Duration::ZERO))
            .await
    }

    /// Held here, alive (the keep-alive goes on resetting its idle time), and handed back
    /// into this consumer's stream after `delay` with the same attempt: a deferral is not
    /// an attempt, and the group counts no delivery. If the consumer's stream is dropped
    /// first, the keep-alive stops at once and the entry is taken over after `min_idle`.
    async fn defer(self, delay: Duration) -> Result<(), AckError> {
        let shared = Arc::clone(&self.shared);
        // Registered again before this acker's registration is dropped: the entry is kept
        // alive without a gap.
        let held = Held {
            id: self.id.clone(),
            reg: shared.register(&self.id),
            attempt: self.attempt,
        };
        drop(self);
        let weak = Arc::downgrade(&shared);
        shared.holding.fetch_add(1, Ordering::AcqRel);
        crate::hold::hand_back_after(shared.held.clone(), held, delay, move |held| {
            if let Some(shared) = weak.upgrade() {
                shared.holding.fetch_sub(1, Ordering::AcqRel);
                shared.forget(held.reg);
            }
        });
        Ok(())
    }

    /// True: a deferral is held here without a delivery, and the keep-alive's `XCLAIM …
    /// JUSTID` counts none, so an entry's delivery count holds its failed runs (each nack
    /// releases it to be taken again) and the takeovers after a consumer died holding it.
    fn attempt_counts_runs(&self) -> bool {
        true
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let mut fields: Vec<(String, Value)> =
            carried_to_dead_letter(headers, |k| k == PAYLOAD_FIELD)
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
        // Settled either way: acked, or left pending to be taken again after `min_idle`
        // (not at once: no hot loop on a failing dead-letter stream).
        self.shared.forget(self.reg);
        match added {
            Ok(_) => self.shared.xack(vec![self.id.clone()]).await,
            Err(e) if refused_for_good(&e) => Err(BrokerError::dead_letter_refused(
                BROKER,
                &format!("the dead-letter stream {:?}", self.shared.dead_letter),
                &e.to_string(),
                "pending",
                "make that key a stream (or delete it) and let this user XADD to it",
            )
            .into()),
            Err(e) => Err(redis_err("XADD dead-letter", self.shared.command_timeout, e).into()),
        }
    }

    /// One `XACK` for the whole batch.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        let Some(shared) = crate::batch::one_connection(&items, |a| &a.shared) else {
            return Self::ack_each(items).await;
        };
        let ids: Vec<String> = items
            .into_iter()
            .map(|(a, _)| {
                a.shared.forget(a.reg);
                a.id.clone()
            })
            .collect();
        crate::batch::each_of(ids.len(), shared.xack(ids).await)
    }
}

/// Whether Redis refuses a dead letter's `XADD` for good, whatever the message: the
/// dead-letter key holds another type (`WRONGTYPE`), or the user may not write it
/// (`NOPERM`, an ACL). A retry cannot help, and a dead letter left pending would come
/// back after `min_idle` for ever.
fn refused_for_good(e: &Error) -> bool {
    matches!(e.kind(), fred::error::ErrorKind::InvalidArgument) || e.details().starts_with("NOPERM")
}
