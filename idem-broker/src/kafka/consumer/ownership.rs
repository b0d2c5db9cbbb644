//! What the member owns: the partitions of its assignment and their trackers, kept in
//! step with the group's rebalances.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::Consumer;
use rdkafka::consumer::{BaseConsumer, CommitMode, ConsumerContext, Rebalance};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::Notify;

use crate::kafka::attempts;
use crate::kafka::lwm::LowWaterMark;
use crate::kafka::BROKER;

/// One partition as this member owns it: an assignment generation and its tracker.
#[derive(Debug)]
pub(super) struct Part {
    pub(super) generation: u64,
    pub(super) lwm: LowWaterMark,
    /// The first offset this ownership delivered: where a successor would start too.
    pub(super) first: Option<i64>,
    /// The partition's record in `NAME.attempts` as last read or written; `None` until
    /// read (once per ownership, before its first delivery is handed out).
    pub(super) durable: Option<attempts::Record>,
    /// With positions stored: the partition as this ownership took it from the store
    /// (once, before its first delivery is handed out); `None` until then.
    pub(super) taken: Option<Taken>,
    /// Seeking back to the stored position from the first offset fetched (the group's
    /// offset was ahead of it): until a delivery at or below that offset arrives, those
    /// above it were fetched before the seek and are dropped ([`Owned::rewind`]).
    pub(super) rewind: Option<i64>,
}

/// A partition taken from the position store ([`idem_core::PositionStore`]).
#[derive(Debug)]
pub(super) struct Taken {
    pub(super) epoch: i64,
    /// Every offset below it is done: skipped.
    pub(super) next: Option<i64>,
    /// Offsets at or past `next` that are done: skipped.
    pub(super) done: std::collections::BTreeSet<i64>,
}

#[derive(Debug, Default)]
pub(super) struct Owned {
    pub(super) parts: HashMap<i32, Part>,
    next_generation: u64,
    /// Deliveries of each offset by this member not yet committed past, counted across
    /// its ownerships of the partition and the nacks in between.
    pub(super) attempts: HashMap<i32, BTreeMap<i64, u32>>,
    /// Per partition, the highest [`attempts::Record::ahead`] read: every offset up to
    /// it may have been handed out by an earlier member, so this member counts it as
    /// delivered once before.
    inherited: HashMap<i32, i64>,
}

impl Owned {
    pub(super) fn part(&mut self, partition: i32) -> &mut Part {
        let next = &mut self.next_generation;
        self.parts.entry(partition).or_insert_with(|| {
            *next += 1;
            Part {
                generation: *next,
                lwm: LowWaterMark::new(),
                first: None,
                durable: None,
                taken: None,
                rewind: None,
            }
        })
    }

    /// Ends the ownership of every partition but `held`.
    fn forget_all_but(&mut self, held: impl IntoIterator<Item = i32>) {
        let held: std::collections::BTreeSet<i32> = held.into_iter().collect();
        self.parts.retain(|p, _| held.contains(p));
    }

    /// Starts the ownership of `partition` (at `generation`) over, for a seek back to
    /// an earlier offset: a new generation (what was handed out or fetched under the old
    /// one is dropped, never settled), an empty tracker, each offset in flight uncounted
    /// (it comes again), and the deliveries fetched past the highest one registered
    /// dropped until the seek takes effect ([`Part::rewind`]). `retake`: the partition is
    /// taken from the position store again before its next delivery. Returns the new
    /// generation and the old tracker's mark (where nothing is lost by reading again),
    /// or `None` when the partition was revoked meanwhile.
    pub(super) fn rewind(
        &mut self,
        partition: i32,
        generation: u64,
        retake: bool,
    ) -> Option<(u64, Option<i64>)> {
        let old = self.parts.remove(&partition)?;
        if old.generation != generation {
            self.parts.insert(partition, old);
            return None;
        }
        if let Some(counts) = self.attempts.get_mut(&partition) {
            for offset in old.lwm.in_flight_offsets() {
                if let Some(n) = counts.get_mut(&offset) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        counts.remove(&offset);
                    }
                }
            }
        }
        self.next_generation += 1;
        let generation = self.next_generation;
        self.parts.insert(
            partition,
            Part {
                generation,
                lwm: LowWaterMark::new(),
                first: None,
                durable: old.durable,
                taken: if retake { None } else { old.taken },
                rewind: old.lwm.highest(),
            },
        );
        Some((generation, old.lwm.mark()))
    }

    /// One more delivery of `offset`: its attempt number.
    pub(super) fn attempt(&mut self, partition: i32, offset: i64) -> u32 {
        let before = u32::from(self.inherited.get(&partition).is_some_and(|&a| offset <= a));
        let n = self
            .attempts
            .entry(partition)
            .or_default()
            .entry(offset)
            .or_insert(before);
        *n = n.saturating_add(1);
        *n
    }

    /// The count of the delivery of `offset` under way (1 when none was counted).
    pub(super) fn current_attempt(&self, partition: i32, offset: i64) -> u32 {
        self.attempts
            .get(&partition)
            .and_then(|a| a.get(&offset))
            .copied()
            .unwrap_or(1)
            .max(1)
    }

    /// Takes the record read from `NAME.attempts` into this member's counts: an offset
    /// delivered already (its delivery under way) is at least one past the record, one
    /// not delivered yet starts from it; an offset up to the record's `ahead` that it
    /// does not count was delivered once.
    pub(super) fn seed(&mut self, partition: i32, read: &attempts::Record) {
        let mine = self.attempts.entry(partition).or_default();
        if let Some(a) = read.ahead {
            let inherited = self.inherited.entry(partition).or_insert(a);
            *inherited = (*inherited).max(a);
            for (offset, m) in mine.range_mut(..=a) {
                if !read.counts.contains_key(offset) {
                    *m = (*m).max(2);
                }
            }
        }
        for (&offset, &n) in &read.counts {
            mine.entry(offset)
                .and_modify(|m| *m = (*m).max(n.saturating_add(1)))
                .or_insert(n);
        }
    }

    /// Forgets the counts of offsets below a committed `mark`.
    pub(super) fn committed(&mut self, partition: i32, mark: i64) {
        if let Some(a) = self.attempts.get_mut(&partition) {
            *a = a.split_off(&mark);
        }
    }

    /// Each partition's offset to commit, if it moved.
    pub(super) fn commits(&mut self, topic: &str) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        for (p, part) in &mut self.parts {
            if let Some(o) = part.lwm.take_commit() {
                let _ = tpl.add_partition_offset(topic, *p, Offset::Offset(o));
            }
        }
        tpl
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the member owns, and the fence that keeps commits inside the ownership.
#[derive(Debug, Default)]
pub(super) struct Ownership {
    owned: Mutex<Owned>,
    /// Held across "take the marks, commit them" by the committer, and across the
    /// revoke by the rebalance callback: a mark taken before a revoke is committed
    /// before the revoke completes, or not at all (the revoke drops the partition's
    /// tracker, and the next round takes nothing for it).
    pub(super) fence: Mutex<()>,
}

