//! Receiving from a queue: [`SqsConsumer`] and its [`SqsAcker`].

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use aws_config::SdkConfig;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry, Message,
    MessageSystemAttributeName,
};
use aws_sdk_sqs::Client;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt as _};
use idem_core::{AckError, AckProof, Acker, Delivery, Headers, RejectReason};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinSet;

use super::config::SqsConfig;
use super::{
    attributes, body_text, client_of, ensure_queues, receive_client, sdk_config_for, sdk_err,
    with_timeouts, BROKER,
};
use crate::idle::IdleLink;
use crate::{BrokerError, DEAD_LETTER_REASON_HEADER};

/// `text` with every character SQS refuses in a message or attribute (a control character
/// other than tab, LF and CR; U+FFFE, U+FFFF) replaced by U+FFFD: a dead-letter reason
/// (a handler's error, perhaps with terminal colour codes) that SQS refused would leave
/// the message to come back until the queue's redrive policy moves it without its reason.
fn sqs_text(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '\t' | '\n' | '\r' => c,
            c if c < ' ' || c == '\u{FFFE}' || c == '\u{FFFF}' => '\u{FFFD}',
            c => c,
        })
        .collect()
}

/// The most messages one `ReceiveMessage`, `DeleteMessageBatch` or
/// `ChangeMessageVisibilityBatch` handles.
const SQS_BATCH: usize = 10;
/// The most receives in flight at once.
const MAX_PARALLEL_RECEIVES: usize = 8;
/// The most `DeleteMessageBatch` calls in flight at once for single acks; more acks
/// wait and go together in the next call.
const MAX_PARALLEL_DELETES: usize = 4;
/// The most `ChangeMessageVisibilityBatch` calls in flight at once in a keep-alive round.
const MAX_PARALLEL_EXTENDS: usize = 4;
/// The longest visibility timeout SQS accepts (12 hours).
const MAX_VISIBILITY_SECS: u64 = 43_200;

/// A single ack waiting for its `DeleteMessageBatch`: the receipt handle and where the
/// result goes.
type DeleteRequest = (String, oneshot::Sender<Result<(), AckError>>);

/// A received, unsettled message whose visibility the keeper extends.
#[derive(Debug)]
struct Lease {
    receipt: String,
    /// When the message becomes visible again unless extended (measured from before the
    /// request that set it was sent, so never later than SQS's own clock).
    visible_at: Instant,
}

struct Shared {
    client: Client,
    queue_url: String,
    dead_letter_url: String,
    /// Single acks, gathered into `DeleteMessageBatch` calls by [`delete_loop`].
    deletes: mpsc::UnboundedSender<DeleteRequest>,
    /// Every received delivery not yet settled or dropped, by lease id.
    leases: Mutex<HashMap<u64, Lease>>,
    next_lease: AtomicU64,
    /// The visibility timeout sent with every receive and every extension.
    visibility: Duration,
    /// Held by the keeper while a round of extensions is in flight; a nack takes it
    /// after removing its lease, so no extension sent before can land after the nack's
    /// own `ChangeMessageVisibility` and hide the message longer than asked.
    extending: tokio::sync::Mutex<()>,
    /// Deferred deliveries handed back into the consumer's stream (see
    /// [`SqsAcker::defer`]).
    back: mpsc::UnboundedSender<Delivery<SqsAcker>>,
    /// Deferred deliveries not yet taken back by the stream.
    held: AtomicUsize,
    /// The leases of deliveries SQS received before (a rerun): while one is held, no
    /// receive is started ([`SqsConsumer`]).
    reruns: Mutex<std::collections::HashSet<u64>>,
    /// Wakes the stream when a rerun is settled.
    rerun_settled: tokio::sync::Notify,
}

impl Shared {
    fn leases(&self) -> MutexGuard<'_, HashMap<u64, Lease>> {
        self.leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lease(&self, receipt: &str, visible_at: Instant) -> u64 {
        let id = self.next_lease.fetch_add(1, Ordering::Relaxed);
        self.leases().insert(
            id,
            Lease {
                receipt: receipt.to_owned(),
                visible_at,
            },
        );
        id
    }

    fn release(&self, id: u64) {
        self.leases().remove(&id);
        let settled = self
            .reruns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&id);
        if settled {
            self.rerun_settled.notify_one();
        }
    }

    /// Whether a rerun is held (received, not settled).
    fn rerun_held(&self) -> bool {
        !self
            .reruns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_empty()
    }
}

