//! Consuming a stream through a durable pull consumer: [`NatsConsumer`] and its
//! [`NatsAcker`].
//!
//! - **Fetching**: a background task asks the server for as many deliveries as the
//!   prefetch has room for (one pull request at a time, [`NatsConfig::prefetch`] in all,
//!   a new request once half of it is taken) and reads each one as it arrives, so a
//!   delivery is kept alive from the moment it is received: nothing waits unseen in the
//!   client's buffer.
//! - **Keeping alive**: every delivery received and not settled — waiting in the
//!   prefetch, in the gate's hands, or held after a nack — gets `+WPI` (work in progress)
//!   every third of the ack wait, so the server redelivers it only when this process
//!   loses it (a crash, a lost connection, an acker dropped unsettled).
//! - **Handing back**: a nack with a delay and a deferral are held here, alive, and come
//!   out of this consumer's stream again after the delay, without a round trip through
//!   the server: the server counts a delivery for each `-NAK` (towards `max_deliver`),
//!   so a key held elsewhere for minutes or a store down for ten would otherwise end with
//!   the message never delivered again. A nack counts as an attempt (the delivery comes
//!   back with `attempt + 1`, as a `-NAK` would have); a deferral ([`NatsAcker::defer`])
//!   does not. Held deliveries count against the prefetch until they come back: while
//!   they fill it no pull is made, so memory stays bounded however long the store makes
//!   them wait.
//! - **Settling**: every settlement is confirmed: the ack (`+ACK`, `-NAK`, `+TERM`) is
//!   sent as a request and the server's reply awaited, so `Ok` means the server has it.
//! - **One at a time around a rerun**: a delivery the server delivered before (its
//!   `delivered` count past 1) may be one whose run killed the last process. While one is
//!   held here unsettled, no pull is made; after it settles, and when the consumer
//!   starts, the next pull asks for one delivery and waits for it. Only a first delivery
//!   (count 1) answering it opens the prefetch again, and then with requests that take
//!   what the server has at that moment and end (`no_wait`): no request stays open for
//!   deliveries lost by a dead process to come due into, several at once. So when a
//!   message kills its process, the server counts a delivery for the neighbours that sat
//!   in that process's prefetch once, at the first death, and not again for each later
//!   run of it or of another killer in the same window: three killers in one window
//!   strand no neighbour at `max_deliver`. (A rerun due in the instant between a first
//!   delivery and the next request can still arrive beside others. A server before
//!   2.11.11 may leave a `no_wait` request it gave nothing open: the stream then ends
//!   after 10 s of silence with the missed-heartbeat error, and the supervisor reconnects.)
//! - **The server's limit**: `MAX_DELIVERIES` advisories of the durable are logged and
//!   counted ([`NatsConsumer::max_deliveries`]).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::pull::{self, BatchConfig};
use async_nats::jetstream::consumer::AckPolicy;
use async_nats::jetstream::context::ConsumerInfoErrorKind;
use async_nats::jetstream::message::AckKind;
use async_nats::{StatusCode, Subject};
use async_trait::async_trait;
use futures::{Stream, StreamExt};
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};
use tokio::sync::{mpsc, Notify};

use super::config::NatsConfig;
use super::publisher::publish_confirmed;
use super::{check_name, connect_client, ensure_stream, open_stream, stream_name, BROKER};
use crate::names::carried_to_dead_letter;
use crate::{dead_letter_name, BrokerError, DEAD_LETTER_REASON_HEADER};

/// How long a settlement waits for the server's confirmation.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the server keeps a pull request waiting for messages.
const PULL_EXPIRES: Duration = Duration::from_secs(30);
/// How often the server signals that an idle pull request is alive; two missed in a row
/// end the stream with an error (a server that stays down is reported, not waited for).
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);
/// How long a failed dead-letter publish holds the delivery before handing it back.
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(5);

/// A delivery received and not yet taken from the consumer's stream.
struct Taken {
    /// The key of its entry in [`Shared::live`].
    id: u64,
    reply: Subject,
    message: Box<async_nats::Message>,
    /// The attempt it is yielded with.
    attempt: Option<u32>,
    /// Counts against the prefetch until it is yielded: fetched from the server, or
    /// held after a deferral or a delayed nack (so held deliveries that fill the
    /// prefetch stop the pulls, and memory stays bounded however long the store makes
    /// them wait).
    fresh: bool,
}

