//! Log positions kept in the claim's transaction, and the fence that keeps a member that
//! lost a partition from committing for it.
//!
//! A log broker (Kafka) delivers a partition in offset order and remembers a consumer
//! group's place in it by a committed offset, which idem commits only after the
//! database commit. After a crash or a rebalance the partition's next owner starts at that
//! offset and reads again everything committed in the database since: harmless (each
//! is a duplicate), but read and claimed again, and a topic kept for ever pins the purge
//! floor for ever. With **positions stored**, every claim transaction also records where
//! its deliveries stand in their partitions, so a new owner starts exactly after what
//! the database holds:
//!
//! - **The stored position** (per source and partition): `next`, the first offset not
//!   known to be done (every offset below it committed, or settled by the member that
//!   held it); `done`, the offsets at or past `next` whose transactions committed (they
//!   finish out of order when several batches are in flight); and `epoch`, the fencing
//!   token. A store may keep it in several rows per partition, so that transactions in
//!   flight at once do not wait for each other's commit, and [`merge`] them when read
//!   (the Postgres store keeps 16).
//! - **Taking a partition** ([`PositionStore::take_position`]): the member that is
//!   assigned a partition raises its epoch by one, in a statement of its own, before it
//!   hands out the partition's first delivery, and starts at `next`, skipping the offsets
//!   in `done`. Raising the epoch waits for a transaction of the previous owner that has
//!   already written the row, so the row it reads includes that transaction.
//! - **Advancing** ([`ClaimTx::advance_positions`](crate::ClaimTx::advance_positions)):
//!   in the claim's transaction, just before its commit, each partition's row takes the
//!   transaction's offsets and the member's settled prefix ([`PositionMove::settled_below`])
//!   and moves `next` over every offset now known done ([`advance`]): monotonic, so a
//!   late transaction never moves it back. The statement matches the row only at the
//!   member's epoch: a member whose partition was taken since (a later epoch) writes
//!   nothing, and the transaction fails with [`StoreError::Fenced`] and rolls back. Its
//!   deliveries are left unsettled: the partition's new owner has them.
//!
//! What an adapter reports is [`Acker::position`](crate::Acker::position); the gate
//! hands the positions of a transaction's deliveries to the store.

use std::sync::Arc;

use async_trait::async_trait;

use crate::error::StoreError;

/// Where one delivery stands in its partition, as its claim transaction records it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PositionMove {
    /// The source: broker, group and topic (e.g. `kafka/idem/grants`).
    pub source: Arc<str>,
    /// The partition.
    pub partition: i32,
    /// The delivery's offset.
    pub offset: i64,
    /// Every offset below this one was settled by the member (committed, skipped as a
    /// duplicate, dead-lettered) when the delivery was claimed: the row's `next` may move
    /// up to it.
    pub settled_below: i64,
    /// The epoch the member took the partition at ([`PositionStore::take_position`]).
    pub epoch: i64,
}

/// A partition as a member takes it ([`PositionStore::take_position`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TakenPosition {
    /// The member's epoch: its transactions for this partition commit only while the row
    /// is still at it.
    pub epoch: i64,
    /// The first offset not known to be done; `None` when no transaction has recorded
    /// one (start where the broker says).
    pub next: Option<i64>,
    /// Offsets at or past `next` whose transactions committed, ascending.
    pub done: Vec<i64>,
}

/// A partition's stored position, for `idem inspect` and `idem purge`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredPosition {
    /// The source ([`PositionMove::source`]).
    pub source: String,
    /// The partition.
    pub partition: i32,
    /// The first offset not known to be done (`None`: taken, nothing recorded yet).
    pub next: Option<i64>,
    /// Offsets at or past `next` that are done.
    pub done: Vec<i64>,
    /// The epoch: how many times the partition was taken.
    pub epoch: i64,
}

/// A store that keeps log positions beside its claims.
///
/// # Contract
/// - [`take_position`](PositionStore::take_position) raises the partition's epoch by one
///   (creating the row at epoch 1 with no position) and returns the new epoch with the
///   stored position. It is committed when it returns. It waits for any open transaction
///   that has advanced the row, so it returns what that transaction committed; from then
///   on, a transaction advancing the partition at an older epoch fails with
///   [`StoreError::Fenced`].
/// - [`ClaimTx::advance_positions`](crate::ClaimTx::advance_positions) in a transaction
///   of this store applies [`advance`] to each partition's row, in the transaction, and
///   only at the move's epoch; at any other epoch it changes nothing and returns
///   [`StoreError::Fenced`] naming the partitions.
/// - [`positions`](PositionStore::positions) lists a source's rows.
#[async_trait]
pub trait PositionStore: Send + Sync + std::fmt::Debug {
    /// Takes `partition` of `source` for a new owner: see the trait's contract.
    async fn take_position(
        &self,
        source: &str,
        partition: i32,
    ) -> Result<TakenPosition, StoreError>;