fn secs_i32(d: Duration) -> i32 {
    i32::try_from(d.as_secs().min(MAX_VISIBILITY_SECS)).unwrap_or(i32::MAX)
}

/// Messages of an SQS queue, as a stream of `Result<Delivery<SqsAcker>, BrokerError>`.
///
/// Receives run in the background, up to `prefetch` messages ahead, and each one's
/// messages are yielded as soon as it returns: the first delivery waits for one
/// `ReceiveMessage`, not for a round of them. The number of receives in flight starts at
/// one, grows by one after each full receive (10 messages) up to the most `prefetch`
/// allows (at most 8), and falls back to one after an empty receive.
///
/// A message is invisible to other consumers for the visibility timeout after it is
/// received. While its delivery is unsettled — waiting in the stream's buffer or held
/// by the caller — a keeper task extends it (`ChangeMessageVisibilityBatch`, to the full
/// timeout again once a third of it has passed), so a handler slower than the timeout
/// causes no redelivery. Dropping a delivery unsettled, or the stream with deliveries in
/// its buffer, stops the extensions: SQS delivers them again after the timeout.
///
/// Each delivery's [`attempt`](Delivery::attempt) is SQS's `ApproximateReceiveCount`.
///
/// One at a time around a rerun: a delivery SQS received before (its count past 1) may
/// be one whose run killed the last process. While one is held unsettled, no receive is
/// started; at the start, and after a rerun, receives ask for one message until a first
/// delivery (count 1) arrives. So when a message kills its process, SQS counts a receive
/// for the neighbours in that process's prefetch once, at the first death, not again for
/// each later run of it or of another killer in the same window: none of them reaches the
/// redrive policy's `maxReceiveCount` for it.
///
/// A deferred delivery ([`SqsAcker::defer`]) is held here, its visibility kept extended,
/// and comes out of this stream again after its delay, with the same attempt: SQS counts
/// no receive for it, so no deferral brings a message nearer its redrive policy's
/// `maxReceiveCount`.
///
/// Every request has a timeout ([`SqsConfig::request_timeout`], with the long poll on
/// top for `ReceiveMessage`): an endpoint that stops answering ends the stream with
/// [`BrokerError::Timeout`] instead of hanging it.
///
/// Under [`until_idle`](crate::until_idle) the stream ends only after its receives came
/// back empty for the idle time, counted from the start of the first empty one, and
/// never while a receive is outstanding (a slow receive of a deep queue is not
/// idleness) or a deferred delivery is held.
pub struct SqsConsumer {
    inner: BoxStream<'static, Result<Delivery<SqsAcker>, BrokerError>>,
    name: String,
}

impl std::fmt::Debug for SqsConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsConsumer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// One receive's result: when it was sent, when it returned, what it brought.
type Received = (Instant, Instant, Result<Vec<Message>, BrokerError>);

struct Reader {
    shared: Arc<Shared>,
    /// The client for receives: its attempt timeout is the long poll plus the request
    /// timeout.
    receiver: Client,
    /// Deferred deliveries, handed back when their delay is up.
    back: mpsc::UnboundedReceiver<Delivery<SqsAcker>>,
    buf: VecDeque<Delivery<SqsAcker>>,
    /// Receives in flight (spawned, so they progress while the buffer is drained;
    /// aborted when the stream is dropped).
    receives: JoinSet<Received>,
    /// How many receives to keep in flight now (1..=`max_receives`).
    target: usize,
    max_receives: usize,
    prefetch: usize,
    wait: i32,
    /// The idle exit this stream runs under, if any (see [`crate::until_idle`]).
    idle: Option<Arc<IdleLink>>,
    /// When the first of the receives that came back empty in a row was sent.
    quiet_since: Option<Instant>,
    /// The idle time is up: start no receive, end once none is outstanding.
    stopping: bool,
    /// One message at a time: at the start and after a rerun, until a first delivery.
    solo: bool,
}

impl Reader {
    fn push(&mut self, sent: Instant, messages: Vec<Message>) {
        let visible_at = sent + self.shared.visibility;
        let (mut first, mut rerun) = (false, false);
        for m in messages {
            let Some(receipt) = m.receipt_handle else {
                continue;
            };
            let attempt = m
                .attributes
                .as_ref()
                .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
                .and_then(|c| c.parse::<u32>().ok());
            let mut headers: Headers = m
                .message_attributes
                .unwrap_or_default()
                .into_iter()
                .filter_map(|(k, v)| v.string_value.map(|s| (k, s)))
                .collect();
            headers.sort();
            let lease = self.shared.lease(&receipt, visible_at);
            if attempt == Some(1) {
                first = true;
            } else {
                rerun = true;
                if attempt.is_some_and(|n| n > 1) {
                    self.shared
                        .reruns
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(lease);
                }
            }
            let original = Arc::new(Original {
                payload: m.body.unwrap_or_default().into_bytes(),
                headers,
                attempt,
            });
            self.buf.push_back(original.delivery(SqsAcker {
                receipt,
                message_id: m.message_id.unwrap_or_default(),
                lease,
                shared: Arc::clone(&self.shared),
                original: Some(Arc::clone(&original)),
            }));
        }
        self.solo = rerun || !first;
    }

