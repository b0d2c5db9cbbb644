//! The position store's conformance scenarios ([`idem_engine::position`]), run by every
//! store that keeps log positions (`idem-store-postgres` and `idem-store-sqlite` call
//! each on a fresh store): a take raises the epoch and returns what is stored;
//! transactions finishing out of order move the position over every offset done and
//! never back; the stored position agrees with the reference
//! [`advance`] over long shuffled runs; a member whose
//! partition was taken since cannot commit for it ([`stale_member_commits`], and its
//! mutant); an offset that stays undone while many past it are done
//! ([`while_an_offset_stays_undone`], [`once_it_is_done`]).

use std::sync::Arc;

use idem_engine::position::advance;
use idem_engine::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, PositionMove, PositionStore,
    StoreError,
};

/// The source every scenario records under.
pub const SOURCE: &str = "kafka/idem/grants";

fn key(n: i64) -> IdempotencyKey {
    IdempotencyKey::derive(&format!("P-{n}"), "2026-07-01T09:00:00Z", b"{}").expect("key")
}

/// A move of `offset` in `partition` at `epoch`, with the member's settled prefix.
pub fn at(partition: i32, offset: i64, settled_below: i64, epoch: i64) -> PositionMove {
    PositionMove {
        source: Arc::from(SOURCE),
        partition,
        offset,
        settled_below,
        epoch,
    }
}

/// Claims each move's offset (its own key) and records `moves`, in one transaction;
/// rolls back what [`ClaimTx::advance_positions`] refuses and returns its error.
pub async fn commit_claims<S: ClaimStore>(
    store: &S,
    moves: &[PositionMove],
) -> Result<(), StoreError> {
    let mut tx = store.begin().await.expect("begin");
    for m in moves {
        let claimed = tx
            .claim(&key(m.offset), &ClaimMeta::new(format!("P-{}", m.offset)))
            .await
            .expect("claim");
        assert_eq!(claimed, ClaimOutcome::Claimed, "offset {}", m.offset);
    }
    match tx.advance_positions(moves).await {
        Ok(()) => tx.commit().await,
        Err(e) => {
            tx.rollback().await.expect("rollback");
            Err(e)
        }
    }
}

/// `partition`'s stored position: `next`, `done` and the epoch.
pub async fn stored<S: PositionStore>(store: &S, partition: i32) -> (Option<i64>, Vec<i64>, i64) {
    let all = store.positions(SOURCE).await.expect("positions");
    let p = all
        .into_iter()
        .find(|p| p.partition == partition)
        .expect("a row for the partition");
    (p.next, p.done, p.epoch)
}

/// A repeatable pseudo-random source from `seed`: each call a number below its bound.
pub fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |n| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    }
}

/// A take raises the epoch (from 1) and returns what is stored; partitions and sources
/// have positions of their own.
pub async fn a_take_raises_the_epoch_and_returns_what_is_stored<S>(store: &S)
where
    S: ClaimStore + PositionStore,
{
    let t = store.take_position(SOURCE, 0).await.expect("take");
    assert_eq!((t.epoch, t.next, t.done.clone()), (1, None, vec![]));
    commit_claims(store, &[at(0, 100, 100, 1), at(0, 102, 100, 1)])
        .await
        .expect("commit");
    let t = store.take_position(SOURCE, 0).await.expect("take again");
    assert_eq!((t.epoch, t.next, t.done), (2, Some(101), vec![102]));
    assert_eq!(store.take_position(SOURCE, 1).await.expect("take").epoch, 1);
    assert_eq!(
        store
            .take_position("kafka/idem/other", 0)
            .await
            .expect("take")
            .epoch,
        1
    );
}

