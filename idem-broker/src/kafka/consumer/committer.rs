//! Settled deliveries to committed offsets: the committer task.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{AckError, Headers, PositionStore};
use rdkafka::consumer::CommitMode;
use rdkafka::consumer::Consumer;
use rdkafka::producer::FutureProducer;
use rdkafka::Offset;
use tokio::sync::{mpsc, oneshot};

use super::acker::Dropped;
use super::ownership::{lock, Ownership};
use super::{Inner, COMMIT_RETRY_FIRST, COMMIT_RETRY_MAX};
use crate::kafka::attempts;
use crate::kafka::{blocking, BROKER};
use crate::BrokerError;

/// A settled delivery, for the committer.
pub(super) struct Settle {
    pub(super) partition: i32,
    pub(super) generation: u64,
    pub(super) offset: i64,
    pub(super) done: oneshot::Sender<Result<(), AckError>>,
}

/// A nacked delivery, handed back to the stream.
pub(super) struct Retry {
    pub(super) partition: i32,
    pub(super) generation: u64,
    pub(super) offset: i64,
    /// Deferred, not failed: handed back without counting another delivery.
    pub(super) deferred: bool,
    pub(super) key: Option<Vec<u8>>,
    pub(super) payload: Vec<u8>,
    pub(super) headers: Headers,
}

pub(super) struct Shared {
    pub(super) topic: String,
    pub(super) dead_letter: String,
    /// Where the delivery counts of this group's partitions are kept.
    pub(super) attempts: attempts::Store,
    pub(super) settle: mpsc::UnboundedSender<Settle>,
    pub(super) retry: mpsc::UnboundedSender<Retry>,
    /// Deliveries dropped unsettled, for the stream.
    pub(super) dropped: mpsc::UnboundedSender<Dropped>,
    pub(super) producer: FutureProducer,
    /// With positions stored: the store and this consumer's source name in it.
    pub(super) positions: Option<(Arc<dyn PositionStore>, Arc<str>)>,
    /// [`KafkaConfig::accept_position_gap`].
    pub(super) accept_position_gap: bool,
    /// What this member owns (a delivery's settled prefix, for its position).
    pub(super) own: Arc<Ownership>,
    /// Deliveries handed back (deferred or nacked) and not yet taken again: while they
    /// fill the prefetch the stream takes nothing new from the poller (whose channel
    /// fills, so it pauses the partitions), and memory stays bounded however long the
    /// store makes them wait.
    pub(super) holding: AtomicUsize,
    /// [`KafkaConfig::prefetch`].
    pub(super) prefetch: usize,
}

/// Settles `batch` and commits each owned partition's low-water mark, inside the fence.
fn commit_round(
    consumer: &Inner,
    own: &Ownership,
    topic: &str,
    batch: &[Settle],
) -> Result<(), BrokerError> {
    let _fence = lock(&own.fence);
    let tpl = {
        let mut o = own.owned();
        for s in batch {
            match o.parts.get_mut(&s.partition) {
                Some(p) if p.generation == s.generation => {
                    p.lwm.settle(s.offset);
                }
                // Revoked since: the new owner receives it again.
                _ => {}
            }
        }
        o.commits(topic)
    };
    if tpl.count() == 0 {
        return Ok(());
    }
    if consumer.assignment_lost() {
        // The session ended (the revoke is on its way): these marks may be behind what
        // a new owner committed since, so they are not sent (see `pre_rebalance`).
        let mut o = own.owned();
        for el in tpl.elements() {
            if let Some(p) = o.parts.get_mut(&el.partition()) {
                p.lwm.forget_commit();
            }
        }
        return Ok(());
    }
    let started = std::time::Instant::now();
    let r = consumer.commit(&tpl, CommitMode::Sync);
    tracing::debug!(target: "idem::broker", broker = BROKER, settled = batch.len(), took = ?started.elapsed(), "offset commit");
    match r {
        Ok(()) => {
            let mut o = own.owned();
            for el in tpl.elements() {
                if let Offset::Offset(m) = el.offset() {
                    o.committed(el.partition(), m);
                }
            }
            Ok(())
        }
        Err(e) => {
            // Take the same marks again in the next round.
            let mut o = own.owned();
            for el in tpl.elements() {
                if let Some(p) = o.parts.get_mut(&el.partition()) {
                    p.lwm.forget_commit();
                }
            }
            Err(BrokerError::op(BROKER, "commit", e))
        }
    }
}

/// Gathers settlements and commits each partition's low-water mark, once per burst. A
/// failed commit is tried again after a growing delay (up to 5 s) even when nothing
/// else settles, so a partition's mark never stays behind until a restart.
pub(super) async fn committer(
    consumer: Arc<Inner>,
    own: Arc<Ownership>,
    topic: String,
    mut rx: mpsc::UnboundedReceiver<Settle>,
) {
    let mut retry: Option<Duration> = None;
    loop {
        let batch = match retry {
            None => match rx.recv().await {
                Some(first) => vec![first],
                None => break,
            },
            Some(wait) => tokio::select! {
                s = rx.recv() => match s {
                    Some(first) => vec![first],
                    None => break,
                },
                () = tokio::time::sleep(wait) => Vec::new(),
            },
        };
        let mut batch = batch;
        while let Ok(s) = rx.try_recv() {
            batch.push(s);
        }
        let (c, o, t) = (Arc::clone(&consumer), Arc::clone(&own), topic.clone());
        let (batch, result) = match blocking(move || {
            let r = commit_round(&c, &o, &t, &batch);
            (batch, r)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(target: "idem::broker", broker = BROKER, error = %e, "the commit task failed");
                retry = Some(COMMIT_RETRY_FIRST);
                continue;
            }
        };
        retry = match &result {
            Ok(()) => None,
            Err(e) => {
                tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "commit failed; trying again");
                Some(retry.map_or(COMMIT_RETRY_FIRST, |w| (w * 2).min(COMMIT_RETRY_MAX)))
            }
        };
        for s in batch {
            let r = match &result {
                Ok(()) => Ok(()),
                Err(e) => Err(AckError::new(e.to_string(), true, None)),
            };
            let _ = s.done.send(r);
        }
    }
    if retry.is_some() {
        // A failed commit, and nothing more will settle: one last try.
        let (c, o, t) = (Arc::clone(&consumer), Arc::clone(&own), topic.clone());
        let _ = blocking(move || commit_round(&c, &o, &t, &[])).await;
    }
    // Every acker and the stream are gone: close the consumer (it leaves the group)
    // off the async workers. A plain drop; no unsubscribe first (that hung on tansu).
    let _ = blocking(move || drop(consumer)).await;
}