    /// Starts receives up to the target, keeping at most `prefetch` messages (on hand,
    /// held deferrals, plus 10 per receive in flight) ahead; always one when nothing is
    /// on hand, unless deferrals fill the prefetch: then nothing is received until they
    /// come back (memory stays bounded however long the store makes them wait).
    fn start_receives(&mut self) {
        let held = self.shared.held.load(Ordering::Acquire);
        if self.shared.rerun_held() {
            return;
        }
        let (target, batch) = if self.solo {
            (1, 1)
        } else {
            (self.target, SQS_BATCH)
        };
        while !self.stopping
            && self.receives.len() < target
            && held < self.prefetch
            && (self.receives.is_empty() && self.buf.is_empty()
                || self.buf.len() + held + SQS_BATCH * (self.receives.len() + 1) <= self.prefetch)
        {
            let receive = self
                .receiver
                .receive_message()
                .queue_url(&self.shared.queue_url)
                .max_number_of_messages(i32::try_from(batch).unwrap_or(10))
                .wait_time_seconds(self.wait)
                .visibility_timeout(secs_i32(self.shared.visibility).max(1))
                .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
                .message_attribute_names("All")
                .send();
            let receiver = self.receiver.clone();
            self.receives.spawn(async move {
                let sent = Instant::now();
                let r = receive
                    .await
                    .map(|out| out.messages.unwrap_or_default())
                    .map_err(|e| sdk_err(&receiver, "ReceiveMessage", e));
                (sent, Instant::now(), r)
            });
        }
    }

    /// A deferred delivery back from its hold.
    fn handed_back(
        &self,
        d: Option<Delivery<SqsAcker>>,
    ) -> Result<Delivery<SqsAcker>, BrokerError> {
        self.shared.held.fetch_sub(1, Ordering::AcqRel);
        // The channel's sender lives in `shared`, which this reader holds.
        d.ok_or_else(|| {
            BrokerError::op(
                BROKER,
                "defer",
                "the channel of deferred deliveries closed".to_owned(),
            )
        })
    }

    /// Notes an empty receive sent at `sent` that returned at `returned`; decides
    /// whether the idle time is up.
    fn quiet(&mut self, sent: Instant, returned: Instant) {
        let since = *self.quiet_since.get_or_insert(sent);
        if let Some(link) = &self.idle {
            if returned.saturating_duration_since(since) >= link.limit() {
                self.stopping = true;
            }
        }
    }
}

impl crate::pull::Pull for Reader {
    type Acker = SqsAcker;

    async fn next(&mut self) -> Result<Delivery<SqsAcker>, BrokerError> {
        if self.idle.is_none() {
            self.idle = crate::idle::adopt();
        }
        loop {
            self.start_receives();
            if let Some(d) = self.buf.pop_front() {
                return Ok(d);
            }
            let joined = if self.receives.is_empty() {
                if !self.stopping && self.shared.rerun_held() {
                    // A rerun is held: nothing is received until it settles.
                    tokio::select! {
                        () = self.shared.rerun_settled.notified() => continue,
                        d = self.back.recv() => return self.handed_back(d),
                    }
                }
                // Stopping, or deferrals fill the prefetch: nothing on hand, no receive
                // outstanding. A deferred delivery still held comes back (before the
                // stream ends).
                if self.shared.held.load(Ordering::Acquire) == 0 {
                    if let Some(link) = &self.idle {
                        link.stop();
                    }
                    return std::future::pending().await;
                }
                let d = self.back.recv().await;
                return self.handed_back(d);
            } else {
                tokio::select! {
                    joined = self.receives.join_next() => joined,
                    d = self.back.recv() => return self.handed_back(d),
                }
            };
            let Some(joined) = joined else {
                continue;
            };
            match joined {
                Ok((sent, returned, Ok(messages))) => {
                    if messages.is_empty() {
                        self.target = 1;
                        self.quiet(sent, returned);
                    } else {
                        if messages.len() >= SQS_BATCH {
                            self.target = (self.target + 1).min(self.max_receives);
                        }
                        self.quiet_since = None;
                        self.stopping = false;
                        self.push(sent, messages);
                    }
                }
                Ok((_, _, Err(e))) if self.receives.is_empty() && !self.stopping => return Err(e),
                Ok((_, _, Err(e))) => {
                    tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "one receive failed");
                }
                Err(e) => {
                    return Err(BrokerError::op(
                        BROKER,
                        "ReceiveMessage",
                        format!("the receive task ended: {e}"),
                    ))
                }
            }
        }
    }
}

