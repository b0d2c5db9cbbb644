//! The per-partition low-water mark: which offset may be committed when messages finish
//! out of order.

use std::collections::BTreeSet;

/// Tracks one partition's deliveries so that the committed offset never passes a message
/// still in flight.
///
/// Kafka commits a position: committing offset `N` says every message before `N` is
/// done. With several messages in flight they finish in any order, so the offset to
/// commit is the smallest offset still in flight, or one past the highest registered
/// offset once everything settled. Offsets are registered in increasing order (as the
/// partition delivers them); gaps (compacted or transaction-marker offsets) are fine.
///
/// ```
/// use idem_broker::kafka::LowWaterMark;
/// let mut lwm = LowWaterMark::new();
/// for o in [10, 11, 12] {
///     assert!(lwm.register(o));
/// }
/// lwm.settle(12);
/// lwm.settle(11);
/// assert_eq!(lwm.take_commit(), Some(10)); // 10 is still in flight
/// lwm.settle(10);
/// assert_eq!(lwm.take_commit(), Some(13)); // all done: the next offset to read
/// assert_eq!(lwm.take_commit(), None); // nothing new to commit
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LowWaterMark {
    in_flight: BTreeSet<i64>,
    next: Option<i64>,
    committed: Option<i64>,
}

impl LowWaterMark {
    /// An empty tracker: nothing registered, nothing to commit.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `offset` as delivered and in flight. Returns `false` (and changes
    /// nothing) when `offset` is not above every offset registered before.
    pub fn register(&mut self, offset: i64) -> bool {
        if offset < 0 || self.next.is_some_and(|n| offset < n) {
            return false;
        }
        self.in_flight.insert(offset);
        self.next = Some(offset.saturating_add(1));
        true
    }

    /// Marks `offset` settled. Returns whether it was in flight.
    pub fn settle(&mut self, offset: i64) -> bool {
        self.in_flight.remove(&offset)
    }

    /// The offset it is safe to commit now: the smallest in flight, or one past the
    /// highest registered when none is; `None` before the first registration.
    pub fn mark(&self) -> Option<i64> {
        self.in_flight.first().copied().or(self.next)
    }

    /// The mark, if it moved past what was last taken; it is then remembered as
    /// committed.
    pub fn take_commit(&mut self) -> Option<i64> {
        let m = self.mark()?;
        if self.committed.is_some_and(|c| c >= m) {
            return None;
        }
        self.committed = Some(m);
        Some(m)
    }

    /// Forgets the last taken commit (it failed), so the next
    /// [`take_commit`](Self::take_commit) returns the mark again.
    pub fn forget_commit(&mut self) {
        self.committed = None;
    }

    /// The last offset taken for a commit.
    pub fn committed(&self) -> Option<i64> {
        self.committed
    }

    /// How many registered offsets are not settled.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The registered offsets not settled, ascending.
    pub fn in_flight_offsets(&self) -> impl Iterator<Item = i64> + '_ {
        self.in_flight.iter().copied()
    }

    /// The highest offset registered; `None` before the first registration.
    pub fn highest(&self) -> Option<i64> {
        self.next.map(|n| n - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_offsets_going_back() {
        let mut l = LowWaterMark::new();
        assert_eq!(l.mark(), None);
        assert!(l.register(5));
        assert!(!l.register(5));
        assert!(!l.register(3));
        assert!(!l.register(-1));
        assert!(l.register(9));
        assert!(!l.settle(7));
        assert!(l.settle(9));
        assert_eq!(l.mark(), Some(5));
        assert!(l.settle(5));
        assert_eq!(l.take_commit(), Some(10));
        l.forget_commit();
        assert_eq!(l.take_commit(), Some(10));
        assert_eq!(l.in_flight(), 0);
        assert_eq!(l.highest(), Some(9));
        assert!(l.register(12));
        assert_eq!(l.in_flight_offsets().collect::<Vec<_>>(), vec![12]);
    }
}
