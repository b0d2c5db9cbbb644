//! Log positions kept in the claim's transaction (`idem_positions`): taken with a new
//! epoch by a partition's new owner, advanced monotonically in claim transactions, and
//! fenced: a member whose partition was taken since cannot commit for it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use idem_core::mutant::{self, Mutant};
use idem_core::position::advance;
use idem_core::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, PositionMove, PositionStore,
    StoreError,
};
use idem_store_postgres::PgStore;

const SOURCE: &str = "kafka/idem/grants";

fn key(n: i64) -> IdempotencyKey {
    IdempotencyKey::derive(&format!("P-{n}"), "2026-07-01T09:00:00Z", b"{}").expect("key")
}

fn at(partition: i32, offset: i64, settled_below: i64, epoch: i64) -> PositionMove {
    PositionMove {
        source: Arc::from(SOURCE),
        partition,
        offset,
        settled_below,
        epoch,
    }
}

/// Claims offset `offset`'s key and advances `moves` in one transaction: the
/// transaction's outcome.
async fn commit_claims(store: &PgStore, moves: &[PositionMove]) -> Result<(), StoreError> {
    let mut tx = store.begin().await.expect("begin");
    for m in moves {
        let claimed = tx
            .claim(&key(m.offset), &ClaimMeta::new(format!("P-{}", m.offset)))
            .await
            .expect("claim");
        assert_eq!(claimed, ClaimOutcome::Claimed);
    }
    match tx.advance_positions(moves).await {
        Ok(()) => tx.commit().await,
        Err(e) => {
            tx.rollback().await.expect("rollback");
            Err(e)
        }
    }
}

async fn stored(store: &PgStore, partition: i32) -> (Option<i64>, Vec<i64>, i64) {
    let all = store.positions(SOURCE).await.expect("positions");
    let p = all
        .into_iter()
        .find(|p| p.partition == partition)
        .expect("a row for the partition");
    (p.next, p.done, p.epoch)
}

#[tokio::test]
async fn a_take_raises_the_epoch_and_returns_what_is_stored() {
    let pg = common::fresh_pg().await;
    let t = pg.take_position(SOURCE, 0).await.expect("take");
    assert_eq!((t.epoch, t.next, t.done.clone()), (1, None, vec![]));
    commit_claims(&pg, &[at(0, 100, 100, 1), at(0, 102, 100, 1)])
        .await
        .expect("commit");
    let t = pg.take_position(SOURCE, 0).await.expect("take again");
    assert_eq!((t.epoch, t.next, t.done), (2, Some(101), vec![102]));
    // Another partition, another source: rows of their own.
    assert_eq!(pg.take_position(SOURCE, 1).await.expect("take").epoch, 1);
    assert_eq!(
        pg.take_position("kafka/idem/other", 0)
            .await
            .expect("take")
            .epoch,
        1
    );
}

#[tokio::test]
async fn transactions_finishing_out_of_order_move_the_position_over_every_offset_done() {
    let pg = common::fresh_pg().await;
    let e = pg.take_position(SOURCE, 3).await.expect("take").epoch;
    commit_claims(&pg, &[at(3, 12, 10, e)]).await.expect("12");
    assert_eq!(stored(&pg, 3).await.0, Some(10));
    commit_claims(&pg, &[at(3, 10, 10, e)]).await.expect("10");
    assert_eq!(stored(&pg, 3).await, (Some(11), vec![12], e));
    commit_claims(&pg, &[at(3, 11, 10, e)]).await.expect("11");
    assert_eq!(stored(&pg, 3).await, (Some(13), vec![], e));
    // A late transaction of an older prefix never moves it back.
    commit_claims(&pg, &[at(3, 5, 5, e)]).await.expect("5");
    assert_eq!(stored(&pg, 3).await, (Some(13), vec![], e));
}

/// The SQL statement agrees with the reference [`advance`] on every step of a
/// shuffled run, batches and single offsets mixed, on two partitions.
#[tokio::test]
async fn the_statement_agrees_with_the_reference_advance() {
    let pg = common::fresh_pg().await;
    let e0 = pg.take_position(SOURCE, 0).await.expect("take").epoch;
    let e1 = pg.take_position(SOURCE, 1).await.expect("take").epoch;
    let mut model = [(None::<i64>, Vec::<i64>::new()), (None, Vec::new())];
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut next_rand = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut offsets: Vec<i64> = (0..120).collect();
    for i in (1..offsets.len()).rev() {
        offsets.swap(
            i,
            usize::try_from(next_rand(u64::try_from(i).unwrap() + 1)).unwrap(),
        );
    }
    let mut settled = [0i64; 2];
    for chunk in offsets.chunks(3) {
        let moves: Vec<PositionMove> = chunk
            .iter()
            .map(|&o| {
                let p = usize::try_from(o % 2).unwrap();
                settled[p] = settled[p].max(i64::try_from(next_rand(4)).unwrap() * 10);
                let settled = settled[p].min(o);
                at(i32::try_from(p).unwrap(), o, settled, [e0, e1][p])
            })
            .collect();
        commit_claims(&pg, &moves).await.expect("commit");
        for (p, kept) in model.iter_mut().enumerate() {
            let p = i32::try_from(p).unwrap();
            let mine: Vec<&PositionMove> = moves.iter().filter(|m| m.partition == p).collect();
            if mine.is_empty() {
                continue;
            }
            let s = mine.iter().map(|m| m.settled_below).max().unwrap();
            let offs: Vec<i64> = mine.iter().map(|m| m.offset).collect();
            let (n, d) = advance(kept.0, &kept.1, s, &offs);
            *kept = (Some(n), d);
            let got = stored(&pg, p).await;
            assert_eq!(
                (got.0, got.1),
                kept.clone(),
                "partition {p} after {chunk:?}"
            );
        }
    }
}