/// Extends the visibility of every unsettled delivery once a third of its timeout has
/// passed, until the consumer and all its ackers are gone.
async fn keeper(shared: Weak<Shared>, visibility: Duration) {
    let tick = (visibility / 6).clamp(Duration::from_millis(100), Duration::from_secs(10));
    // Extend when less than two thirds of the timeout is left.
    let margin = visibility * 2 / 3;
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let _round = shared.extending.lock().await;
        let now = Instant::now();
        let due: Vec<(u64, String)> = shared
            .leases()
            .iter()
            .filter(|(_, l)| l.visible_at.saturating_duration_since(now) < margin)
            .map(|(id, l)| (*id, l.receipt.clone()))
            .collect();
        if due.is_empty() {
            continue;
        }
        let chunks: Vec<Vec<(u64, String)>> = due.chunks(SQS_BATCH).map(<[_]>::to_vec).collect();
        futures::stream::iter(chunks)
            .map(|chunk| extend_batch(&shared, chunk))
            .buffer_unordered(MAX_PARALLEL_EXTENDS)
            .collect::<Vec<()>>()
            .await;
    }
}

/// One `ChangeMessageVisibilityBatch` for up to 10 leases.
async fn extend_batch(shared: &Shared, chunk: Vec<(u64, String)>) {
    let sent = Instant::now();
    let timeout = secs_i32(shared.visibility).max(1);
    let entries: Vec<ChangeMessageVisibilityBatchRequestEntry> = chunk
        .iter()
        .enumerate()
        .filter_map(|(i, (_, receipt))| {
            ChangeMessageVisibilityBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(receipt)
                .visibility_timeout(timeout)
                .build()
                .ok()
        })
        .collect();
    let r = shared
        .client
        .change_message_visibility_batch()
        .queue_url(&shared.queue_url)
        .set_entries(Some(entries))
        .send()
        .await;
    match r {
        Ok(out) => {
            let mut leases = shared.leases();
            for ok in &out.successful {
                let Some((id, _)) = ok.id.parse::<usize>().ok().and_then(|i| chunk.get(i)) else {
                    continue;
                };
                if let Some(l) = leases.get_mut(id) {
                    l.visible_at = sent + shared.visibility;
                }
            }
            for f in &out.failed {
                let Some((id, _)) = f.id.parse::<usize>().ok().and_then(|i| chunk.get(i)) else {
                    continue;
                };
                // Settled meanwhile, or no longer ours (its visibility ran out and it was
                // received again): extending cannot help; it is delivered again and
                // skipped as a duplicate if it had committed.
                if f.sender_fault && leases.contains_key(id) {
                    tracing::warn!(target: "idem::broker", broker = BROKER, code = %f.code, "cannot extend a delivery's visibility; it may be delivered again");
                    leases.remove(id);
                }
            }
        }
        Err(e) => {
            tracing::warn!(target: "idem::broker", broker = BROKER, error = %sdk_err(&shared.client, "ChangeMessageVisibilityBatch", e), "extending visibility failed; retried next round");
        }
    }
}

/// Gathers single acks into `DeleteMessageBatch` calls: at most
/// [`MAX_PARALLEL_DELETES`] calls in flight; acks arriving meanwhile wait and go
/// together (up to 10 a call). Ends when every acker and the consumer are gone.
async fn delete_loop(
    client: Client,
    queue_url: String,
    mut requests: mpsc::UnboundedReceiver<DeleteRequest>,
) {
    let permits = Arc::new(Semaphore::new(MAX_PARALLEL_DELETES));
    let mut batch: Vec<DeleteRequest> = Vec::with_capacity(SQS_BATCH);
    loop {
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
            return;
        };
        if requests.recv_many(&mut batch, SQS_BATCH).await == 0 {
            return;
        }
        let taken = std::mem::take(&mut batch);
        let client = client.clone();
        let queue_url = queue_url.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let (receipts, replies): (Vec<String>, Vec<_>) = taken.into_iter().unzip();
            let results = delete_batch(&client, &queue_url, &receipts).await;
            for (reply, r) in replies.into_iter().zip(results) {
                // The acker may have given up waiting; nothing to tell then.
                let _ = reply.send(r);
            }
        });
    }
}