/// Transactions finishing out of order move the position over every offset done, and a
/// late transaction of an older prefix never moves it back.
pub async fn transactions_finishing_out_of_order_move_the_position<S>(store: &S)
where
    S: ClaimStore + PositionStore,
{
    let e = store.take_position(SOURCE, 3).await.expect("take").epoch;
    commit_claims(store, &[at(3, 12, 10, e)]).await.expect("12");
    assert_eq!(stored(store, 3).await.0, Some(10));
    commit_claims(store, &[at(3, 10, 10, e)]).await.expect("10");
    assert_eq!(stored(store, 3).await, (Some(11), vec![12], e));
    commit_claims(store, &[at(3, 11, 10, e)]).await.expect("11");
    assert_eq!(stored(store, 3).await, (Some(13), vec![], e));
    commit_claims(store, &[at(3, 5, 5, e)]).await.expect("5");
    assert_eq!(stored(store, 3).await, (Some(13), vec![], e));
}

/// The stored position agrees with the reference [`advance`] on every step of a
/// shuffled run of 120 offsets on two partitions, in transactions of three deliveries.
pub async fn batches_agree_with_the_reference<S>(store: &S)
where
    S: ClaimStore + PositionStore,
{
    let e0 = store.take_position(SOURCE, 0).await.expect("take").epoch;
    let e1 = store.take_position(SOURCE, 1).await.expect("take").epoch;
    let mut model = [(None::<i64>, Vec::<i64>::new()), (None, Vec::new())];
    let mut next_rand = xorshift(0x2545_F491_4F6C_DD1D);
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
        commit_claims(store, &moves).await.expect("commit");
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
            let got = stored(store, p).await;
            assert_eq!(
                (got.0, got.1),
                kept.clone(),
                "partition {p} after {chunk:?}"
            );
        }
    }
}

/// Transactions of one delivery each, 2,400 of them finishing out of order within
/// windows of 40, the member's settled prefix trailing 60 behind: the stored position
/// agrees with the reference [`advance`] throughout (a store that prunes lazily is
/// checked past many prunes).
pub async fn single_deliveries_agree_with_the_reference<S>(store: &S)
where
    S: ClaimStore + PositionStore,
{
    let e = store.take_position(SOURCE, 5).await.expect("take").epoch;
    let mut model = (None::<i64>, Vec::<i64>::new());
    let mut rand = xorshift(0x9E37_79B9_7F4A_7C15);
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
        let settled = (i64::try_from(i).unwrap() - 60).max(0).min(o);
        commit_claims(store, &[at(5, o, settled, e)])
            .await
            .expect("commit");
        let (n, d) = advance(model.0, &model.1, settled, &[o]);
        model = (Some(n), d);
        if i % 200 == 199 {
            let got = stored(store, 5).await;
            assert_eq!((got.0, got.1), model.clone(), "after {} deliveries", i + 1);
        }
    }
    assert_eq!(stored(store, 5).await.0, Some(2_400));
}

/// Member A holds a partition at epoch 1; member B takes it (epoch 2); A's next
/// transaction for it must not land: fenced, rolled back (its key still B's to claim),
/// the stored position B's. Returns whether A's stale transaction committed (it does
/// with the epoch check off: mutant `UnfencedPositions`).
pub async fn stale_member_commits<S>(store: &S) -> bool
where
    S: ClaimStore + PositionStore,
{
    let a = store.take_position(SOURCE, 7).await.expect("A takes").epoch;
    commit_claims(store, &[at(7, 40, 40, a)])
        .await
        .expect("A commits while it owns");
    let b = store.take_position(SOURCE, 7).await.expect("B takes");
    assert_eq!((b.epoch, b.next), (a + 1, Some(41)));
    match commit_claims(store, &[at(7, 41, 41, a)]).await {
        Ok(()) => true,
        Err(StoreError::Fenced { partitions, .. }) => {
            assert_eq!(partitions, vec![7]);
            let mut tx = store.begin().await.expect("begin");
            assert_eq!(
                tx.claim(&key(41), &ClaimMeta::new("P-41"))
                    .await
                    .expect("claim"),
                ClaimOutcome::Claimed
            );
            tx.rollback().await.expect("rollback");
            assert_eq!(stored(store, 7).await, (Some(41), vec![], a + 1));
            false
        }
        Err(e) => panic!("not fenced but {e}"),
    }
}

