//! The polling task, its watchdog, and the reader the stream pulls from.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::Delivery;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::mpsc;

use super::acker::{Dropped, KafkaAcker};
use super::committer::Retry;
use super::convert::Converter;
use super::ownership::lock;
use super::Inner;
use crate::kafka::{blocking, BROKER};
use crate::BrokerError;

pub(super) type Polled = Result<Delivery<KafkaAcker>, BrokerError>;

/// Checks a partition's stored position `next` against its log: past the log's end, the
/// position belongs to another log (the topic was recreated, or the store serves another
/// cluster) and skipping up to it would skip records never processed; behind the log's
/// start with the group's committed offset behind it too (or none), the records between
/// were deleted by the topic's retention before anyone processed them. Either is a
/// [`BrokerError::Config`] (the second only unless `accept`); a failed request another
/// error (the caller tries again). Returns the log's start (its low watermark).
pub(super) fn check_log(
    consumer: &Inner,
    topic: &str,
    partition: i32,
    next: i64,
    accept: bool,
) -> Result<i64, BrokerError> {
    let (low, high) = consumer
        .fetch_watermarks(topic, partition, crate::kafka::REQUEST_TIMEOUT)
        .map_err(|e| BrokerError::op(BROKER, "fetch the watermarks", e))?;
    if next > high {
        return Err(BrokerError::Config {
            broker: BROKER,
            detail: format!(
                "partition {partition} of {topic:?}: the stored position {next} is past the \
                 end of the log ({high}): the topic was recreated, or the store belongs to \
                 another cluster; nothing of the partition is consumed (delete its rows from \
                 idem_positions to start from the group's offsets)"
            ),
        });
    }
    if next >= low || accept {
        return Ok(low);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    let committed = consumer
        .committed_offsets(tpl, crate::kafka::REQUEST_TIMEOUT)
        .map_err(|e| BrokerError::op(BROKER, "read the group's committed offset", e))?;
    let group_offset = committed
        .find_partition(topic, partition)
        .and_then(|e| match e.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        });
    if group_offset.is_some_and(|c| c >= low) {
        // The records between were settled by a member (the group's offset moves only
        // past settled records) before the retention deleted them.
        return Ok(low);
    }
    Err(BrokerError::Config {
        broker: BROKER,
        detail: format!(
            "partition {partition} of {topic:?}: the stored position {next} is behind the \
             start of the log ({low}) and so is the group's offset ({}): records {next} to \
             {} were deleted before they were processed (`positions_gap=accept` goes on from \
             {low})",
            group_offset.map_or_else(|| "none".to_owned(), |c| c.to_string()),
            low - 1
        ),
    })
}

/// Pauses (or resumes) every partition assigned now.
fn set_paused(consumer: &Inner, paused: bool) {
    let Ok(assignment) = consumer.assignment() else {
        return;
    };
    if assignment.count() == 0 {
        return;
    }
    let r = if paused {
        consumer.pause(&assignment)
    } else {
        consumer.resume(&assignment)
    };
    if let Err(e) = r {
        tracing::debug!(target: "idem::broker", broker = BROKER, error = %e, paused, "pause/resume");
    }
}

/// Sorts an error from the consumer's poll: `None` for one librdkafka recovers from by
/// itself (logged and counted in `errors`; polling goes on), the error that ends the
/// stream for a fatal one (librdkafka's fatal-error state: the client instance is no
/// longer usable).
///
/// librdkafka hands its transient trouble to the poll as errors: a broker connection
/// lost (`BrokerTransportFailure`), every broker down (`AllBrokersDown`), a partition's
/// leader unknown for a while, a rejoin. It reconnects, rejoins the group and resumes
/// fetching on its own, so ending the stream on them would turn a broker restart into a
/// rebalance of the whole group.
fn poll_error(
    consumer: &Inner,
    e: KafkaError,
    errors: &AtomicU64,
    down: &Mutex<Option<std::time::Instant>>,
) -> Option<BrokerError> {
    let fatal = match &e {
        KafkaError::MessageConsumptionFatal(_) => true,
        _ => consumer.client().fatal_error().is_some(),
    };
    if fatal {
        let detail = consumer.client().fatal_error().map_or_else(
            || e.to_string(),
            |(code, text)| format!("{e}: {code}: {text}"),
        );
        tracing::error!(target: "idem::broker", broker = BROKER, error = %detail, "fatal consumer error: the stream ends");
        return Some(BrokerError::op(BROKER, "poll", detail));
    }
    // Trouble from here on: the watchdog (`unreachable`) asks the cluster until it answers.
    lock(down).get_or_insert_with(std::time::Instant::now);
    let n = errors.fetch_add(1, Ordering::Relaxed) + 1;
    tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, code = ?e.rdkafka_error_code(), transient_errors = n, "consumer error; librdkafka recovers, polling goes on");
    None
}