/// One `DeleteMessageBatch` of at most 10 receipt handles: a result per handle, in
/// order. A handle counts as deleted only when SQS lists its entry as successful: an
/// entry that could not be built, one SQS lists as failed, and one it does not mention
/// are errors (the message stays in the queue and comes back; never reported acked).
pub(crate) async fn delete_batch(
    client: &Client,
    queue_url: &str,
    receipts: &[String],
) -> Vec<Result<(), AckError>> {
    let mut res: Vec<Result<(), AckError>> = receipts
        .iter()
        .map(|_| {
            Err(batch_error(
                "sqs: DeleteMessageBatch did not report this entry as deleted",
                true,
            ))
        })
        .collect();
    let mut entries = Vec::with_capacity(receipts.len());
    for (i, r) in receipts.iter().enumerate() {
        match DeleteMessageBatchRequestEntry::builder()
            .id(i.to_string())
            .receipt_handle(r)
            .build()
        {
            Ok(e) => entries.push(e),
            Err(e) => {
                res[i] = Err(batch_error(
                    &format!("sqs: DeleteMessageBatch entry not built: {e}"),
                    false,
                ));
            }
        }
    }
    if entries.is_empty() {
        return res;
    }
    let r = client
        .delete_message_batch()
        .queue_url(queue_url)
        .set_entries(Some(entries))
        .send()
        .await;
    match r {
        Ok(o) => {
            for ok in o.successful {
                if let Some(slot) = ok.id.parse::<usize>().ok().and_then(|i| res.get_mut(i)) {
                    *slot = Ok(());
                }
            }
            for f in o.failed {
                if let Some(slot) = f.id.parse::<usize>().ok().and_then(|i| res.get_mut(i)) {
                    *slot = Err(batch_error(
                        &format!(
                            "sqs: DeleteMessageBatch entry failed: {} {}",
                            f.code,
                            f.message.unwrap_or_default()
                        ),
                        !f.sender_fault,
                    ));
                }
            }
            res
        }
        Err(e) => {
            let e = sdk_err(client, "DeleteMessageBatch", e);
            receipts
                .iter()
                .map(|_| Err(batch_error(&e.to_string(), e.is_retryable())))
                .collect()
        }
    }
}

impl SqsConsumer {
    /// Connects, creates the queue and its dead-letter queue if missing (see
    /// [`SqsConfig`]: the dead-letter queue keeps messages 14 days, the source redrives to
    /// it), and starts receiving.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the endpoint cannot be reached; an invalid name;
    /// [`BrokerError::Config`] when an existing queue is set up differently in a way that
    /// matters.
    pub async fn connect(config: &SqsConfig) -> Result<Self, BrokerError> {
        let sdk = sdk_config_for(config).await?;
        Self::from_sdk_config(&sdk, config).await
    }

    /// As [`connect`](Self::connect), with an AWS configuration the application loaded
    /// itself (its credentials provider, region, endpoint, HTTP client, retries,
    /// interceptors). `config.endpoint` and `config.region` are not used (`sdk`'s are);
    /// its timeouts apply to idem's requests, everything else in `config` is used too.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    ///
    /// use aws_config::BehaviorVersion;
    /// use futures::StreamExt;
    /// use idem_broker::sqs::{SqsConfig, SqsConsumer};
    ///
    /// let sdk = aws_config::defaults(BehaviorVersion::latest())
    ///     .profile_name("billing")
    ///     .load()
    ///     .await;
    /// let config = SqsConfig::new(None, "grants").with_visibility_timeout(Duration::from_secs(60));
    /// let mut deliveries = SqsConsumer::from_sdk_config(&sdk, &config).await?;
    /// while let Some(delivery) = deliveries.next().await {
    ///     let delivery = delivery?;
    ///     // hand it to an `idem_core::Gate`, which acks only after the commit
    /// #   drop(delivery);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`connect`](Self::connect); [`BrokerError::Config`] for an `sdk` without a
    /// behavior version.
    pub async fn from_sdk_config(sdk: &SdkConfig, config: &SqsConfig) -> Result<Self, BrokerError> {
        Self::from_client(client_of(sdk)?, config).await
    }

