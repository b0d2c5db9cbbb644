//! The outcome counts' contract: the store side of an outcome tally ([`OutcomeCountStore`],
//! the `idem_outcome_counts` table) and the id of one flush ([`FlushId`]). The tally itself,
//! which counts a gate's outcomes in memory and flushes them, is `idem-engine`'s
//! `OutcomeTally`; its documentation says what the counts are and what they are not.

use async_trait::async_trait;

use crate::error::StoreError;
use crate::record::OutcomeCount;

/// The id of one flush of one `OutcomeTally` (in `idem-engine`): the tally's random `writer` id and the
/// flush's sequence number, 1 for its first flush and one more for each next one. A
/// flush tried again (its result unknown) keeps its id and its counts.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FlushId {
    writer: String,
    seq: u64,
}

impl FlushId {
    /// The flush `seq` of the tally `writer`.
    pub fn new(writer: impl Into<String>, seq: u64) -> Self {
        Self {
            writer: writer.into(),
            seq,
        }
    }

    /// The tally's id: 32 hexadecimal digits, random per tally.
    pub fn writer(&self) -> &str {
        &self.writer
    }

    /// The flush's sequence number within its tally (from 1).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The sequence number as a store writes it (a signed 64-bit integer).
    ///
    /// # Errors
    /// [`StoreError::Config`] for a number above `i64::MAX`.
    pub fn stored_seq(&self) -> Result<i64, StoreError> {
        i64::try_from(self.seq).map_err(|_| {
            StoreError::Config(format!(
                "a flush sequence number of {} is too large",
                self.seq
            ))
        })
    }
}

/// A store that keeps an outcome tally (`idem_outcome_counts`): `idem-store-postgres` and
/// `idem-store-sqlite` implement it.
///
/// The contract: each flush is added **at most once**. The store keeps, per writer, the
/// highest flush sequence number applied, and a flush adds its counts only when its
/// number is above it, recording it in the same transaction as the counts. A writer sends
/// its flushes in increasing order and tries each again, with the same id and counts,
/// until it succeeds before it sends the next (`OutcomeTally::flush` does), so a flush
/// applied once and sent again — its first try's outcome unknown — adds nothing.
#[async_trait]
pub trait OutcomeCountStore: Send + Sync {
    /// Adds `counts` to the table, in one transaction with the record of `flush`: a row
    /// that exists has its count increased, one that does not is created. Counts of one
    /// `(day, outcome, reason)` given twice in `counts` add up. Concurrent calls (two
    /// consumers, other writers) add up too. A flush whose writer already has a flush of
    /// this sequence number or a later one applied adds nothing and succeeds. The call is
    /// bounded by a statement timeout of the store's own, so that a flush never holds a
    /// connection for long.
    ///
    /// # Errors
    /// A [`StoreError`] from the database; then nothing was added (or, if the outcome of
    /// the commit is unknown, possibly everything: try again with the same `flush`).
    async fn add_outcome_counts(
        &self,
        flush: &FlushId,
        counts: &[OutcomeCount],
    ) -> Result<(), StoreError>;
}