/// What the consumer's stream yields next.
enum Ready {
    Taken(Taken),
    /// The fetcher stopped: the stream ends with this error.
    Failed(BrokerError),
}

struct Shared {
    client: async_nats::Client,
    js: jetstream::Context,
    dead_letter_subject: String,
    /// Deliveries received and not settled: their ack subjects, kept alive with `+WPI`.
    live: Mutex<HashMap<u64, Subject>>,
    next_id: AtomicU64,
    /// Into the consumer's stream: fetched deliveries, and held ones handed back.
    ready: mpsc::UnboundedSender<Ready>,
    /// Fetched deliveries in `ready`, not yet taken.
    buffered: AtomicUsize,
    /// Wakes the fetcher when a fetched delivery is taken, or a rerun settled.
    room: Notify,
    /// The ids in `live` of deliveries the server delivered before (a rerun): while one
    /// is held, no pull is made.
    reruns: Mutex<std::collections::HashSet<u64>>,
    /// `close` was called: nothing is held any more.
    closed: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn register(&self, reply: Subject) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.live).insert(id, reply);
        id
    }

    fn forget(&self, id: u64) {
        lock(&self.live).remove(&id);
        if lock(&self.reruns).remove(&id) {
            self.room.notify_one();
        }
    }

    /// Whether a rerun is held (received, not settled).
    fn rerun_held(&self) -> bool {
        !lock(&self.reruns).is_empty()
    }

    /// Sends `kind` to the delivery's ack subject and waits for the server's reply.
    async fn confirmed(
        &self,
        reply: &Subject,
        kind: AckKind,
        action: &'static str,
    ) -> Result<(), AckError> {
        let request = async_nats::Request::new()
            .payload(kind.into())
            .timeout(Some(CONFIRM_TIMEOUT));
        self.client
            .send_request(reply.clone(), request)
            .await
            .map(|_| ())
            .map_err(|e| op_err(action, e))
    }

    /// Registers a delivery just received from the server (the keep-alive starts now)
    /// and queues it for the consumer's stream: its attempt (the server's delivery count),
    /// or `None` when the stream is gone.
    fn receive(&self, message: async_nats::Message) -> Option<Option<u32>> {
        let Some(reply) = message.reply.clone() else {
            tracing::warn!(target: "idem::broker", broker = BROKER, subject = %message.subject, "a delivery without an ack subject; skipped");
            return Some(None);
        };
        let message = jetstream::Message {
            message,
            context: self.js.clone(),
        };
        let attempt = message
            .info()
            .ok()
            .and_then(|i| u32::try_from(i.delivered).ok())
            .filter(|n| *n > 0);
        let message = Box::new(message.message);
        let id = self.register(reply.clone());
        if attempt.is_some_and(|n| n > 1) {
            lock(&self.reruns).insert(id);
        }
        self.buffered.fetch_add(1, Ordering::AcqRel);
        let taken = Taken {
            id,
            reply,
            message,
            attempt,
            fresh: true,
        };
        if let Err(mpsc::error::SendError(Ready::Taken(t))) = self.ready.send(Ready::Taken(taken)) {
            self.forget(t.id);
            return None;
        }
        Some(attempt)
    }
}

/// Hands `taken` back into the consumer's stream after `delay`, kept alive meanwhile
/// (its entry stays in `live`). If the consumer's stream is dropped first, the
/// keep-alive stops at once and the server redelivers it after the ack wait.
fn hand_back_after(shared: &Arc<Shared>, taken: Taken, delay: Duration) {
    let weak = Arc::downgrade(shared);
    crate::hold::hand_back_after(
        shared.ready.clone(),
        Ready::Taken(taken),
        delay,
        move |ready| {
            if let (Ready::Taken(t), Some(shared)) = (ready, weak.upgrade()) {
                shared.forget(t.id);
            }
        },
    );
}

/// Sends `+WPI` for every live delivery every `every`, until the consumer and all its
/// ackers are gone.
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
            let replies: Vec<Subject> = lock(&shared.live).values().cloned().collect();
            for reply in replies {
                if let Err(e) = shared.client.publish(reply, AckKind::Progress.into()).await {
                    tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "keep-alive (+WPI) not sent");
                    break;
                }
            }
        }
    });
}