    /// As [`connect`](Self::connect), through an SQS client the application built
    /// itself. idem's requests go through a copy of it with `config`'s connect and request
    /// timeouts (sharing its credentials, region, endpoint, HTTP client and
    /// interceptors); `config.endpoint` and `config.region` are not used.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use aws_config::BehaviorVersion;
    /// use idem_broker::sqs::{SqsConfig, SqsConsumer};
    ///
    /// let sdk = aws_config::load_defaults(BehaviorVersion::latest()).await;
    /// let client = aws_sdk_sqs::Client::from_conf(
    ///     aws_sdk_sqs::config::Builder::from(&sdk)
    ///         .endpoint_url("https://sqs.eu-west-1.amazonaws.com")
    ///         .build(),
    /// );
    /// let deliveries = SqsConsumer::from_client(client, &SqsConfig::new(None, "grants")).await?;
    /// # drop(deliveries);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub async fn from_client(client: Client, config: &SqsConfig) -> Result<Self, BrokerError> {
        let client = with_timeouts(&client, config);
        let (queue_url, dead_letter_url) = ensure_queues(&client, config).await?;
        let receiver = receive_client(&client, config);
        let (back, handed_back) = mpsc::unbounded_channel();
        let (deletes, requests) = mpsc::unbounded_channel();
        tokio::spawn(delete_loop(client.clone(), queue_url.clone(), requests));
        let visibility = Duration::from_secs(
            config
                .visibility_timeout
                .as_secs()
                .clamp(1, MAX_VISIBILITY_SECS),
        );
        let shared = Arc::new(Shared {
            client,
            queue_url,
            dead_letter_url,
            deletes,
            leases: Mutex::new(HashMap::new()),
            next_lease: AtomicU64::new(0),
            visibility,
            extending: tokio::sync::Mutex::new(()),
            back,
            held: AtomicUsize::new(0),
            reruns: Mutex::new(std::collections::HashSet::new()),
            rerun_settled: tokio::sync::Notify::new(),
        });
        tokio::spawn(keeper(Arc::downgrade(&shared), visibility));
        let prefetch = config.prefetch.max(1);
        let state = Reader {
            shared,
            receiver,
            back: handed_back,
            buf: VecDeque::new(),
            receives: JoinSet::new(),
            target: 1,
            solo: true,
            max_receives: prefetch.div_ceil(SQS_BATCH).clamp(1, MAX_PARALLEL_RECEIVES),
            prefetch,
            wait: secs_i32(config.wait.min(Duration::from_secs(20))),
            idle: None,
            quiet_since: None,
            stopping: false,
        };
        Ok(Self {
            inner: crate::pull::deliveries(state),
            name: config.name.clone(),
        })
    }
}

impl Stream for SqsConsumer {
    type Item = Result<Delivery<SqsAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// A received message as it was yielded, to yield it again after a deferral.
struct Original {
    payload: Vec<u8>,
    headers: Headers,
    attempt: Option<u32>,
}

impl Original {
    fn delivery(&self, acker: SqsAcker) -> Delivery<SqsAcker> {
        Delivery {
            payload: self.payload.clone(),
            headers: self.headers.clone(),
            attempt: self.attempt,
            acker,
        }
    }
}

/// Settles one received SQS message through its receipt handle. While it lives
/// unsettled, the consumer's keeper extends the message's visibility; dropping it
/// unsettled stops that, and SQS delivers the message again after the timeout.
pub struct SqsAcker {
    receipt: String,
    message_id: String,
    lease: u64,
    shared: Arc<Shared>,
    /// The delivery as received; `None` once handed on to the acker of its deferred
    /// delivery, which then owns the lease.
    original: Option<Arc<Original>>,
}

impl std::fmt::Debug for SqsAcker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsAcker")
            .field("message_id", &self.message_id)
            .finish_non_exhaustive()
    }
}

impl Drop for SqsAcker {
    fn drop(&mut self) {
        // Deferred, the delivery keeps its lease under its new acker.
        if self.original.is_some() {
            self.shared.release(self.lease);
        }
    }
}

