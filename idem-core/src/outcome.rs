//! What happened to one delivery ([`Outcome`]), and the reason codes a dead-lettered
//! delivery carries. An engine (`idem-engine`'s gate) produces outcomes; stores count them
//! ([`OutcomeCountStore`](crate::tally::OutcomeCountStore)) and reports read the codes.

use crate::error::{AckError, Error, RejectReason};
use crate::key::IdempotencyKey;

/// The coarse kind of an [`Outcome`], for counters and reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OutcomeKind {
    /// Committed and acked.
    Processed,
    /// Already committed before: rolled back and acked.
    Duplicate,
    /// Claimed elsewhere and not finished: nacked with a delay.
    Deferred,
    /// Bad input: dead-lettered with a reason.
    Rejected,
    /// Rolled back and nacked for redelivery.
    Failed,
    /// The same submission (identity) with another payload: rolled back and dead-lettered.
    Conflict,
}

impl OutcomeKind {
    /// A lowercase name (`processed`, `duplicate`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Duplicate => "duplicate",
            Self::Deferred => "deferred",
            Self::Rejected => "rejected",
            Self::Failed => "failed",
            Self::Conflict => "conflict",
        }
    }
}

/// What happened to one delivery. Each variant carries the result of settling it with the
/// broker: a commit that succeeded followed by a failed ack is `Processed` with an `Err`
/// settlement — the redelivery will be skipped as a duplicate.
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome {
    /// Committed, then acked.
    Processed {
        /// The submission's key.
        key: IdempotencyKey,
        /// The ack's result.
        settle: Result<(), AckError>,
    },
    /// The key was already committed: rolled back, touched nothing, acked.
    Duplicate {
        /// The submission's key.
        key: IdempotencyKey,
        /// The ack's result.
        settle: Result<(), AckError>,
    },
    /// Claimed elsewhere and still live: nacked with the defer delay.
    Deferred {
        /// The submission's key.
        key: IdempotencyKey,
        /// The nack's result.
        settle: Result<(), AckError>,
    },
    /// Bad input: dead-lettered with the reason.
    Rejected {
        /// Why.
        reason: RejectReason,
        /// The dead-letter's result (on `Err` the delivery stays in the source).
        settle: Result<(), AckError>,
    },
    /// Rolled back and nacked for redelivery.
    Failed {
        /// The key, when it could be derived.
        key: Option<IdempotencyKey>,
        /// What failed.
        error: Error,
        /// The nack's result.
        settle: Result<(), AckError>,
    },
    /// The submission's identity (subject + submission timestamp) was already claimed
    /// under another key — the same submission sent again with a different payload — and
    /// the pipeline's conflict policy is to dead-letter (the engine's `ConflictPolicy::DeadLetter`): rolled back and
    /// dead-lettered with a reason ([`CONFLICT`]) naming both keys.
    Conflict {
        /// This delivery's key.
        key: IdempotencyKey,
        /// The key that claimed the identity first.
        existing: IdempotencyKey,
        /// The reason it was dead-lettered with.
        reason: RejectReason,
        /// The dead-letter's result (on `Err` the delivery stays in the source).
        settle: Result<(), AckError>,
    },
}

impl Outcome {
    /// The coarse kind.
    pub fn kind(&self) -> OutcomeKind {
        match self {
            Self::Processed { .. } => OutcomeKind::Processed,
            Self::Duplicate { .. } => OutcomeKind::Duplicate,
            Self::Deferred { .. } => OutcomeKind::Deferred,
            Self::Rejected { .. } => OutcomeKind::Rejected,
            Self::Failed { .. } => OutcomeKind::Failed,
            Self::Conflict { .. } => OutcomeKind::Conflict,
        }
    }

    /// The key, when one was derived.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        match self {
            Self::Processed { key, .. }
            | Self::Duplicate { key, .. }
            | Self::Deferred { key, .. }
            | Self::Conflict { key, .. } => Some(key),
            Self::Failed { key, .. } => key.as_ref(),
            Self::Rejected { .. } => None,
        }
    }

    /// The settlement error, if settling with the broker failed.
    pub fn settle_error(&self) -> Option<&AckError> {
        match self {
            Self::Processed { settle, .. }
            | Self::Duplicate { settle, .. }
            | Self::Deferred { settle, .. }
            | Self::Rejected { settle, .. }
            | Self::Failed { settle, .. }
            | Self::Conflict { settle, .. } => settle.as_ref().err(),
        }
    }
}

/// The reason code of a delivery dead-lettered because its attempts ran out.
pub const ATTEMPTS_EXHAUSTED: &str = "attempts_exhausted";
/// The reason code of a delivery dead-lettered because the store refused it for good.
pub const STORE_REJECTED: &str = "store_rejected";
/// The reason code of a delivery dead-lettered because of another permanent failure.
pub const PERMANENT_FAILURE: &str = "permanent_failure";
/// The reason code of a delivery dead-lettered because its identity was already claimed
/// under another key ([`Outcome::Conflict`]).
pub const CONFLICT: &str = "conflict";