/// Fetches deliveries into the consumer's stream until the stream is dropped; an error
/// that stops it ends the stream.
fn spawn_fetcher(
    shared: Arc<Shared>,
    consumer: jetstream::consumer::PullConsumer,
    prefetch: usize,
    name: String,
) {
    tokio::spawn(async move {
        if let Err(e) = fetch(&shared, &consumer, prefetch.max(1), &name).await {
            // After `close`, the end of the connection is no error.
            if !shared.closed.load(Ordering::Acquire) {
                let _ = shared.ready.send(Ready::Failed(e));
            }
        }
    });
}

/// One pull request at a time, for as many deliveries as the prefetch has room for
/// (asked once half of it is free, taking only what the server has then), each
/// registered for the keep-alive as it arrives; none while a rerun is held, and one at a
/// time, waiting, from the start, after a rerun and after a request that found nothing,
/// until a first delivery arrives (see the module docs). `Ok` when the consumer's stream
/// is gone.
async fn fetch(
    shared: &Shared,
    consumer: &jetstream::consumer::PullConsumer,
    prefetch: usize,
    name: &str,
) -> Result<(), BrokerError> {
    let inbox = Subject::from(shared.client.new_inbox());
    let mut sub = shared
        .client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| BrokerError::op(BROKER, "pull", e))?;
    let threshold = prefetch.div_ceil(2);
    // Of the request in flight: how many deliveries the server may still send, whether it
    // was a solo one, and how many it sent.
    let mut asked = 0usize;
    let mut asked_solo = true;
    let mut sent = 0usize;
    let mut heard = tokio::time::Instant::now();
    // The next request asks for one and waits for it: at the start, after a rerun, and
    // after a request that found nothing. Otherwise it takes only what is there at once.
    let mut solo = true;
    loop {
        let held = shared.rerun_held();
        let room = prefetch.saturating_sub(shared.buffered.load(Ordering::Acquire));
        let (room, want) = if solo {
            (room.min(1), 1)
        } else {
            (room, threshold)
        };
        if asked == 0 && !held && room >= want {
            let request = if solo {
                BatchConfig {
                    batch: 1,
                    expires: Some(PULL_EXPIRES),
                    idle_heartbeat: PULL_HEARTBEAT,
                    ..Default::default()
                }
            } else {
                // No wait: the server sends what it has now and ends the request (404 or
                // 408), so no request stays open for a rerun to come due into beside
                // others.
                BatchConfig {
                    batch: room,
                    no_wait: true,
                    ..Default::default()
                }
            };
            consumer
                .request_batch(request, inbox.clone())
                .await
                .map_err(|e| BrokerError::op(BROKER, "pull", e))?;
            asked = room;
            asked_solo = solo;
            sent = 0;
            heard = tokio::time::Instant::now();
        }
        let silent = tokio::time::sleep_until(heard + 2 * PULL_HEARTBEAT);
        tokio::select! {
            () = shared.ready.closed() => return Ok(()),
            () = shared.room.notified(), if asked == 0 => {}
            () = silent, if asked > 0 => {
                tracing::warn!(target: "idem::broker", broker = BROKER, stream = %stream_name(name), "missed JetStream heartbeats: the server is unreachable; ending the stream");
                return Err(BrokerError::op(
                    BROKER,
                    "pull (missed heartbeats)",
                    std::io::Error::other("missed idle heartbeat"),
                ));
            }
            m = sub.next() => {
                let Some(m) = m else {
                    return Err(BrokerError::op(
                        BROKER,
                        "pull",
                        std::io::Error::other("the pull subscription ended"),
                    ));
                };
                heard = tokio::time::Instant::now();
                match m.status.unwrap_or(StatusCode::OK) {
                    StatusCode::OK => {
                        asked = asked.saturating_sub(1);
                        sent += 1;
                        match shared.receive(m) {
                            // A rerun (or a delivery without a count) makes the next
                            // request a solo one; a first delivery answering a solo
                            // request opens the prefetch again.
                            Some(attempt) if attempt != Some(1) => solo = true,
                            Some(_) => solo &= !asked_solo,
                            None => return Ok(()),
                        }
                    }
                    StatusCode::IDLE_HEARTBEAT => {}
                    StatusCode::NOT_FOUND | StatusCode::TIMEOUT | StatusCode::REQUEST_TERMINATED => {
                        let description = m.description.unwrap_or_default();
                        if description == "Consumer Deleted"
                            || description == "Consumer is push based"
                            || description.starts_with("Exceeded MaxRequest")
                        {
                            return Err(BrokerError::op(
                                BROKER,
                                "pull",
                                std::io::Error::other(description),
                            ));
                        }
                        // The request is over (expired, answered in full with what there
                        // was, or ended by the server): ask again, after a pause if the
                        // server refused it outright, and as a solo one if it found nothing.
                        asked = 0;
                        if sent == 0 {
                            solo = true;
                        }
                        if m.status == Some(StatusCode::REQUEST_TERMINATED) {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                    status => {
                        return Err(BrokerError::op(
                            BROKER,
                            "pull",
                            std::io::Error::other(format!(
                                "the server answered the pull request with {status} {:?}",
                                m.description.unwrap_or_default()
                            )),
                        ));
                    }
                }
            }
        }
    }
}

/// Logs and counts the server's `MAX_DELIVERIES` advisories for the durable `durable` of
/// `stream`, until the consumer's stream is dropped.
async fn watch_max_deliveries(
    client: &async_nats::Client,
    stream: &str,
    durable: &str,
    ready: mpsc::UnboundedSender<Ready>,
    hits: Arc<AtomicU64>,
) -> Result<(), BrokerError> {
    let subject = format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}");
    let mut sub = client
        .subscribe(subject)
        .await
        .map_err(|e| BrokerError::op(BROKER, "advisory subscribe", e))?;
    let (stream, durable) = (stream.to_owned(), durable.to_owned());
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = ready.closed() => return,
                m = sub.next() => {
                    let Some(m) = m else { return };
                    hits.fetch_add(1, Ordering::Relaxed);
                    let advisory = String::from_utf8_lossy(&m.payload);
                    tracing::warn!(
                        target: "idem::broker",
                        broker = BROKER,
                        stream = %stream,
                        durable = %durable,
                        stream_seq = json_number(&advisory, "stream_seq").unwrap_or_default(),
                        deliveries = json_number(&advisory, "deliveries").unwrap_or_default(),
                        "the server reached max_deliver: it delivers this message no more (it stays in the stream, unacked, not dead-lettered)"
                    );
                }
            }
        }
    });
    Ok(())
}

