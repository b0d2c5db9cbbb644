//! The conformance suite every store runs: plain async functions, one call list.
//!
//! A store's `tests/conformance.rs` (or a `conformance` module of its test binary) is one
//! line — here the in-memory store's; an expression that makes a fresh, isolated store
//! (it may `.await`) goes in the call:
//!
//! ```
//! idem_testkit::conformance_tests!(idem_testkit::MemoryStore::new());
//! # fn main() {}
//! ```
//!
//! which expands to one `#[tokio::test]` per check. Each check panics with a message
//! naming the broken rule. Checks that need business writes in the claim's transaction
//! skip themselves on stores whose [`Capabilities::transactional_writes`] is false (a
//! lease store), and say so.
//!
//! [`Capabilities::transactional_writes`]: idem_engine::Capabilities

use idem_engine::{ClaimMeta, IdempotencyKey};

use crate::harness::TestStore;

mod claims;
mod conflicts;
mod outbox;
mod reruns;

pub use claims::{
    batch_claim_matches_single_claims, concurrent_claim_after_rollback_wins,
    concurrent_claims_one_winner, dropped_tx_releases_claim, failed_outbox_insert_leaves_nothing,
    gate_batch_is_exactly_once, key_is_deterministic, replay_is_duplicate_and_effect_stays_one,
    rolled_back_claim_can_be_reclaimed, same_key_twice_in_one_tx, second_claim_is_duplicate,
};
pub use conflicts::{
    batch_claim_detects_conflicts, concurrent_conflicting_claims_serialize,
    conflicting_payload_is_a_conflict, first_delivered_wins_across_batches, gate_conflict_policies,
};
pub use outbox::{outbox_backlog_tracks_the_relay, outbox_carries_the_traceparent};
pub use reruns::{
    a_failure_is_counted_by_its_runs_not_its_deliveries,
    a_rerun_of_a_committed_message_is_a_duplicate_at_once, reruns_are_recorded,
};

fn key(n: &str) -> IdempotencyKey {
    IdempotencyKey::derive(n, "2026-07-01T09:00:00Z", n.as_bytes()).expect("valid identity")
}

/// The claims carry the timestamp their keys are derived from, so a partitioned store
/// files them under a real month (July 2026), not its catch-all partition.
fn meta(n: &str) -> ClaimMeta {
    ClaimMeta::new(n).with_submission_timestamp("2026-07-01T09:00:00Z")
}

/// Runs every check in order against stores from `make` (for a quick single-test run).
pub async fn run_all<S, F, Fut>(make: F)
where
    S: TestStore,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = S>,
{
    key_is_deterministic(make().await).await;
    second_claim_is_duplicate(make().await).await;
    same_key_twice_in_one_tx(make().await).await;
    replay_is_duplicate_and_effect_stays_one(make().await).await;
    failed_outbox_insert_leaves_nothing(make().await).await;
    concurrent_claims_one_winner(make().await).await;
    concurrent_claim_after_rollback_wins(make().await).await;
    rolled_back_claim_can_be_reclaimed(make().await).await;
    dropped_tx_releases_claim(make().await).await;
    batch_claim_matches_single_claims(make().await).await;
    gate_batch_is_exactly_once(make().await).await;
    conflicting_payload_is_a_conflict(make().await).await;
    concurrent_conflicting_claims_serialize(make().await).await;
    batch_claim_detects_conflicts(make().await).await;
    gate_conflict_policies(make().await).await;
    first_delivered_wins_across_batches(make().await).await;
    reruns_are_recorded(make().await).await;
    a_rerun_of_a_committed_message_is_a_duplicate_at_once(make().await).await;
    a_failure_is_counted_by_its_runs_not_its_deliveries(make().await).await;
}

/// Expands to one `#[tokio::test]` per conformance check. `$make` is an expression
/// (it may `.await`) giving a fresh, isolated store; it is evaluated once per test.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@each $make;
            key_is_deterministic,
            second_claim_is_duplicate,
            same_key_twice_in_one_tx,
            replay_is_duplicate_and_effect_stays_one,
            failed_outbox_insert_leaves_nothing,
            concurrent_claims_one_winner,
            concurrent_claim_after_rollback_wins,
            rolled_back_claim_can_be_reclaimed,
            dropped_tx_releases_claim,
            batch_claim_matches_single_claims,
            gate_batch_is_exactly_once,
            conflicting_payload_is_a_conflict,
            concurrent_conflicting_claims_serialize,
            batch_claim_detects_conflicts,
            gate_conflict_policies,
            first_delivered_wins_across_batches,
            reruns_are_recorded,
            a_rerun_of_a_committed_message_is_a_duplicate_at_once,
            a_failure_is_counted_by_its_runs_not_its_deliveries
        );
    };
    (@each $make:expr; $($name:ident),+) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let store = $make;
                $crate::conformance::$name(store).await;
            }
        )+
    };
}
