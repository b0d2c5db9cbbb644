//! Deliberately broken variants of the protocol, compiled only with the internal
//! `_mutants` feature, so the explorer in `idem-testkit` can show that it catches each
//! of them. Without the feature [`active`] is a constant `false` and costs nothing.

/// A broken variant of the gate or the filter wrapper.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Mutant {
    /// Acks a processed delivery before its commit.
    AckBeforeCommit,
    /// Writes the front filter's mark at claim time, before the durable commit.
    FilterMarkBeforeCommit,
    /// Claims a batch's keys in arrival order instead of sorted order (two batches holding
    /// each other's keys deadlock).
    UnsortedBatchClaims,
    /// Nacks a permanent failure for redelivery instead of dead-lettering it (a loop).
    PermanentErrorNacked,
    /// Acks a duplicate before its transaction's rollback finished.
    DuplicateAckBeforeRollback,
    /// Claims a batch in key order alone, ignoring identities (two batches holding
    /// different payloads of the same two submissions can each lock one identity and wait
    /// for the other's).
    KeyOrderBatchClaims,
    /// Runs the handler of a delivery past the attempt limit whose earlier runs never
    /// settled (a message that kills its process is run for ever).
    NoAttemptCheckBeforeHandler,
    /// Nacks a delivery that failed on a store outage instead of deferring it (each
    /// outage costs the message a broker delivery; its count then ends it unrun).
    OutageNacked,
    /// Advances a log position whatever the row's epoch: a member that lost its
    /// partition still commits for it (no fencing).
    UnfencedPositions,
    /// Charges every failure on the store's side to the message, without the store's
    /// evidence (a degraded store, a store down for everyone): good messages are
    /// dead-lettered for the store's fault.
    StoreFaultCharged,
    /// Lets a later payload of a submission claim it while the earlier one's failed
    /// attempt waits for its redelivery: the later payload takes effect.
    LaterPayloadNotHeld,
}

#[cfg(feature = "_mutants")]
mod imp {
    use super::Mutant;
    use std::sync::atomic::{AtomicU8, Ordering};

    static ACTIVE: AtomicU8 = AtomicU8::new(0);

    fn code(m: Mutant) -> u8 {
        match m {
            Mutant::AckBeforeCommit => 1,
            Mutant::FilterMarkBeforeCommit => 2,
            Mutant::UnsortedBatchClaims => 3,
            Mutant::PermanentErrorNacked => 4,
            Mutant::DuplicateAckBeforeRollback => 5,
            Mutant::KeyOrderBatchClaims => 6,
            Mutant::NoAttemptCheckBeforeHandler => 7,
            Mutant::OutageNacked => 8,
            Mutant::UnfencedPositions => 9,
            Mutant::StoreFaultCharged => 10,
            Mutant::LaterPayloadNotHeld => 11,
        }
    }

    /// Makes `m` the active mutant (`None`: the real protocol) for the whole process.
    pub fn set(m: Option<Mutant>) {
        ACTIVE.store(m.map_or(0, code), Ordering::SeqCst);
    }

    /// Whether `m` is the active mutant.
    pub fn active(m: Mutant) -> bool {
        ACTIVE.load(Ordering::Relaxed) == code(m)
    }
}

#[cfg(feature = "_mutants")]
pub use imp::{active, set};

/// Whether `m` is the active mutant: always `false` without the `_mutants` feature.
#[cfg(not(feature = "_mutants"))]
#[inline(always)]
pub const fn active(m: Mutant) -> bool {
    let _ = m;
    false
}

/// Without the `_mutants` feature there is nothing to switch on: a no-op, so a caller
/// built without the feature still compiles (and finds no mutant active).
#[cfg(not(feature = "_mutants"))]
pub fn set(m: Option<Mutant>) {
    let _ = m;
}