impl SqsAcker {
    /// The message's id.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    async fn delete(&self) -> Result<(), AckError> {
        self.shared
            .client
            .delete_message()
            .queue_url(&self.shared.queue_url)
            .receipt_handle(&self.receipt)
            .send()
            .await
            .map_err(|e| AckError::from(sdk_err(&self.shared.client, "DeleteMessage", e)))?;
        Ok(())
    }

    /// Defers the delivery without a new receive: it stays leased (its visibility kept
    /// extended) and comes back out of the consumer's stream after `delay`, with the same
    /// attempt. SQS counts no receive, so the redrive policy's `maxReceiveCount` never
    /// moves a message the gate only waited on to the dead-letter queue. For a delivery
    /// that could not run yet (its key held by another transaction, a store outage), not
    /// for one that failed.
    ///
    /// When the consumer's stream is gone, the delivery cannot be held: its visibility
    /// is set to `delay` as [`nack`](Acker::nack) does (a new receive then counts).
    ///
    /// # Errors
    /// Only in that case, as [`nack`](Acker::nack).
    pub async fn defer(mut self, delay: Duration) -> Result<(), AckError> {
        if self.shared.back.is_closed() {
            return self.nack(Some(delay)).await;
        }
        let Some(original) = self.original.take() else {
            return Ok(());
        };
        let acker = SqsAcker {
            receipt: std::mem::take(&mut self.receipt),
            message_id: std::mem::take(&mut self.message_id),
            lease: self.lease,
            shared: Arc::clone(&self.shared),
            original: Some(Arc::clone(&original)),
        };
        self.shared.held.fetch_add(1, Ordering::AcqRel);
        crate::hold::hand_back_after(
            self.shared.back.clone(),
            original.delivery(acker),
            delay,
            |d: Delivery<SqsAcker>| {
                // The stream is gone: dropping the acker ends the lease.
                d.acker.shared.held.fetch_sub(1, Ordering::AcqRel);
            },
        );
        Ok(())
    }
}

fn batch_error(message: &str, retryable: bool) -> AckError {
    AckError::new(message.to_owned(), retryable, None)
}

#[async_trait]
impl Acker for SqsAcker {
    /// Goes into a `DeleteMessageBatch` with the acks that arrive meanwhile. The
    /// visibility is kept extended until the delete has answered.
    async fn ack(self, _proof: AckProof) -> Result<(), AckError> {
        let (reply, result) = oneshot::channel();
        if self
            .shared
            .deletes
            .send((self.receipt.clone(), reply))
            .is_err()
        {
            return self.delete().await;
        }
        match result.await {
            Ok(r) => r,
            Err(_) => Err(batch_error(
                "sqs: the batch delete ended without a result",
                true,
            )),
        }
    }

    /// Stops the extensions, then sets the visibility to `delay` (0: at once): the next
    /// receive of the message counts towards the redrive policy's `maxReceiveCount`.
    async fn nack(self, delay: Option<Duration>) -> Result<(), AckError> {
        self.shared.release(self.lease);
        // An extension round in flight may hold this receipt: let it land first.
        drop(self.shared.extending.lock().await);
        self.shared
            .client
            .change_message_visibility()
            .queue_url(&self.shared.queue_url)
            .receipt_handle(&self.receipt)
            .visibility_timeout(secs_i32(delay.unwrap_or(Duration::ZERO)))
            .send()
            .await
            .map_err(|e| {
                AckError::from(sdk_err(&self.shared.client, "ChangeMessageVisibility", e))
            })?;
        Ok(())
    }

    /// Held here, leased, and handed back after the delay with the same attempt: a
    /// deferral costs no receive (see [`SqsAcker::defer`]).
    async fn defer(self, delay: Duration) -> Result<(), AckError> {
        SqsAcker::defer(self, delay).await
    }

    /// True: `ApproximateReceiveCount` rises on a nack or a lost delivery (a crash), not
    /// on a deferral, which is held here.
    fn attempt_counts_runs(&self) -> bool {
        true
    }

    async fn dead_letter(
        self,
        payload: &[u8],
        headers: &Headers,
        reason: &RejectReason,
    ) -> Result<(), AckError> {
        let mut kept: Headers = headers
            .iter()
            .filter(|(k, _)| k != DEAD_LETTER_REASON_HEADER)
            .take(9)
            .cloned()
            .collect();
        kept.push((
            DEAD_LETTER_REASON_HEADER.to_owned(),
            sqs_text(&reason.to_string()),
        ));
        let attrs = attributes(&kept)?;
        // SQS bodies are text: a body that is not UTF-8 is kept as lossy text (the
        // reason says what was wrong with it).
        let body =
            body_text(payload).unwrap_or_else(|_| String::from_utf8_lossy(payload).into_owned());
        let mut send = self
            .shared
            .client
            .send_message()
            .queue_url(&self.shared.dead_letter_url)
            .message_body(body)
            .set_message_attributes(Some(attrs));
        if self.shared.dead_letter_url.ends_with(".fifo") {
            send = send
                .message_group_id("idem-dead-letter")
                .message_deduplication_id(&self.message_id);
        }
        match send.send().await {
            Ok(_) => self.delete().await,
            // Not dead-lettered: the message stays in the source and comes back.
            Err(e) => Err(sdk_err(&self.shared.client, "SendMessage dead-letter", e).into()),
        }
    }

