//! Delivery counts that outlive the member: the topic `NAME.attempts`.
//!
//! Kafka keeps no delivery count, so a member counts the deliveries of each offset
//! itself; a message that kills the process would come back to the next member as a
//! first delivery, for ever. The counts a successor needs are therefore written to the
//! broker before the deliveries they count are handed out: one record per (group,
//! partition), key `GROUP/PARTITION`, value `OFFSET:COUNT,…,ahead:OFFSET`, in the
//! partition of `NAME.attempts` numbered like the source's (modulo its partition count).
//! `ahead` bounds the offsets its writer may have handed out: a successor counts every
//! offset up to it as delivered once at least, so a delivery fetched ahead of the first
//! of an ownership, which no count names, is still seen as a rerun if its member died
//! holding it. The last record of a key is the one that counts; the topic is created
//! compacted (`cleanup.policy=compact`), so Kafka keeps one per key.
//!
//! Not the committed offset's metadata, which is where Kafka itself would keep it: the
//! test broker (tansu 0.6) stores an offset commit's metadata but answers every
//! OffsetFetch with an empty one.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use super::{BROKER, REQUEST_TIMEOUT};
use crate::BrokerError;

/// The topic that holds the delivery counts of topic `name`'s groups.
pub(crate) fn attempts_name(name: &str) -> String {
    format!("{name}.attempts")
}

/// The record key of `group`'s partition `partition`.
pub(crate) fn key(group: &str, partition: i32) -> String {
    format!("{group}/{partition}")
}

/// A partition's record in `NAME.attempts`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Record {
    /// Deliveries counted per offset (those a successor must count on).
    pub(crate) counts: BTreeMap<i64, u32>,
    /// Every offset up to this one may have been handed out by the record's writer: a
    /// successor counts each as delivered once at least. `None` in records of versions
    /// that did not write it.
    pub(crate) ahead: Option<i64>,
}

/// The entry name of [`Record::ahead`].
const AHEAD: &str = "ahead";

/// `OFFSET:COUNT,…` (offsets in order), then `ahead:OFFSET` when set.
pub(crate) fn encode(record: &Record) -> String {
    record
        .counts
        .iter()
        .map(|(o, n)| format!("{o}:{n}"))
        .chain(record.ahead.map(|a| format!("{AHEAD}:{a}")))
        .collect::<Vec<_>>()
        .join(",")
}

/// A record's value; a malformed entry is skipped (a count is advice, never a reason
/// to stop consuming).
pub(crate) fn decode(value: &[u8]) -> Record {
    let mut record = Record::default();
    for e in String::from_utf8_lossy(value).split(',') {
        let Some((o, n)) = e.trim().split_once(':') else {
            continue;
        };
        if o == AHEAD {
            record.ahead = n.parse().ok().filter(|a: &i64| *a >= 0).or(record.ahead);
        } else if let (Ok(o), Ok(n)) = (o.parse::<i64>(), n.parse::<u32>()) {
            if o >= 0 && n > 0 {
                record.counts.insert(o, n);
            }
        }
    }
    record
}

/// Where a partition's counts go in `NAME.attempts`.
#[derive(Debug, Clone)]
pub(crate) struct Store {
    /// The cluster and how to reach it.
    pub(crate) kafka: super::KafkaConfig,
    pub(crate) topic: String,
    pub(crate) group: String,
    /// Partitions of `NAME.attempts` (at least 1).
    pub(crate) partitions: i32,
}

impl Store {
    fn partition_of(&self, partition: i32) -> i32 {
        partition.rem_euclid(self.partitions.max(1))
    }

    /// The last record written for `partition` (empty when none), read backwards from
    /// the end of its partition of `NAME.attempts` ([`latest`]): a take reads the
    /// recent records, not the whole log (which compaction keeps short on a real cluster
    /// only once a segment rolls). Blocking.
    pub(crate) fn read(&self, partition: i32) -> Result<Record, BrokerError> {
        let at = self.partition_of(partition);
        let consumer: BaseConsumer = self
            .kafka
            .client_config()
            // Never joins or commits: the id only satisfies librdkafka.
            .set("group.id", format!("{}.attempts-reader", self.group))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .set("fetch.wait.max.ms", "100")
            .create()
            .map_err(|e| BrokerError::connect(BROKER, e))?;
        let (low, high) = consumer
            .fetch_watermarks(&self.topic, at, REQUEST_TIMEOUT)
            .map_err(|e| BrokerError::op(BROKER, "read attempts", e))?;
        let wanted = key(&self.group, partition);
        let deadline = Instant::now() + 3 * REQUEST_TIMEOUT;
        latest(low, high, |from, to| {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(&self.topic, at, Offset::Offset(from))
                .map_err(|e| BrokerError::op(BROKER, "read attempts", e))?;
            consumer
                .assign(&tpl)
                .map_err(|e| BrokerError::op(BROKER, "read attempts", e))?;
            let mut last = None;
            loop {
                match consumer.poll(Duration::from_millis(200)) {
                    Some(Ok(m)) => {
                        // Past `to` (a compacted log has gaps): read before, ignored.
                        if m.offset() < to && m.key() == Some(wanted.as_bytes()) {
                            last = Some(decode(m.payload().unwrap_or_default()));
                        }
                        if m.offset() + 1 >= to {
                            return Ok(last);
                        }
                    }
                    Some(Err(e)) => {
                        tracing::debug!(target: "idem::broker", broker = BROKER, error = %e, "reading attempts");
                    }
                    None => {}
                }
                if Instant::now() > deadline {
                    return Err(BrokerError::op(
                        BROKER,
                        "read attempts",
                        format!(
                            "{:?} partition {at} not read to offset {to} within {:?}",
                            self.topic,
                            3 * REQUEST_TIMEOUT
                        ),
                    ));
                }
            }
        })
    }