impl Ownership {
    pub(super) fn owned(&self) -> MutexGuard<'_, Owned> {
        lock(&self.owned)
    }
}

/// The consumer's context: keeps the trackers in step with the group's assignment.
pub(super) struct GroupContext {
    pub(super) topic: String,
    pub(super) debug: bool,
    pub(super) own: Arc<Ownership>,
    pub(super) assigned: Arc<Notify>,
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        if self.debug {
            // Asked for with IDEM_KAFKA_DEBUG: straight to stderr, with the time.
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            eprintln!(
                "{}.{:03} rdkafka {level:?} {fac}: {log_message}",
                t.as_secs(),
                t.subsec_millis()
            );
        } else {
            DefaultClientContext.log(level, fac, log_message);
        }
    }
}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // Wait for a commit in flight, then commit the settled prefix of what is
            // taken away and drop the rest: the new owner receives it again and skips
            // the committed part as duplicates.
            //
            // An assignment *lost* (the session timed out, or the member was fenced)
            // commits nothing: the partitions may have gone to another member, which
            // has committed further since, and a commit of this member's older mark —
            // sent once the coordinator answers again, under a generation a server may
            // not check (tansu does not) — would move the group's offset backwards.
            let _fence = lock(&self.own.fence);
            let lost = base.assignment_lost();
            let mut commit = TopicPartitionList::new();
            {
                let mut owned = self.own.owned();
                for e in tpl.elements_for_topic(&self.topic) {
                    if let Some(mut part) = owned.parts.remove(&e.partition()) {
                        if lost {
                            tracing::info!(target: "idem::broker", broker = BROKER, partition = e.partition(), "assignment lost: the partition's settled offsets are left uncommitted (its new owner skips them as duplicates)");
                        } else if let Some(o) = part.lwm.take_commit() {
                            let _ = commit.add_partition_offset(
                                &self.topic,
                                e.partition(),
                                Offset::Offset(o),
                            );
                        }
                        if part.lwm.in_flight() > 0 {
                            tracing::debug!(target: "idem::broker", broker = BROKER, partition = e.partition(), dropped = part.lwm.in_flight(), "partition revoked with deliveries in flight");
                        }
                    }
                }
            }
            if commit.count() > 0 {
                match base.commit(&commit, CommitMode::Sync) {
                    Ok(()) => {
                        let mut owned = self.own.owned();
                        for e in commit.elements() {
                            if let Offset::Offset(m) = e.offset() {
                                owned.committed(e.partition(), m);
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, "commit on revoke failed; the new owner skips the redeliveries");
                    }
                }
            }
        }
    }

    fn post_rebalance(&self, base: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                {
                    let mut owned = self.own.owned();
                    for e in tpl.elements_for_topic(&self.topic) {
                        // A fresh generation: settlements of an earlier ownership are
                        // ignored.
                        owned.parts.remove(&e.partition());
                        owned.part(e.partition());
                    }
                }
                self.assigned.notify_one();
            }
            Rebalance::Error(e) => {
                // rdkafka has unassigned what the failed rebalance named (every
                // partition, under an eager protocol): the ownership of what this
                // member no longer holds ends here, so none of its deliveries settles
                // or is dead-lettered under it.
                let held = base.assignment().ok();
                let held = held
                    .as_ref()
                    .map(|tpl| tpl.elements_for_topic(&self.topic))
                    .unwrap_or_default();
                let mut owned = self.own.owned();
                let before = owned.parts.len();
                owned.forget_all_but(held.iter().map(|e| e.partition()));
                tracing::warn!(target: "idem::broker", broker = BROKER, error = %e, released = before - owned.parts.len(), "rebalance failed; the partitions it took away are no longer this member's");
            }
            Rebalance::Revoke(_) => {}
        }
    }
}