    /// One `DeleteMessageBatch` per 10 messages.
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
        let receipts: Vec<String> = items.iter().map(|(a, _)| a.receipt.clone()).collect();
        let mut out: Vec<Result<(), AckError>> = Vec::with_capacity(n);
        let chunks = receipts
            .chunks(SQS_BATCH)
            .map(|chunk| delete_batch(&shared.client, &shared.queue_url, chunk));
        for r in futures::future::join_all(chunks).await {
            out.extend(r);
        }
        // The ackers (and their leases) live until every delete has answered.
        drop(items);
        out
    }
}

#[cfg(test)]
mod tests {
    //! On the real server (moto; `IDEM_TEST_SQS_ENDPOINT`, default
    //! `http://127.0.0.1:5000`): a missing server fails the test.

    use super::*;

    #[test]
    fn a_reason_keeps_only_what_sqs_takes() {
        let reason = "failed:\t\u{1b}[31mred\u{1b}[0m\r\nline \u{0}two \u{FFFF} é 🦀 \u{7f}";
        assert_eq!(
            sqs_text(reason),
            "failed:\t\u{FFFD}[31mred\u{FFFD}[0m\r\nline \u{FFFD}two \u{FFFD} é 🦀 \u{7f}"
        );
        assert_eq!(sqs_text("plain"), "plain");
    }

    fn endpoint() -> String {
        std::env::var("IDEM_TEST_SQS_ENDPOINT")
            .unwrap_or_else(|_| "http://127.0.0.1:5000".to_owned())
    }

    async fn queue_with(client: &Client, n: usize) -> (String, Vec<String>) {
        let name = format!("idem-test-batch-{:08x}", rand::random::<u32>());
        let url = client
            .create_queue()
            .queue_name(&name)
            .send()
            .await
            .expect("moto reachable (IDEM_TEST_SQS_ENDPOINT)")
            .queue_url
            .expect("url");
        for i in 0..n {
            client
                .send_message()
                .queue_url(&url)
                .message_body(format!("m{i}"))
                .send()
                .await
                .expect("send");
        }
        let mut receipts = Vec::new();
        while receipts.len() < n {
            let got = client
                .receive_message()
                .queue_url(&url)
                .max_number_of_messages(10)
                .visibility_timeout(60)
                .send()
                .await
                .expect("receive")
                .messages
                .unwrap_or_default();
            receipts.extend(got.into_iter().filter_map(|m| m.receipt_handle));
        }
        (url, receipts)
    }

    async fn left(client: &Client, url: &str) -> u64 {
        let a = client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(aws_sdk_sqs::types::QueueAttributeName::All)
            .send()
            .await
            .expect("attributes")
            .attributes
            .unwrap_or_default();
        [
            aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessages,
            aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
        ]
        .iter()
        .filter_map(|k| a.get(k).and_then(|v| v.parse::<u64>().ok()))
        .sum()
    }

    /// One `DeleteMessageBatch` with two good receipt handles and, between them, one the
    /// queue does not know (a handle of another queue's message) and one that is not a
    /// handle at all: SQS fails those entries and deletes the others. The result is an
    /// error exactly for the failed entries (an ack reported for them would be a lie:
    /// their messages are still there), and the queues agree.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_partial_delete_batch_failure_is_reported_per_entry() {
        let client = crate::sqs::client(Some(&endpoint())).await;
        let (url, mine) = queue_with(&client, 2).await;
        let (other_url, theirs) = queue_with(&client, 1).await;
        let batch = vec![
            mine[0].clone(),
            theirs[0].clone(),
            "not-a-receipt-handle".to_owned(),
            mine[1].clone(),
        ];
        let results = delete_batch(&client, &url, &batch).await;
        assert_eq!(results.len(), 4);
        assert!(results[0].is_ok(), "{:?}", results[0]);
        assert!(results[1].is_err(), "a stranger's handle reported deleted");
        assert!(results[2].is_err(), "a bad handle reported deleted");
        assert!(results[3].is_ok(), "{:?}", results[3]);
        assert!(!results[1].as_ref().unwrap_err().is_retryable());
        assert_eq!(left(&client, &url).await, 0, "both good ones deleted");
        assert_eq!(
            left(&client, &other_url).await,
            1,
            "the other queue's message stays"
        );
    }
}