    /// Every stored partition of `source`, by partition.
    async fn positions(&self, source: &str) -> Result<Vec<StoredPosition>, StoreError>;
}

/// How many done offsets past the position a store keeps in one row's array (the
/// Postgres store's slot, the SQLite store's partition row). While one offset stays
/// undone (a message deferred, a batch still running), every offset done after it must be
/// kept; those the array has no room for are rows of their own (`idem_position_offsets`),
/// so that what each transaction rewrites stays this size, however long the offset stays
/// undone.
pub const HELD: usize = 64;

/// The stored position after a transaction: `next` and `done` as stored, the member's
/// settled prefix and the transaction's offsets. Every offset below the result's `next`
/// is done; its `done` holds the offsets past it that are, ascending. `next` never moves
/// back.
///
/// ```
/// use idem_core::position::advance;
/// // Offsets 10 and 12 committed, 11 still in flight elsewhere: next stays at 11.
/// assert_eq!(advance(Some(10), &[], 10, &[10, 12]), (11, vec![12]));
/// // 11 commits: next passes 12 too.
/// assert_eq!(advance(Some(11), &[12], 10, &[11]), (13, vec![]));
/// // The member settled everything below 20 (a duplicate, a dead letter): next follows.
/// assert_eq!(advance(Some(13), &[], 20, &[21]), (20, vec![21]));
/// ```
pub fn advance(
    next: Option<i64>,
    done: &[i64],
    settled_below: i64,
    offsets: &[i64],
) -> (i64, Vec<i64>) {
    let mut next = next.map_or(settled_below, |n| n.max(settled_below));
    let mut set: Vec<i64> = done
        .iter()
        .chain(offsets)
        .copied()
        .filter(|&o| o >= next)
        .collect();
    set.sort_unstable();
    set.dedup();
    let mut rest = set.into_iter().peekable();
    while rest.peek() == Some(&next) {
        rest.next();
        next += 1;
    }
    (next, rest.collect())
}

/// The position of a partition kept in several rows ("slots", so that transactions of
/// one partition in flight at once write different rows): each slot's highest settled
/// prefix and the offsets it holds done. The result is what one row holding them all
/// would say: `next` from the highest settled prefix past every offset some slot holds
/// done, and the done offsets past it; `None` when no slot recorded anything.
///
/// ```
/// use idem_core::position::merge;
/// // Slot 0 saw offsets 10 and 12 committed with everything below 10 settled; slot 1
/// // saw 11. Together: next is 13.
/// assert_eq!(merge([(Some(10), &[10, 12][..]), (Some(10), &[11][..])]), Some((13, vec![])));
/// assert_eq!(merge([(None, &[][..]), (None, &[][..])]), None);
/// ```
pub fn merge<'a>(
    slots: impl IntoIterator<Item = (Option<i64>, &'a [i64])>,
) -> Option<(i64, Vec<i64>)> {
    let mut floor: Option<i64> = None;
    let mut done: Vec<i64> = Vec::new();
    for (settled, d) in slots {
        floor = floor.max(settled);
        done.extend_from_slice(d);
    }
    let floor = floor?;
    Some(advance(Some(floor), &done, floor, &[]))
}

#[cfg(test)]
mod tests {
    use super::{advance, merge};

    #[test]
    fn merging_slots_is_advancing_one_row() {
        let one = advance(Some(5), &[], 5, &[5, 6, 9, 11]);
        let slots = merge([
            (Some(5), &[5, 9][..]),
            (Some(3), &[6, 11][..]),
            (None, &[][..]),
        ]);
        assert_eq!(slots, Some(one));
    }

    #[test]
    fn next_never_moves_back() {
        assert_eq!(advance(Some(50), &[], 10, &[3, 4]), (50, vec![]));
        assert_eq!(advance(Some(50), &[51], 10, &[50]), (52, vec![]));
    }

    #[test]
    fn a_first_transaction_starts_from_the_members_prefix() {
        assert_eq!(advance(None, &[], 7, &[7, 8, 10]), (9, vec![10]));
        assert_eq!(advance(None, &[], 0, &[5]), (0, vec![5]));
    }

    #[test]
    fn repeated_offsets_count_once() {
        assert_eq!(advance(Some(0), &[2, 2], 0, &[2, 3, 3]), (0, vec![2, 3]));
    }
}
