//! Receiving from a queue: [`SqsConsumer`] and its [`SqsAcker`].

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use aws_config::SdkConfig;
use aws_sdk_sqs::Client;
use futures::stream::BoxStream;
use futures::Stream;
use idem_core::{AckError, Delivery};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use super::config::SqsConfig;
use super::{client_for, client_of, open_queues, receive_client};
use crate::BrokerError;

mod acker;
mod reader;
mod tasks;
#[cfg(test)]
mod tests;

pub use acker::SqsAcker;
use reader::Reader;
use tasks::{delete_loop, keeper};

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
/// started; at the start, after a rerun and after an empty receive, receives ask for one
/// message, long-polled, until a first delivery (count 1) arrives. Only such a receive
/// waits: those that take a batch after a first delivery take what is visible at that
/// moment (no long poll), so the messages a dead process lost, coming visible later, come
/// one at a time and not several into one open receive. So when a message kills its process, SQS counts a receive
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
        Self::from_client(client_for(config).await?, config).await
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
    ///     // hand it to an `idem_engine::Gate`, which acks only after the commit
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
        let (client, queue_url, dead_letter_url) = open_queues(&client, config).await?;
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
