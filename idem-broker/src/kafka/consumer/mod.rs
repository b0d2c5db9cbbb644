//! Consuming a topic in a group: [`KafkaConsumer`] and its [`KafkaAcker`].

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::Stream;
use idem_core::Delivery;
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use tokio::sync::{mpsc, Notify};

use super::attempts::{self, attempts_name};
use super::config::KafkaConfig;
use super::{blocking, consumer_producer, ensure_topic, ensure_topic_with, BROKER};
use crate::{dead_letter_name, BrokerError};

mod acker;
mod committer;
mod convert;
mod ownership;
mod poll;

pub use acker::KafkaAcker;
use committer::{committer, Shared};
use convert::Converter;
use ownership::{GroupContext, Ownership};
use poll::{poller, unreachable, Polled, Reader};

/// How often a failed dead-letter produce is tried before the delivery is handed back.
const DEAD_LETTER_TRIES: u32 = 3;
/// How far past the delivery being handed out a record's `ahead` reaches: one write to
/// `NAME.attempts` per this many deliveries (at most), and at most this many offsets
/// counted once too often by a successor (they run as reruns, which the gate records
/// in the store rather than charging them).
const AHEAD_WINDOW: i64 = 256;

/// The first and the longest wait before a failed commit is tried again.
const COMMIT_RETRY_FIRST: Duration = Duration::from_millis(100);
const COMMIT_RETRY_MAX: Duration = Duration::from_secs(5);
/// How long a delivery whose dead-letter produce failed waits before it comes back.
const DEAD_LETTER_RETRY_DELAY: Duration = Duration::from_secs(1);

type Inner = StreamConsumer<GroupContext>;

/// The longest the polling task waits for room before it pauses the partitions.
const PAUSE_AFTER_MAX: Duration = Duration::from_secs(1);

/// Deliveries of a topic to this member of a consumer group, as a stream of
/// `Result<Delivery<KafkaAcker>, BrokerError>`. Each delivery carries the message key
/// (if any) in the `idem-kafka-key` header, and its [`attempt`](Delivery::attempt):
/// how often the group delivered that offset (a nack, or the partition coming back
/// before the offset was committed, counts again; a deferral does not), kept across
/// members and restarts in `NAME.attempts` (see the [module docs](super)).
///
/// Errors librdkafka recovers from by itself (a broker connection lost, every broker
/// down) are logged and counted ([`transient_errors`](Self::transient_errors)) and the
/// stream goes on; a fatal one ends it, and so does a cluster of which no broker answered
/// for the [session timeout](KafkaConfig::session_timeout) (a
/// [`BrokerError::Connect`]: by then the group has dropped the member).
///
/// A task of its own polls librdkafka and keeps up to
/// [`prefetch`](KafkaConfig::prefetch) deliveries waiting; when they are not taken for
/// a while (a tenth of `max.poll.interval.ms`, at most 1 s) it pauses the assigned
/// partitions and keeps polling (so the member stays in the group however slow the
/// handler: `max.poll.interval.ms` is met), and resumes them once there is room.
/// Deliveries handed back (deferred, nacked with a delay, or whose dead letter could not
/// be produced) count against the prefetch until they come back: while they fill it the
/// stream takes nothing new, so the partitions pause and memory stays bounded however
/// long the store makes them wait.
pub struct KafkaConsumer {
    inner: BoxStream<'static, Result<Delivery<KafkaAcker>, BrokerError>>,
    name: String,
    group: String,
    transient_errors: Arc<AtomicU64>,
    skipped: Arc<AtomicU64>,
}

impl std::fmt::Debug for KafkaConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("name", &self.name)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

/// The header that carries a message's key (lossy UTF-8) on a delivery.
pub const KEY_HEADER: &str = "idem-kafka-key";