/// Polls librdkafka for the stream: up to the channel's capacity ahead. When the channel
/// is full it waits for room (librdkafka goes on fetching into its own bounded queue);
/// only when no room comes within `pause_after` (a slow handler) are the partitions
/// paused and polling goes on (serving rebalances and librdkafka's
/// `max.poll.interval.ms`) until there is room again. Pausing at once whenever the
/// channel is full made a consumer that takes one delivery at a time pause and resume
/// for every few messages, each resume waiting for a new fetch (57 msg/s on tansu).
/// librdkafka reports passing trouble (a broker's connection lost, every broker down, a
/// partition's leader moving) as errors from the consumer's poll and recovers by itself:
/// those are logged and counted in `errors` and polling goes on ([`poll_error`]). Ends
/// when the stream is dropped, or after handing over a fatal error.
pub(super) async fn poller(
    consumer: Arc<Inner>,
    convert: Converter,
    tx: mpsc::Sender<Polled>,
    pause_after: Duration,
    errors: Arc<AtomicU64>,
    down: Arc<Mutex<Option<std::time::Instant>>>,
) {
    // Messages that arrived while paused (fetched before the pause, or from a partition
    // assigned meanwhile): handed over first.
    let mut held: VecDeque<Polled> = VecDeque::new();
    let mut paused = false;
    loop {
        let permit = match tx.try_reserve() {
            Ok(p) => p,
            Err(mpsc::error::TrySendError::Closed(())) => return,
            Err(mpsc::error::TrySendError::Full(())) => {
                if !paused {
                    tokio::select! {
                        p = tx.reserve() => match p {
                            Ok(p) => p,
                            Err(_) => return,
                        },
                        () = tokio::time::sleep(pause_after) => {
                            set_paused(&consumer, true);
                            paused = true;
                            continue;
                        }
                    }
                } else {
                    tokio::select! {
                    p = tx.reserve() => match p {
                        Ok(p) => p,
                        Err(_) => return,
                    },
                    m = consumer.recv() => {
                        let m = match m {
                            Ok(m) => {
                                *lock(&down) = None;
                                Ok(convert.delivery(&m))
                            }
                            Err(e) => match poll_error(&consumer, e, &errors, &down) {
                                Some(fatal) => Err(fatal),
                                None => continue,
                            },
                        };
                        // A partition assigned while paused is not paused: pause again.
                        set_paused(&consumer, true);
                        held.push_back(m);
                        continue;
                    }
                    }
                }
            }
        };
        if paused && held.is_empty() {
            set_paused(&consumer, false);
            paused = false;
        }
        let item = match held.pop_front() {
            Some(item) => item,
            None => tokio::select! {
                m = consumer.recv() => match m {
                    Ok(m) => {
                        *lock(&down) = None;
                        Ok(convert.delivery(&m))
                    }
                    Err(e) => match poll_error(&consumer, e, &errors, &down) {
                        Some(fatal) => Err(fatal),
                        // The permit is dropped and taken again: nothing is lost.
                        None => continue,
                    },
                },
                () = tx.closed() => return,
            },
        };
        let failed = item.is_err();
        permit.send(item);
        if failed {
            return;
        }
    }
}

/// How often the watchdog asks an unanswering cluster for its metadata.
const UNREACHABLE_PROBE_EVERY: Duration = Duration::from_secs(2);

