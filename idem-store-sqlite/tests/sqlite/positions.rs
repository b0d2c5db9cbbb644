//! Log positions kept in the claim's transaction (`idem_positions`, one row per
//! partition): the position store's conformance scenarios (`idem_testkit::positions`).

use crate::common;

use idem_engine::mutant::{self, Mutant};
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

/// An offset that stays undone while 1,600 past it are done: the position keeps them
/// all, yet the partition's row holds at most 64 (the rest are rows of
/// `idem_position_offsets`), so what each transaction rewrites does not grow with the
/// time the offset stays undone; once it is done the rows go. Before, the row's JSON
/// array took every offset and each transaction parsed, sorted and wrote it whole.
#[tokio::test]
async fn an_offset_that_stays_undone_does_not_grow_what_each_transaction_writes() {
    let db = common::fresh().await;
    let epoch = scenario::while_an_offset_stays_undone(&db.store).await;
    let (largest, rows) = held(&db.store).await;
    assert!(
        largest <= i64::try_from(idem_engine::position::HELD).unwrap(),
        "the row holds {largest} offsets"
    );
    assert!(rows > 1_000, "{rows} offset rows");
    scenario::once_it_is_done(&db.store, epoch).await;
    assert_eq!(
        held(&db.store).await.1,
        0,
        "offset rows left below the position"
    );
}

/// The length of partition [`scenario::STUCK`]'s array, and its offset rows.
async fn held(store: &idem_store_sqlite::SqliteStore) -> (i64, i64) {
    let largest: i64 = sqlx::query_scalar(
        "SELECT json_array_length(done) FROM idem_positions WHERE partition = ?",
    )
    .bind(scenario::STUCK)
    .fetch_one(store.pool())
    .await
    .expect("array");
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_position_offsets WHERE partition = ?")
            .bind(scenario::STUCK)
            .fetch_one(store.pool())
            .await
            .expect("rows");
    (largest, rows)
}