/// One transaction holding deliveries of two ownerships of one partition (one handed
/// out before the partition was taken again): fenced, whichever of its moves is current,
/// and nothing of it lands.
pub async fn a_transaction_of_two_ownerships_is_fenced<S>(store: &S)
where
    S: ClaimStore + PositionStore,
{
    let old = store.take_position(SOURCE, 8).await.expect("take").epoch;
    let new = store
        .take_position(SOURCE, 8)
        .await
        .expect("take again")
        .epoch;
    match commit_claims(store, &[at(8, 1, 0, old), at(8, 2, 0, new)]).await {
        Err(StoreError::Fenced { partitions, .. }) => assert_eq!(partitions, vec![8]),
        other => panic!("not fenced: {other:?}"),
    }
    assert_eq!(stored(store, 8).await, (None, vec![], new));
}

/// The partition [`while_an_offset_stays_undone`] and [`once_it_is_done`] use.
pub const STUCK: i32 = 9;
/// How many offsets are done past the undone one: 1,200 in transactions of one
/// delivery, then 400 in transactions of four.
pub const DONE_PAST_IT: i64 = 1_600;

/// Offset 0 of partition [`STUCK`] stays undone (a deferred message) while offsets 1 to
/// [`DONE_PAST_IT`] are done, one delivery per transaction and then four, the member's
/// settled prefix held at 0: the stored position keeps every one of them, before and
/// after another member takes the partition. Returns the new member's epoch, for
/// [`once_it_is_done`]. A store then checks what its rows hold: a bounded array
/// ([`idem_engine::position::HELD`]), however many are done.
pub async fn while_an_offset_stays_undone<S>(store: &S) -> i64
where
    S: ClaimStore + PositionStore,
{
    let e = store
        .take_position(SOURCE, STUCK)
        .await
        .expect("take")
        .epoch;
    for o in 1..=1_200 {
        commit_claims(store, &[at(STUCK, o, 0, e)])
            .await
            .expect("commit");
    }
    let batches: Vec<i64> = (1_201..=DONE_PAST_IT).collect();
    for four in batches.chunks(4) {
        let moves: Vec<PositionMove> = four.iter().map(|&o| at(STUCK, o, 0, e)).collect();
        commit_claims(store, &moves).await.expect("commit");
    }
    let all: Vec<i64> = (1..=DONE_PAST_IT).collect();
    assert_eq!(stored(store, STUCK).await, (Some(0), all.clone(), e));
    let taken = store
        .take_position(SOURCE, STUCK)
        .await
        .expect("take again");
    assert_eq!((taken.next, taken.done), (Some(0), all.clone()));
    assert_eq!(stored(store, STUCK).await, (Some(0), all, e + 1));
    e + 1
}

/// After [`while_an_offset_stays_undone`]: offset 0 is done at the new member's epoch,
/// and the position passes every offset (to [`DONE_PAST_IT`] + 1); then 32 more
/// deliveries, the member's prefix past them all, leave nothing done past the position.
pub async fn once_it_is_done<S>(store: &S, epoch: i64)
where
    S: ClaimStore + PositionStore,
{
    commit_claims(store, &[at(STUCK, 0, 0, epoch)])
        .await
        .expect("commit 0");
    assert_eq!(
        stored(store, STUCK).await,
        (Some(DONE_PAST_IT + 1), vec![], epoch)
    );
    for o in DONE_PAST_IT + 1..=DONE_PAST_IT + 32 {
        commit_claims(store, &[at(STUCK, o, o, epoch)])
            .await
            .expect("commit");
    }
    assert_eq!(
        stored(store, STUCK).await,
        (Some(DONE_PAST_IT + 33), vec![], epoch)
    );
}