/// Ends the stream once every broker has stayed unreachable for the member's session
/// timeout: librdkafka reconnects for ever and reports its trouble as transient errors
/// (a cluster gone for good, a revoked credential, an ACL that now refuses), and by then
/// the group has dropped the member, so nothing is lost by starting over. While the poll
/// reports trouble (`down` is set) it asks the cluster for the topic's metadata every
/// two seconds; an answer (or a message) clears it. The error it hands the stream is a
/// [`BrokerError::Connect`]: `idem consume` reconnects under `--reconnect-timeout`, and a
/// cluster that stays away ends the run with exit 1.
pub(super) async fn unreachable(
    consumer: Arc<Inner>,
    topic: String,
    tx: mpsc::Sender<Polled>,
    session: Duration,
    down: Arc<Mutex<Option<std::time::Instant>>>,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(UNREACHABLE_PROBE_EVERY) => {}
            () = tx.closed() => return,
        }
        let Some(since) = *lock(&down) else {
            continue;
        };
        let (c, t) = (Arc::clone(&consumer), topic.clone());
        let answered = blocking(move || {
            c.fetch_metadata(Some(&t), UNREACHABLE_PROBE_EVERY)
                .map(drop)
                .map_err(|e| BrokerError::op(BROKER, "fetch the metadata", e))
        })
        .await
        .and_then(|r| r);
        if answered.is_ok() {
            *lock(&down) = None;
            continue;
        }
        let gone = since.elapsed();
        if gone >= session {
            tracing::error!(target: "idem::broker", broker = BROKER, seconds = gone.as_secs(), "every broker unreachable for the session timeout: the stream ends");
            let _ = tx
                .send(Err(BrokerError::connect(
                    BROKER,
                    format!(
                        "no broker of the cluster answered for {} s (the session timeout: the \
                         group has dropped this member)",
                        gone.as_secs()
                    ),
                )))
                .await;
            return;
        }
    }
}

/// One hand-back taken again: counted off `holding`, which each hand-back raised when it
/// was made (`KafkaAcker::hand_back`). One not counted would make a plain decrement wrap,
/// and the stream would never take a polled delivery again (its member keeping its
/// partitions, their commits stuck); the count stays at zero instead, and a debug build
/// fails loudly.
fn taken_back(holding: &std::sync::atomic::AtomicUsize) {
    let before = holding
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            Some(n.saturating_sub(1))
        })
        .unwrap_or_default();
    debug_assert!(before > 0, "a hand-back came back that was not counted");
}

pub(super) struct Reader {
    /// The delivery polled while joining, handed out first.
    pub(super) joined: Option<Delivery<KafkaAcker>>,
    pub(super) polled: mpsc::Receiver<Polled>,
    pub(super) convert: Arc<Converter>,
    pub(super) retries: mpsc::UnboundedReceiver<Retry>,
    pub(super) dropped: mpsc::UnboundedReceiver<Dropped>,
}

impl crate::pull::Pull for Reader {
    type Acker = KafkaAcker;

    async fn next(&mut self) -> Result<Delivery<KafkaAcker>, BrokerError> {
        if let Some(d) = self.joined.take() {
            if let Some(d) = self.convert.positioned(d).await? {
                return Ok(self.convert.counted(d).await);
            }
        }
        loop {
            // Deliveries handed back fill the prefetch: only they are taken until there is
            // room (the poller's channel fills meanwhile and it pauses the partitions).
            let shared = &self.convert.shared;
            let room = shared.holding.load(Ordering::Acquire) < shared.prefetch;
            tokio::select! {
                biased;
                Some(d) = self.dropped.recv() => self.convert.dropped(d).await?,
                Some(r) = self.retries.recv() => {
                    taken_back(&self.convert.shared.holding);
                    if let Some(d) = self.convert.retried(r) {
                        return Ok(self.convert.counted(d).await);
                    }
                }
                m = self.polled.recv(), if room => {
                    match m {
                        Some(Ok(d)) => {
                            if let Some(d) = self.convert.positioned(d).await? {
                                return Ok(self.convert.counted(d).await);
                            }
                        }
                        Some(Err(e)) => return Err(e),
                        None => {
                            return Err(BrokerError::op(BROKER, "poll", "the polling task ended"))
                        }
                    }
                }
            }
        }
    }
}