    /// Writes `record` as `partition`'s and waits for the broker's ack.
    pub(crate) async fn write(
        &self,
        producer: &FutureProducer,
        partition: i32,
        record: &Record,
    ) -> Result<(), BrokerError> {
        let key = key(&self.group, partition);
        let value = encode(record);
        let record: FutureRecord<'_, str, str> = FutureRecord::to(&self.topic)
            .partition(self.partition_of(partition))
            .key(key.as_str())
            .payload(value.as_str());
        producer
            .send(record, REQUEST_TIMEOUT)
            .await
            .map(drop)
            .map_err(|(e, _)| BrokerError::op(BROKER, "write attempts", e))
    }
}

/// The records read per range at first by [`latest`]; each further range is twice the
/// last.
const FIRST_RANGE: i64 = 64;

/// The last record of a key in a log whose offsets run from `low` to `high` (exclusive),
/// searched backwards: `read_range(from, to)` returns the last record of the key among
/// offsets `from..to` (`None` when it has none); the first range that has one holds the
/// latest. The ranges grow twofold from [`FIRST_RANGE`], so a key written recently costs
/// one short read and one never written costs about two reads of the log.
fn latest(
    low: i64,
    high: i64,
    mut read_range: impl FnMut(i64, i64) -> Result<Option<Record>, BrokerError>,
) -> Result<Record, BrokerError> {
    let (mut to, mut len) = (high, FIRST_RANGE);
    while to > low {
        let from = to.saturating_sub(len).max(low);
        if let Some(record) = read_range(from, to)? {
            return Ok(record);
        }
        (to, len) = (from, len.saturating_mul(2));
    }
    Ok(Record::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log of `len` records from offset `low`, the key's at `at`: what [`latest`]
    /// finds, and how many records it read.
    fn search(low: i64, len: i64, at: &[i64]) -> (Record, i64) {
        let mut read = 0;
        let found = latest(low, low + len, |from, to| {
            assert!(low <= from && from < to && to <= low + len, "{from}..{to}");
            read += to - from;
            Ok(at
                .iter()
                .filter(|o| (from..to).contains(o))
                .max()
                .map(|o| decode(format!("{o}:1").as_bytes())))
        })
        .expect("no read fails");
        (found, read)
    }

    #[test]
    fn the_latest_record_is_found_reading_the_recent_part_of_the_log() {
        let expect = |o: i64| decode(format!("{o}:1").as_bytes());
        // Written last among 100,000 records: one short read, not the whole log.
        let (found, read) = search(1_000, 100_000, &[1_000, 50_000, 100_990]);
        assert_eq!(found, expect(100_990));
        assert_eq!(read, FIRST_RANGE);
        // Written long ago: the ranges grow until they reach it; the latest of several.
        let (found, read) = search(0, 100_000, &[3, 7]);
        assert_eq!(found, expect(7));
        assert_eq!(read, 100_000);
        let (found, read) = search(0, 100_000, &[90_000, 10]);
        assert_eq!(found, expect(90_000));
        assert!(read < 20_000, "{read}");
        // Never written, or an empty log.
        assert_eq!(search(5, 100_000, &[]), (Record::default(), 100_000));
        assert_eq!(search(5, 0, &[]), (Record::default(), 0));
    }

    #[test]
    fn counts_read_back_as_written() {
        let counts: BTreeMap<i64, u32> = [(7, 3), (12, 2)].into();
        let record = Record {
            counts: counts.clone(),
            ahead: None,
        };
        assert_eq!(encode(&record), "7:3,12:2");
        assert_eq!(decode(b"7:3,12:2"), record);
        let ahead = Record {
            counts: counts.clone(),
            ahead: Some(140),
        };
        assert_eq!(encode(&ahead), "7:3,12:2,ahead:140");
        assert_eq!(decode(b"7:3,12:2,ahead:140"), ahead);
        assert_eq!(decode(b""), Record::default());
        // Malformed entries are skipped, the rest is kept.
        assert_eq!(
            decode(b"x,7:3,-1:2,5:0,9:y,ahead:-3,ahead:z").counts,
            BTreeMap::from([(7, 3)])
        );
        assert_eq!(decode(b"ahead:-3,ahead:z").ahead, None);
        assert_eq!(key("billing", 2), "billing/2");
        assert_eq!(attempts_name("grants"), "grants.attempts");
    }
}