/// Member A holds a partition at epoch 1; member B takes it (epoch 2); A's next
/// transaction for it must not land. Returns whether A's stale transaction committed.
async fn stale_member_commits(pg: &PgStore) -> bool {
    let a = pg.take_position(SOURCE, 7).await.expect("A takes").epoch;
    commit_claims(pg, &[at(7, 40, 40, a)])
        .await
        .expect("A commits while it owns");
    let b = pg.take_position(SOURCE, 7).await.expect("B takes");
    assert_eq!((b.epoch, b.next), (a + 1, Some(41)));
    match commit_claims(pg, &[at(7, 41, 41, a)]).await {
        Ok(()) => true,
        Err(StoreError::Fenced { partitions, .. }) => {
            assert_eq!(partitions, vec![7]);
            // Rolled back: the key is still B's to claim.
            let mut tx = pg.begin().await.expect("begin");
            assert_eq!(
                tx.claim(&key(41), &ClaimMeta::new("P-41"))
                    .await
                    .expect("claim"),
                ClaimOutcome::Claimed
            );
            tx.rollback().await.expect("rollback");
            let (next, done, epoch) = stored(pg, 7).await;
            assert_eq!((next, done, epoch), (Some(41), vec![], a + 1));
            false
        }
        Err(e) => panic!("not fenced but {e}"),
    }
}

#[tokio::test]
async fn a_member_whose_partition_was_taken_cannot_commit_for_it() {
    let pg = common::fresh_pg().await;
    assert!(
        !stale_member_commits(&pg).await,
        "the stale member's commit landed"
    );
}

/// The same scenario with the epoch check switched off (mutant `UnfencedPositions`):
/// the stale member's transaction lands, which the test above refuses.
#[tokio::test]
async fn without_fencing_the_stale_member_commits() {
    let pg = common::fresh_pg().await;
    mutant::set(Some(Mutant::UnfencedPositions));
    let landed = stale_member_commits(&pg).await;
    mutant::set(None);
    assert!(landed, "the mutant should let the stale commit land");
}

/// A take waits for an open transaction that has advanced the row, and returns what it
/// committed; the transaction, at its epoch when it advanced, still commits.
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

#[tokio::test]
async fn a_store_without_positions_refuses_a_move() {
    let pg = common::fresh_pg().await;
    let filtered_default = {
        let mut tx = idem_testkit::MemoryStore::new()
            .begin()
            .await
            .expect("begin");
        tx.advance_positions(&[at(0, 1, 1, 1)]).await
    };
    assert!(matches!(filtered_default, Err(StoreError::Config(_))));
    // An empty move list is nothing to record, anywhere.
    let mut tx = pg.begin().await.expect("begin");
    tx.advance_positions(&[]).await.expect("nothing to move");
    tx.rollback().await.expect("rollback");
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

/// Transactions of one delivery each (the statement that appends an offset, and prunes a
/// slot once it holds 64): past many prunes of every slot, the stored position still
/// agrees with the reference [`advance`]. Offsets finish out of order within a window of
/// 40, the member's settled prefix trailing behind.
#[tokio::test]
async fn single_deliveries_agree_with_the_reference_past_the_prunes() {
    let pg = common::fresh_pg().await;
    let e = pg.take_position(SOURCE, 5).await.expect("take").epoch;
    let mut model = (None::<i64>, Vec::<i64>::new());
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut rand = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut offsets: Vec<i64> = (0..2_400).collect();
    for w in offsets.chunks_mut(40) {
        for i in (1..w.len()).rev() {
            w.swap(
                i,
                usize::try_from(rand(u64::try_from(i).unwrap() + 1)).unwrap(),
            );
        }
    }
    for (i, &o) in offsets.iter().enumerate() {
        // Everything 60 behind has settled by now.
        let settled = (i64::try_from(i).unwrap() - 60).max(0).min(o);
        commit_claims(&pg, &[at(5, o, settled, e)])
            .await
            .expect("commit");
        model = {
            let (n, d) = advance(model.0, &model.1, settled, &[o]);
            (Some(n), d)
        };
        if i % 200 == 199 {
            let got = stored(&pg, 5).await;
            assert_eq!((got.0, got.1), model.clone(), "after {} deliveries", i + 1);
        }
    }
    assert_eq!(stored(&pg, 5).await.0, Some(2_400));
}
