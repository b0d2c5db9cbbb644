//! Log positions kept in the claim's transaction (`idem_positions`, one row per
//! partition): the position store's conformance scenarios (`idem_testkit::positions`).

mod common;

use idem_core::mutant::{self, Mutant};
use idem_testkit::positions as scenario;

#[tokio::test]
async fn a_take_raises_the_epoch_and_returns_what_is_stored() {
    scenario::a_take_raises_the_epoch_and_returns_what_is_stored(&common::fresh().await.store)
        .await;
}

#[tokio::test]
async fn transactions_finishing_out_of_order_move_the_position_over_every_offset_done() {
    scenario::transactions_finishing_out_of_order_move_the_position(&common::fresh().await.store)
        .await;
}

#[tokio::test]
async fn batches_agree_with_the_reference_advance() {
    scenario::batches_agree_with_the_reference(&common::fresh().await.store).await;
}

#[tokio::test]
async fn single_deliveries_agree_with_the_reference_advance() {
    scenario::single_deliveries_agree_with_the_reference(&common::fresh().await.store).await;
}

#[tokio::test]
async fn a_member_whose_partition_was_taken_cannot_commit_for_it() {
    let db = common::fresh().await;
    assert!(
        !scenario::stale_member_commits(&db.store).await,
        "the stale member's commit landed"
    );
}

/// With the epoch check off (mutant `UnfencedPositions`) the stale commit lands, which
/// the test above refuses.
#[tokio::test]
async fn without_fencing_the_stale_member_commits() {
    let db = common::fresh().await;
    mutant::set(Some(Mutant::UnfencedPositions));
    let landed = scenario::stale_member_commits(&db.store).await;
    mutant::set(None);
    assert!(landed, "the mutant should let the stale commit land");
}

#[tokio::test]
async fn a_transaction_of_two_ownerships_is_fenced() {
    scenario::a_transaction_of_two_ownerships_is_fenced(&common::fresh().await.store).await;
}