impl KafkaConsumer {
    /// Creates the topic and its dead-letter topic if missing (replication
    /// [`KafkaConfig::replication`]), joins the group and waits (up to
    /// [`KafkaConfig::join_timeout`]) for its first assignment.
    ///
    /// # Errors
    /// [`BrokerError::Connect`] when the cluster cannot be reached or the group assigns
    /// nothing in time; an invalid name.
    pub async fn connect(config: &KafkaConfig) -> Result<Self, BrokerError> {
        let positions = match &config.positions {
            super::Positions::Broker => None,
            super::Positions::Store(Some(h)) => {
                Some((Arc::clone(&h.0), Arc::<str>::from(config.position_source())))
            }
            super::Positions::Store(None) => {
                return Err(BrokerError::InvalidParam {
                    param: "positions".to_owned(),
                    value: "store".to_owned(),
                    reason: "needs a position store: KafkaConfig::with_position_store (idem \
                             consume gives its --store, which must be Postgres or SQLite)"
                        .to_owned(),
                })
            }
        };
        let dead_letter = dead_letter_name(&config.name);
        ensure_topic(config, &config.name).await?;
        ensure_topic(config, &dead_letter).await?;
        let attempts_topic = attempts_name(&config.name);
        ensure_topic_with(config, &attempts_topic, &[("cleanup.policy", "compact")]).await?;
        let attempts_partitions = {
            let (meta_config, topic) = (config.client_config(), attempts_topic.clone());
            blocking(move || {
                let meta: BaseConsumer = meta_config
                    .create()
                    .map_err(|e| BrokerError::connect(BROKER, e))?;
                super::partition_count(&meta, &topic)
            })
            .await??
        };
        let own = Arc::new(Ownership::default());
        let assigned = Arc::new(Notify::new());
        let context = GroupContext {
            topic: config.name.clone(),
            debug: super::debug_contexts().is_some(),
            own: Arc::clone(&own),
            assigned: Arc::clone(&assigned),
        };
        let prefetch = config.prefetch.max(1);
        let consumer: Inner = config
            .consumer_config()
            .create_with_context(context)
            .map_err(|e| BrokerError::connect(BROKER, e))?;
        consumer
            .subscribe(&[&config.name])
            .map_err(|e| BrokerError::op(BROKER, "subscribe", e))?;
        let consumer = Arc::new(consumer);
        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        let (retry_tx, retry_rx) = mpsc::unbounded_channel();
        let (dropped_tx, dropped_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            topic: config.name.clone(),
            dead_letter,
            attempts: attempts::Store {
                kafka: config.clone(),
                topic: attempts_topic,
                group: config.group.clone(),
                partitions: i32::try_from(attempts_partitions).unwrap_or(1).max(1),
            },
            settle: settle_tx,
            retry: retry_tx,
            dropped: dropped_tx,
            producer: consumer_producer(config)?,
            positions,
            accept_position_gap: config.accept_position_gap,
            own: Arc::clone(&own),
            holding: AtomicUsize::new(0),
            prefetch,
        });
        tokio::spawn(committer(
            Arc::clone(&consumer),
            Arc::clone(&own),
            config.name.clone(),
            settle_rx,
        ));
        let skipped = Arc::new(AtomicU64::new(0));
        let convert = Converter {
            own: Arc::clone(&own),
            shared: Arc::clone(&shared),
            consumer: None,
            skipped: Arc::clone(&skipped),
        };
        let (polled_tx, mut polled) = mpsc::channel(prefetch);
        let retries_convert = Arc::new(Converter {
            own,
            shared,
            consumer: Some(Arc::clone(&consumer)),
            skipped: Arc::clone(&skipped),
        });
        // Pause only for a stall well inside max.poll.interval.ms (see `poller`).
        let pause_after = (config.max_poll_interval / 10).min(PAUSE_AFTER_MAX);
        let transient_errors = Arc::new(AtomicU64::new(0));
        let down = Arc::new(Mutex::new(None));
        tokio::spawn(unreachable(
            Arc::clone(&consumer),
            config.name.clone(),
            polled_tx.clone(),
            config.session_timeout,
            Arc::clone(&down),
        ));
        tokio::spawn(poller(
            Arc::clone(&consumer),
            convert,
            polled_tx,
            pause_after,
            Arc::clone(&transient_errors),
            down,
        ));
        // Polling drives the join; stop at the first assignment or message.
        let mut first: Option<Polled> = None;
        let joined = tokio::time::timeout(config.join_timeout, async {
            tokio::select! {
                () = assigned.notified() => {}
                m = polled.recv() => first = m,
            }
        })
        .await;
        if joined.is_err() {
            return Err(BrokerError::connect(
                BROKER,
                format!(
                    "group {:?} assigned no partition of {:?} within {:?}",
                    config.group, config.name, config.join_timeout
                ),
            ));
        }
        let joined = match first {
            Some(Err(e)) => return Err(e),
            Some(Ok(d)) => Some(d),
            None => None,
        };
        let reader = Reader {
            joined,
            polled,
            convert: retries_convert,
            retries: retry_rx,
            dropped: dropped_rx,
        };
        let inner = crate::pull::deliveries(reader);
        Ok(Self {
            inner,
            name: config.name.clone(),
            group: config.group.clone(),
            transient_errors,
            skipped,
        })
    }

    /// How many errors librdkafka reported from the poll that it recovers from by itself
    /// (a broker connection lost, every broker down): logged, counted here, and the
    /// stream goes on. Only a fatal error ends the stream.
    pub fn transient_errors(&self) -> u64 {
        self.transient_errors.load(Ordering::Relaxed)
    }

    /// With positions stored: how many deliveries were skipped, not handed out, because
    /// the position store holds them done (fetched before the seek to the stored
    /// position took effect, or done past it).
    pub fn skipped_by_position(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }
}

impl Stream for KafkaConsumer {
    type Item = Result<Delivery<KafkaAcker>, BrokerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}
