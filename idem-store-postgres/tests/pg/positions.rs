//! Log positions kept in the claim's transaction (`idem_positions`): the position
//! store's conformance scenarios (`idem_testkit::positions`), and what is particular to
//! Postgres: a take waits for a transaction that is recording a position, and
//! transactions of one partition in flight at once do not wait for each other (they
//! write different slot rows).

use crate::common;

use std::time::Duration;

use idem_engine::mutant::{self, Mutant};
use idem_engine::{ClaimMeta, ClaimStore, ClaimTx, IdempotencyKey, PositionStore, StoreError};
use idem_testkit::positions::{self as scenario, at, commit_claims, stored, SOURCE};

fn key(n: i64) -> IdempotencyKey {
    IdempotencyKey::derive(&format!("P-{n}"), "2026-07-01T09:00:00Z", b"{}").expect("key")
}

#[tokio::test]
async fn a_take_raises_the_epoch_and_returns_what_is_stored() {
    scenario::a_take_raises_the_epoch_and_returns_what_is_stored(&common::fresh_pg().await).await;
}

#[tokio::test]
async fn transactions_finishing_out_of_order_move_the_position_over_every_offset_done() {
    scenario::transactions_finishing_out_of_order_move_the_position(&common::fresh_pg().await)
        .await;
}

#[tokio::test]
async fn the_statement_agrees_with_the_reference_advance() {
    scenario::batches_agree_with_the_reference(&common::fresh_pg().await).await;
}

/// Past many prunes of every slot (a slot appends an offset and prunes once it holds
/// 64).
#[tokio::test]
async fn single_deliveries_agree_with_the_reference_past_the_prunes() {
    scenario::single_deliveries_agree_with_the_reference(&common::fresh_pg().await).await;
}

#[tokio::test]
async fn a_member_whose_partition_was_taken_cannot_commit_for_it() {
    let pg = common::fresh_pg().await;
    assert!(
        !scenario::stale_member_commits(&pg).await,
        "the stale member's commit landed"
    );
}

/// The same scenario with the epoch check switched off (mutant `UnfencedPositions`):
/// the stale member's transaction lands, which the test above refuses.
#[tokio::test]
async fn without_fencing_the_stale_member_commits() {
    let pg = common::fresh_pg().await;
    mutant::set(Some(Mutant::UnfencedPositions));
    let landed = scenario::stale_member_commits(&pg).await;
    mutant::set(None);
    assert!(landed, "the mutant should let the stale commit land");
}

/// A take waits for an open transaction that has recorded a position in the partition,
/// and returns what it committed; the transaction, at its epoch when it recorded it,
/// still commits.
#[tokio::test]
async fn a_take_waits_for_the_transaction_that_advanced_the_row() {
    let pg = common::fresh_pg().await;
    let a = pg.take_position(SOURCE, 2).await.expect("take").epoch;
    let mut tx = pg.begin().await.expect("begin");
    tx.claim(&key(7), &ClaimMeta::new("P-7"))
        .await
        .expect("claim");
    tx.advance_positions(&[at(2, 7, 7, a)])
        .await
        .expect("advance");
    let taker = {
        let pg = pg.clone();
        tokio::spawn(async move { pg.take_position(SOURCE, 2).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !taker.is_finished(),
        "the take did not wait for the open transaction"
    );
    tx.commit().await.expect("commit");
    let t = taker.await.expect("join").expect("take");
    assert_eq!((t.epoch, t.next), (a + 1, Some(8)));
}

/// Two transactions of one partition in flight at once record their positions without
/// waiting for each other's commit (they write different slots): a per-message
/// consumer's commits of one partition share their flushes instead of queueing.
#[tokio::test]
async fn transactions_of_one_partition_do_not_wait_for_each_other() {
    let pg = common::fresh_pg().await;
    let e = pg.take_position(SOURCE, 4).await.expect("take").epoch;
    let mut first = pg.begin().await.expect("begin");
    first
        .claim(&key(100), &ClaimMeta::new("P-100"))
        .await
        .expect("claim");
    first
        .advance_positions(&[at(4, 100, 100, e)])
        .await
        .expect("advance 100");
    let second = tokio::time::timeout(
        Duration::from_secs(5),
        commit_claims(&pg, &[at(4, 101, 100, e)]),
    )
    .await
    .expect("the second transaction waited for the first one's commit");
    second.expect("commit 101");
    first.commit().await.expect("commit 100");
    assert_eq!(stored(&pg, 4).await, (Some(102), vec![], e));
}

#[tokio::test]
async fn a_store_without_positions_refuses_a_move() {
    let pg = common::fresh_pg().await;
    let refused = {
        let mut tx = idem_testkit::MemoryStore::new()
            .begin()
            .await
            .expect("begin");
        tx.advance_positions(&[at(0, 1, 1, 1)]).await
    };
    assert!(matches!(refused, Err(StoreError::Config(_))));
    // An empty move list is nothing to record, anywhere.
    let mut tx = pg.begin().await.expect("begin");
    tx.advance_positions(&[]).await.expect("nothing to move");
    tx.rollback().await.expect("rollback");
}

#[tokio::test]
async fn a_transaction_of_two_ownerships_is_fenced() {
    scenario::a_transaction_of_two_ownerships_is_fenced(&common::fresh_pg().await).await;
}

/// An offset that stays undone while 1,600 past it are done: the position keeps them
/// all, yet no slot's array holds more than 64 (the rest are rows of
/// `idem_position_offsets`), so what each transaction rewrites does not grow with the
/// time the offset stays undone; once it is done the rows go. Before, every slot's
/// array took each offset of its own and, from 64, was rewritten and sorted whole by
/// each transaction.
#[tokio::test]
async fn an_offset_that_stays_undone_does_not_grow_what_each_transaction_writes() {
    let pg = common::fresh_pg().await;
    let epoch = scenario::while_an_offset_stays_undone(&pg).await;
    let (largest, rows) = held(&pg).await;
    assert!(
        largest <= idem_engine::position::HELD,
        "a slot holds {largest} offsets"
    );
    assert!(rows > 1_000, "{rows} offset rows");
    scenario::once_it_is_done(&pg, epoch).await;
    assert_eq!(held(&pg).await.1, 0, "offset rows left below the position");
}

/// The largest array a slot of partition [`scenario::STUCK`] holds, and the partition's
/// offset rows.
async fn held(pg: &idem_store_postgres::PgStore) -> (usize, i64) {
    let largest: Option<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT max(cardinality(done)) FROM \"{}\".idem_positions WHERE partition = $1",
        pg.schema()
    )))
    .bind(scenario::STUCK)
    .fetch_one(pg.pool())
    .await
    .expect("arrays");
    let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{}\".idem_position_offsets WHERE partition = $1",
        pg.schema()
    )))
    .bind(scenario::STUCK)
    .fetch_one(pg.pool())
    .await
    .expect("rows");
    (usize::try_from(largest.unwrap_or(0)).unwrap_or(0), rows)
}
