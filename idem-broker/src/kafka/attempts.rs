//! Delivery counts that outlive the member: the topic `NAME.attempts`.
//!
//! Kafka keeps no delivery count, so a member counts the deliveries of each offset
//! itself; a message that kills the process would come back to the next member as a
//! first delivery, for ever. The counts a successor needs are therefore written to the
//! broker before the deliveries they count are handed out: one record per (group,
//! partition), key `GROUP/PARTITION`, value `OFFSET:COUNT,…`, in the partition of
//! `NAME.attempts` numbered like the source's (modulo its partition count). The last
//! record of a key is the one that counts; the topic is created compacted
//! (`cleanup.policy=compact`), so Kafka keeps one per key.
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

/// `OFFSET:COUNT,…`, offsets in order.
pub(crate) fn encode(counts: &BTreeMap<i64, u32>) -> String {
    counts
        .iter()
        .map(|(o, n)| format!("{o}:{n}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The counts of a record; a malformed entry is skipped (a count is advice, never a
/// reason to stop consuming).
pub(crate) fn decode(value: &[u8]) -> BTreeMap<i64, u32> {
    String::from_utf8_lossy(value)
        .split(',')
        .filter_map(|e| {
            let (o, n) = e.trim().split_once(':')?;
            Some((o.parse().ok()?, n.parse().ok()?))
        })
        .filter(|(o, n)| *o >= 0 && *n > 0)
        .collect()
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

    /// The last counts written for `partition` (empty when none), read from the start of
    /// its partition of `NAME.attempts` to its end. Blocking.
    pub(crate) fn read(&self, partition: i32) -> Result<BTreeMap<i64, u32>, BrokerError> {
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
        if high <= low {
            return Ok(BTreeMap::new());
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, at, Offset::Offset(low))
            .map_err(|e| BrokerError::op(BROKER, "read attempts", e))?;
        consumer
            .assign(&tpl)
            .map_err(|e| BrokerError::op(BROKER, "read attempts", e))?;
        let wanted = key(&self.group, partition);
        let deadline = Instant::now() + 3 * REQUEST_TIMEOUT;
        let mut last = BTreeMap::new();
        loop {
            match consumer.poll(Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    if m.key() == Some(wanted.as_bytes()) {
                        last = decode(m.payload().unwrap_or_default());
                    }
                    if m.offset() + 1 >= high {
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
                        "{:?} partition {at} not read to offset {high} within {:?}",
                        self.topic,
                        3 * REQUEST_TIMEOUT
                    ),
                ));
            }
        }
    }

    /// Writes `counts` as `partition`'s record and waits for the broker's ack.
    pub(crate) async fn write(
        &self,
        producer: &FutureProducer,
        partition: i32,
        counts: &BTreeMap<i64, u32>,
    ) -> Result<(), BrokerError> {
        let key = key(&self.group, partition);
        let value = encode(counts);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_back_as_written() {
        let counts: BTreeMap<i64, u32> = [(7, 3), (12, 2)].into();
        assert_eq!(encode(&counts), "7:3,12:2");
        assert_eq!(decode(b"7:3,12:2"), counts);
        assert_eq!(decode(b""), BTreeMap::new());
        // Malformed entries are skipped, the rest is kept.
        assert_eq!(decode(b"x,7:3,-1:2,5:0,9:y"), [(7, 3)].into());
        assert_eq!(key("billing", 2), "billing/2");
        assert_eq!(attempts_name("grants"), "grants.attempts");
    }
}