/// The number after `"field":` in an advisory's JSON, if any.
fn json_number(json: &str, field: &str) -> Option<u64> {
    let at = json.find(&format!("\"{field}\""))? + field.len() + 2;
    let rest = json[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Deliveries of a JetStream durable pull consumer, as a stream of
/// `Result<Delivery<NatsAcker>, BrokerError>`. The stream ends after its first error
/// (missed heartbeats included: a server that stays down is reported, not waited for
/// silently), so a supervisor reconnects it.
pub struct NatsConsumer {
    ready: mpsc::UnboundedReceiver<Ready>,
    shared: Arc<Shared>,
    name: String,
    done: bool,
    max_deliveries: Arc<AtomicU64>,
}

impl std::fmt::Debug for NatsConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConsumer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Drop for NatsConsumer {
    /// What was received and not taken is not kept alive any more: the server redelivers
    /// it after the ack wait.
    fn drop(&mut self) {
        self.ready.close();
        while let Ok(r) = self.ready.try_recv() {
            if let Ready::Taken(t) = r {
                self.shared.forget(t.id);
            }
        }
    }
}
/// The durable consumer's configuration.
pub(super) fn consumer_config(config: &NatsConfig) -> pull::Config {
    let prefetch = i64::try_from(config.prefetch).unwrap_or(i64::MAX);
    pull::Config {
        durable_name: Some(config.durable.clone()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: config.ack_wait,
        max_deliver: config.max_deliver,
        max_ack_pending: prefetch.saturating_mul(2).max(1_000),
        ..Default::default()
    }
}

/// What of an existing durable's configuration must match this one: the ack policy, the
/// ack wait (the keep-alive is paced by it) and `max_deliver`. Others (`max_ack_pending`)
/// are left as the durable has them.
fn mismatch(
    durable: &str,
    have: &jetstream::consumer::Config,
    want: &pull::Config,
) -> Option<String> {
    let what = if have.ack_policy != want.ack_policy {
        format!(
            "ack_policy is {:?}, idem needs {:?}",
            have.ack_policy, want.ack_policy
        )
    } else if have.ack_wait != want.ack_wait {
        format!(
            "ack_wait is {:?}, this consumer asks {:?} (URL option ack_wait)",
            have.ack_wait, want.ack_wait
        )
    } else if have.max_deliver != want.max_deliver {
        format!(
            "max_deliver is {}, this consumer asks {} (URL option max_deliver)",
            have.max_deliver, want.max_deliver
        )
    } else {
        return None;
    };
    Some(format!(
        "the durable consumer {durable:?} exists with other settings: {what}; use its \
         settings, another durable name, or delete it (idem does not rewrite a shared durable)"
    ))
}

/// Gets the durable consumer, creating it if missing; an existing one whose settings
/// differ in a way that matters is a [`BrokerError::Config`].
pub(super) async fn ensure_consumer(
    stream: &jetstream::stream::Stream,
    config: &NatsConfig,
) -> Result<jetstream::consumer::PullConsumer, BrokerError> {
    let want = consumer_config(config);
    match stream.consumer_info(&config.durable).await {
        Ok(info) => {
            if let Some(detail) = mismatch(&config.durable, &info.config, &want) {
                return Err(BrokerError::Config {
                    broker: BROKER,
                    detail,
                });
            }
            stream
                .get_consumer(&config.durable)
                .await
                .map_err(|e| BrokerError::op(BROKER, "consumer get", e))
        }
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => stream
            .create_consumer(want)
            .await
            .map_err(|e| BrokerError::op(BROKER, "consumer create", e)),
        Err(e) => Err(BrokerError::op(BROKER, "consumer info", e)),
    }
}

impl NatsConsumer {
    /// Connects, creates the stream and its dead-letter stream if missing, gets the
    /// durable consumer (created if missing; an existing one is never rewritten), and
    /// starts fetching, keeping received deliveries alive and watching the durable's
    /// `MAX_DELIVERIES` advisories.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the server cannot be reached (or has no JetStream);
    /// an invalid name; [`BrokerError::Config`] when the durable exists with other
    /// settings.
    pub async fn connect(config: &NatsConfig) -> Result<Self, BrokerError> {
        check_name(&config.name)?;
        let client = connect_client(&config.url).await?;
        Self::from_client(client, config).await
    }

    /// As [`connect`](Self::connect), through `client`: a client the application
    /// connected itself, with its own credentials, TLS settings, name and callbacks.
    /// `config.url` is not used; everything else in `config` is.
    ///
    /// The consumer uses `client`'s connection (a clone of the handle: the connection is
    /// shared with the application's other uses of it). [`close`](Self::close) drains
    /// that connection, so with a shared client drop the consumer instead.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use futures::StreamExt;
    /// use idem_broker::nats::{NatsConfig, NatsConsumer};
    ///
    /// let client = async_nats::ConnectOptions::new()
    ///     .name("billing-consumer")
    ///     .connect("nats://127.0.0.1:4222")
    ///     .await?;
    /// let config = NatsConfig::new("nats://127.0.0.1:4222", "grants").with_durable("billing");
    /// let mut deliveries = NatsConsumer::from_client(client, &config).await?;
    /// while let Some(delivery) = deliveries.next().await {
    ///     let delivery = delivery?;
    ///     // hand it to an `idem_engine::Gate`, which acks only after the commit
    /// #   drop(delivery);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// An invalid name; a server without JetStream, or a refused stream or consumer
    /// request; [`BrokerError::Config`] when the durable exists with other settings.
    pub async fn from_client(
        client: async_nats::Client,
        config: &NatsConfig,
    ) -> Result<Self, BrokerError> {
        let (js, stream) = open_stream(client, config).await?;
        let dead_letter_subject = dead_letter_name(&config.name);
        ensure_stream(&js, &dead_letter_subject, config.duplicate_window).await?;
        let consumer = ensure_consumer(&stream, config).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let max_deliveries = Arc::new(AtomicU64::new(0));
        let client = js.client();
        watch_max_deliveries(
            &client,
            &stream_name(&config.name),
            &config.durable,
            tx.clone(),
            Arc::clone(&max_deliveries),
        )
        .await?;
        let shared = Arc::new(Shared {
            client,
            js,
            dead_letter_subject,
            live: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            ready: tx,
            buffered: AtomicUsize::new(0),
            room: Notify::new(),
            reruns: Mutex::new(std::collections::HashSet::new()),
            closed: AtomicBool::new(false),
        });
        spawn_keep_alive(Arc::downgrade(&shared), config.keep_alive_every());
        spawn_fetcher(
            Arc::clone(&shared),
            consumer,
            config.prefetch,
            config.name.clone(),
        );
        Ok(Self {
            ready: rx,
            shared,
            name: config.name.clone(),
            done: false,
            max_deliveries,
        })
    }

    /// Closes the connection (after flushing what is buffered): settling one of this
    /// consumer's deliveries from now on is an error, and the server redelivers them
    /// (and those held after a nack) after the ack wait.
    ///
    /// # Errors
    /// The connection could not be drained.
    pub async fn close(&self) -> Result<(), BrokerError> {
        self.shared.closed.store(true, Ordering::Release);
        let client = &self.shared.client;
        client
            .drain()
            .await
            .map_err(|e| BrokerError::op(BROKER, "drain", e))?;
        // The drain completes in the background: wait until the connection is gone (a
        // flush then fails), so nothing settles through it after `close` returns.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while client.flush().await.is_ok() {
            if tokio::time::Instant::now() >= deadline {
                return Err(BrokerError::op(
                    BROKER,
                    "drain",
                    std::io::Error::other("the connection is still open 5 s after a drain"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// How many deliveries are received and not settled (kept alive) right now: waiting
    /// in the prefetch, in the gate's hands, or held after a nack.
    pub fn live(&self) -> usize {
        lock(&self.shared.live).len()
    }

    /// How many `MAX_DELIVERIES` advisories of this durable the server has published
    /// since this consumer connected: messages the server no longer delivers because a
    /// process lost them `max_deliver` times (they stay in the stream, unacked). Every
    /// process sharing the durable sees each one.
    pub fn max_deliveries(&self) -> u64 {
        self.max_deliveries.load(Ordering::Relaxed)
    }
}

impl Stream for NatsConsumer {
    type Item = Result<Delivery<NatsAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.ready.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ready::Failed(e))) => {
                self.done = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(Some(Ready::Taken(t))) => {
                if t.fresh {
                    self.shared.buffered.fetch_sub(1, Ordering::AcqRel);
                    self.shared.room.notify_one();
                }
                let mut headers = Headers::new();
                if let Some(h) = &t.message.headers {
                    for (k, vs) in h.iter() {
                        for v in vs {
                            headers.push((k.to_string(), v.as_str().to_owned()));
                        }
                    }
                }
                Poll::Ready(Some(Ok(Delivery {
                    payload: t.message.payload.to_vec(),
                    headers,
                    attempt: t.attempt,
                    acker: NatsAcker {
                        id: t.id,
                        reply: t.reply,
                        shared: Arc::clone(&self.shared),
                        message: Some(t.message),
                        attempt: t.attempt,
                    },
                })))
            }
        }
    }
}

/// Settles one JetStream delivery, with the server's confirmation. While it lives
/// unsettled, the delivery is kept alive (`+WPI`); dropped unsettled, the keep-alive
/// stops and the server redelivers it after the ack wait.
pub struct NatsAcker {
    id: u64,
    reply: Subject,
    shared: Arc<Shared>,
    /// The delivery as received, to hand it back after a hold; `None` once handed back.
    message: Option<Box<async_nats::Message>>,
    attempt: Option<u32>,
}

impl std::fmt::Debug for NatsAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAcker")
            .field("reply", &self.reply.as_str())
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

impl Drop for NatsAcker {
    fn drop(&mut self) {
        // Handed back, the delivery stays alive under the same id.
        if self.message.is_some() {
            self.shared.forget(self.id);
        }
    }
}

fn op_err(action: &'static str, e: impl Into<idem_core::BoxError>) -> AckError {
    BrokerError::op(BROKER, action, e).into()
}

impl NatsAcker {
    /// Stops the keep-alive, then sends `kind` and waits for the server's reply.
    async fn settle(&self, kind: AckKind, action: &'static str) -> Result<(), AckError> {
        self.shared.forget(self.id);
        self.shared.confirmed(&self.reply, kind, action).await
    }

    /// Holds the delivery, alive, and hands it back into the consumer's stream after
    /// `delay`, with its attempt plus one when `counted`. On a closed consumer the
    /// delivery cannot be held: a `-NAK` is tried (and fails).
    async fn hand_back(mut self, delay: Duration, counted: bool) -> Result<(), AckError> {
        if self.shared.closed.load(Ordering::Acquire) {
            let delay = Some(delay).filter(|d| !d.is_zero());
            return self.settle(AckKind::Nak(delay), "nak").await;
        }
        let Some(message) = self.message.take() else {
            return Ok(());
        };
        let attempt = if counted {
            self.attempt.map(|n| n.saturating_add(1))
        } else {
            self.attempt
        };
        self.shared.buffered.fetch_add(1, Ordering::AcqRel);
        let taken = Taken {
            id: self.id,
            reply: self.reply.clone(),
            message,
            attempt,
            fresh: true,
        };
        hand_back_after(&self.shared, taken, delay);
        Ok(())
    }

    /// Defers the delivery: holds it, alive, and hands it back into the consumer's stream
    /// after `delay` with the same attempt — the server counts no delivery and the
    /// attempt counts nothing. For a delivery that could not run yet (its key held by
    /// another transaction), not for one that failed.
    ///
    /// # Errors
    /// The consumer was closed (the delivery cannot be held; the server redelivers it
    /// after the ack wait).
    pub async fn defer(self, delay: Duration) -> Result<(), AckError> {
        self.hand_back(delay, false).await
    }
}
/// The headers of a dead letter — the delivery's own (`copied`) and the reason — cut so
/// that the message fits the server's `max_payload` (a message whose reason pushed it
/// over could never be dead-lettered: it came back every few seconds until `max_deliver`).
/// In order, while it does not fit: the copied headers are dropped, the reason is
/// shortened (at a character boundary), and at last no header is sent. The payload itself
/// fits (the server delivered it), and a message without headers goes as a plain `PUB`.
fn fit_dead_letter(
    copied: Vec<(String, String)>,
    reason: String,
    payload_len: usize,
    max_payload: usize,
) -> Vec<(String, String)> {
    // `HeaderMap::wire_len`: "NATS/1.0\r\n" + each "<name>: <value>\r\n" + "\r\n".
    let line = |k: &str, v: &str| k.len() + 2 + v.len() + 2;
    let block = |h: &[(String, String)]| 12 + h.iter().map(|(k, v)| line(k, v)).sum::<usize>();
    let mut out = copied;
    out.push((DEAD_LETTER_REASON_HEADER.to_owned(), reason));
    if payload_len + block(&out) <= max_payload {
        return out;
    }
    let mut reason = out.pop().map(|(_, v)| v).unwrap_or_default();
    let fixed = payload_len + 12 + line(DEAD_LETTER_REASON_HEADER, "");
    let room = max_payload.saturating_sub(fixed);
    if room == 0 {
        return Vec::new();
    }
    if reason.len() > room {
        let mut end = room;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
    if reason.is_empty() {
        return Vec::new();
    }
    vec![(DEAD_LETTER_REASON_HEADER.to_owned(), reason)]
}

#[async_trait]
impl Acker for NatsAcker {
    /// A double ack: `+ACK` as a request; when it returns `Ok`, the server has the ack.
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        self.settle(AckKind::Ack, "ack").await
    }

    /// With a delay: held here, alive (`+WPI`), and handed back into this consumer's
    /// stream after the delay with its attempt plus one; the server counts no delivery,
    /// so `max_deliver` does not end a message that the gate keeps handing back (a key
    /// held elsewhere, a store outage). Without a delay (or a zero one): `-NAK`,
    /// confirmed; the server redelivers it at once, to any consumer of the durable, and
    /// counts a delivery.
    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        match delay.filter(|d| !d.is_zero()) {
            Some(delay) => self.hand_back(delay, true).await,
            None => self.settle(AckKind::Nak(None), "nak").await,
        }
    }

    /// Held here, alive, and handed back after the delay with the same attempt: a
    /// deferral is not an attempt, and the server counts no delivery.
    async fn defer(self, delay: Duration) -> Result<(), AckError> {
        NatsAcker::defer(self, delay).await
    }

    /// True: deferrals and delayed nacks are held here without a server delivery, so
    /// `num_delivered` counts the runs that failed with no delay and the deliveries whose
    /// process died.
    fn attempt_counts_runs(&self) -> bool {
        true
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let copied: Vec<(String, String)> =
            carried_to_dead_letter(headers, |k| k.eq_ignore_ascii_case("Nats-Msg-Id"))
                .cloned()
                .collect();
        // A header line ends at CR or LF (async-nats panics on either): a reason on several
        // lines (a handler's multi-line error) goes on one.
        let reason_line = reason.to_string().replace(['\r', '\n'], " ");
        let out = fit_dead_letter(
            copied,
            reason_line,
            payload.len(),
            self.shared.client.max_payload(),
        );
        if !out.iter().any(|(k, _)| k == DEAD_LETTER_REASON_HEADER) {
            tracing::warn!(target: "idem::broker", %reason, "dead letter too close to the server's max_payload for its reason header: the reason is only in this log");
        }
        let published = publish_confirmed(
            &self.shared.js,
            &self.shared.dead_letter_subject,
            vec![(payload.to_vec(), out, None)],
        )
        .await;
        match published {
            Ok(()) => self.settle(AckKind::Term, "term").await,
            Err(e) if !e.is_retryable() => {
                // Refused for good (over the dead-letter stream's `max_msg_size`): a
                // hand-back would loop for ever. Left unsettled (dropped, it is no longer
                // kept alive: the server delivers it again after the ack wait) and the
                // consumer stops.
                let destination = format!(
                    "the dead-letter stream of {:?} ({} bytes and more)",
                    self.shared.dead_letter_subject,
                    payload.len()
                );
                Err(BrokerError::dead_letter_refused(
                    BROKER,
                    &destination,
                    &idem_core::error::error_chain(&e),
                    "unsettled",
                    "raise that stream's max_msg_size to the source stream's",
                )
                .into())
            }
            Err(e) => {
                // Not dead-lettered: hand it back rather than lose it, after a pause (at
                // once it would loop as fast as the gate rejects it), as a failed attempt.
                let _ = self.hand_back(DEAD_LETTER_RETRY, true).await;
                Err(e.into())
            }
        }
    }

    /// Every ack confirmed, concurrently.
    async fn ack_all(items: Vec<(Self, AckProof)>) -> Vec<Result<(), AckError>> {
        futures::future::join_all(
            items
                .into_iter()
                .map(|(a, _proof)| async move { a.settle(AckKind::Ack, "ack").await }),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes a message with `headers` and a payload of `payload` bytes counts against
    /// `max_payload` (async-nats's `HeaderMap::wire_len`; no header block when empty).
    fn size(headers: &[(String, String)], payload: usize) -> usize {
        if headers.is_empty() {
            return payload;
        }
        let lines: usize = headers.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
        payload + "NATS/1.0\r\n\r\n".len() + lines
    }

    fn copied() -> Vec<(String, String)> {
        vec![("traceparent".to_owned(), "x".repeat(55))]
    }

    #[test]
    fn a_dead_letter_is_cut_to_fit_max_payload_headers_first_then_the_reason() {
        let reason = "not_json: é".repeat(10);
        let full = fit_dead_letter(copied(), reason.clone(), 1_000, 1 << 20);
        assert_eq!(full.len(), 2, "room for everything: {full:?}");
        let all = size(&full, 1_000);

        // One byte short: the copied header goes, the whole reason stays.
        let max = all - 1;
        let cut = fit_dead_letter(copied(), reason.clone(), 1_000, max);
        assert_eq!(
            cut,
            [(DEAD_LETTER_REASON_HEADER.to_owned(), reason.clone())]
        );
        assert!(size(&cut, 1_000) <= max);

        // Less room still: the reason is shortened, at a character boundary, to fit.
        for max in (1_000..all).step_by(7) {
            let cut = fit_dead_letter(copied(), reason.clone(), 1_000, max);
            assert!(size(&cut, 1_000) <= max, "{max}: {cut:?}");
            if let Some((_, r)) = cut.first() {
                assert!(reason.starts_with(r.as_str()) && !r.is_empty());
                // Not one more character would have fitted.
                let next = reason[r.len()..].chars().next().map_or(0, char::len_utf8);
                assert!(size(&cut, 1_000) + next > max || r.len() == reason.len());
            }
        }

        // No room for a header at all: the payload alone.
        assert!(fit_dead_letter(copied(), reason, 1_000, 1_010).is_empty());
    }
}
