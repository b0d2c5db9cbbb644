//! The front filter's contract: a fast cache of *committed* keys ([`DoneFilter`]) that an
//! engine asks before the durable claim (`idem-engine`'s `Filtered` wrapper). It may only
//! ever answer "done" for a key whose durable commit happened; a miss or an error falls
//! through to the durable store.

use async_trait::async_trait;

use crate::error::StoreError;
use crate::key::IdempotencyKey;

/// A cache of keys whose durable commit has happened.
///
/// # Contract
/// - [`seen`](DoneFilter::seen) answers `true` only for keys passed to
///   [`mark_done`](DoneFilter::mark_done) (which the wrapper calls after the durable
///   commit). A false negative is fine (the durable store decides); a false positive
///   loses a message and must never happen.
/// - Errors are never fatal: the wrapper treats an `Err` as "not seen" and falls through.
#[async_trait]
pub trait DoneFilter: Send + Sync {
    /// For each key, whether its commit is known. One round trip for the whole slice.
    async fn seen(&self, keys: &[IdempotencyKey]) -> Result<Vec<bool>, StoreError>;

    /// Records committed keys (after the durable commit).
    async fn mark_done(&self, keys: &[IdempotencyKey]) -> Result<(), StoreError>;
}
