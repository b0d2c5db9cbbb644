//! Positions stored in the store: successors, fencing, and refused positions.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_broker::any::{publish_raw, AnyConsumer, BrokerUrl};
use idem_broker::kafka::KafkaConfig;
use idem_broker::until_idle;
use idem_engine::{consumer, ConsumerConfig, Gate};
use idem_grant::GrantDb;
use idem_store_postgres::PgStore;

use super::{
    next_within, one_partition, publish_all, spawn_member, url_in, wait_for_disbursements,
};
use crate::common;

/// The test URL of `group` with the positions kept in the store (`?positions=store`).
fn positions_url(group: &str, partitions: u32) -> BrokerUrl {
    BrokerUrl::parse(&format!("{}&positions=store", url_in(group, partitions))).expect("URL")
}

/// Consumes `name` in `url`'s group into `store` until idle for `idle`, the positions
/// kept in `store` where the URL asks; `concurrency` batches of up to `batch`.
async fn consume_positioned(
    url: &BrokerUrl,
    name: &str,
    store: &PgStore,
    (concurrency, batch): (usize, usize),
    idle: Duration,
) -> idem_engine::ConsumerStats {
    let positions: Arc<dyn idem_engine::PositionStore> = Arc::new(store.clone());
    let deliveries = AnyConsumer::connect_with(url, name, 2 * concurrency * batch, Some(positions))
        .await
        .expect("connect consumer");
    let gate = Gate::new(store.clone(), store.grant_handler());
    consumer::run(
        &gate,
        until_idle(deliveries, idle),
        ConsumerConfig::new(concurrency, batch),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("consumer run")
}

/// A member (child process, batches of 10, four at once) is killed with SIGKILL mid-run;
/// a new member of the group then consumes the rest. Returns the disbursements made
/// when it was killed and the new member's stats. Exactly once either way.
async fn killed_and_succeeded(positions: bool) -> (usize, idem_engine::ConsumerStats) {
    const N: usize = 400;
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let name = common::fresh_name(if positions { "pos-kill" } else { "lwm-kill" });
    let store = common::fresh_pg().await;
    let (bodies, ledger) = common::submissions(&name, N);
    let url = if positions {
        positions_url(&group, 4)
    } else {
        BrokerUrl::parse(&url_in(&group, 4)).expect("URL")
    };
    publish_raw(&url, &name, &bodies).await.expect("publish");
    let flag = if positions { "1" } else { "0" };
    let args = [
        "--delay-ms",
        "2",
        "--batch",
        "10",
        "--concurrency",
        "4",
        "--positions",
        flag,
    ];
    let mut child = spawn_member(&group, &name, &store, &args);
    wait_for_disbursements(&store, &mut child, 150).await;
    child.kill().expect("SIGKILL the child member");
    let _ = child.wait();
    let at_kill = common::effects(&store).await.len();
    assert!(at_kill < N, "killed mid-run ({at_kill} of {N})");
    let stats = consume_positioned(&url, &name, &store, (4, 10), Duration::from_secs(12)).await;
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert_eq!((stats.rejected, stats.failed), (0, 0), "{stats:?}");
    (at_kill, stats)
}

/// With positions stored, a member killed mid-batch leaves nothing for its successor to
/// read again: every transaction it committed moved the partition's stored position in
/// the same commit, and the successor starts there (skipping what finished out of
/// order), so the gate meets no duplicate. With broker commits only, the successor
/// re-reads from the last offset committed to the group (printed for comparison).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_positions_stored_a_killed_members_successor_replays_nothing() {
    let (at_kill, stored) = killed_and_succeeded(true).await;
    eprintln!("positions in the store: killed at {at_kill}; successor {stored:?}");
    assert_eq!(
        stored.duplicates, 0,
        "replayed below the stored position: {stored:?}"
    );
    let (at_kill, broker) = killed_and_succeeded(false).await;
    eprintln!("positions in the broker: killed at {at_kill}; successor {broker:?}");
}

/// A member holds deliveries of its partition when another member takes the partition
/// (a new epoch in the store): its transactions for them are fenced — rolled back, the
/// deliveries left unsettled (no disbursement, no ack, no dead letter) — and the
/// partition's new owner processes each exactly once. Returns how many of the stale
/// member's transactions committed (0 unless fencing is off).
async fn stale_member_commits(held: usize) -> usize {
    use idem_broker::kafka::KafkaConsumer;
    use idem_engine::{Outcome, PositionStore as _};
    let store = common::fresh_pg().await;
    let position_store: Arc<dyn idem_engine::PositionStore> = Arc::new(store.clone());
    let config = one_partition(&common::fresh_name("fenced"))
        .with_position_store(Arc::clone(&position_store));
    let (bodies, ledger) = common::submissions(&config.name, held);
    let url = BrokerUrl::parse(&url_in(&config.group, 1)).expect("URL");
    publish_raw(&url, &config.name, &bodies)
        .await
        .expect("publish");
    let mut stale = KafkaConsumer::connect(&config).await.expect("connect");
    let in_hand = common::take(&mut stale, held).await;
    // Another member takes the partition: the epoch moves on.
    let taken = store
        .take_position(&config.position_source(), 0)
        .await
        .expect("take");
    assert_eq!(taken.epoch, 2, "the stale member took epoch 1");
    let gate = Gate::new(store.clone(), store.grant_handler());
    let mut landed = 0;
    for d in in_hand {
        match gate.process(d).await {
            Outcome::Failed { error, settle, .. } => {
                assert!(
                    matches!(error, idem_engine::Error::Store(ref e) if e.is_fenced()),
                    "{error}"
                );
                assert!(settle.is_ok());
            }
            Outcome::Processed { .. } => landed += 1,
            other => panic!("{other:?}"),
        }
    }
    if landed == 0 {
        assert!(common::effects(&store).await.is_empty());
    }
    drop(stale);
    // The new owner (after the stale member left) processes every one exactly once.
    let stats = next_member(&config, &store).await;
    if landed == 0 {
        assert_eq!(stats.processed, u64::try_from(held).unwrap(), "{stats:?}");
        ledger.assert_exactly_once(&common::effects(&store).await);
    }
    landed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_partition_was_taken_commits_nothing_for_it() {
    assert_eq!(
        stale_member_commits(5).await,
        0,
        "a stale member's commit landed"
    );
}

/// The test above with the epoch check off (mutant `UnfencedPositions`): the stale
/// member's transactions land, which the test above refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_fencing_a_stale_members_commits_land() {
    idem_engine::mutant::set(Some(idem_engine::mutant::Mutant::UnfencedPositions));
    let landed = stale_member_commits(5).await;
    idem_engine::mutant::set(None);
    assert_eq!(landed, 5, "the mutant should let every stale commit land");
}

/// Three members with positions stored, two of them killed (SIGKILL) at different
/// points while the group rebalances around them; a replacement consumes the rest.
/// Exactly one disbursement per submission, nothing left to settle, and the
/// replacement meets no duplicate: every partition's successor started at its stored
/// position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_two_killed_with_positions_stored_exactly_once() {
    const N: usize = 600;
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let name = common::fresh_name("pos-three");
    let store = common::fresh_pg().await;
    let (bodies, ledger) = common::submissions(&name, N);
    let url = positions_url(&group, 4);
    publish_raw(&url, &name, &bodies).await.expect("publish");
    let args = [
        "--delay-ms",
        "5",
        "--batch",
        "5",
        "--concurrency",
        "2",
        "--positions",
        "1",
    ];
    let mut first = spawn_member(&group, &name, &store, &args);
    let mut second = spawn_member(&group, &name, &store, &args);
    let survivor = {
        let (url, name, store) = (url.clone(), name.clone(), store.clone());
        tokio::spawn(async move {
            consume_positioned(&url, &name, &store, (2, 5), Duration::from_secs(15)).await
        })
    };
    let count = |store: PgStore| async move { common::effects(&store).await.len() };
    let deadline = Instant::now() + Duration::from_secs(240);
    for (child, at) in [(&mut first, 120), (&mut second, 300)] {
        while count(store.clone()).await < at {
            assert!(Instant::now() < deadline, "the group never got to {at}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        child.kill().expect("SIGKILL a member");
        let _ = child.wait();
    }
    let survivor = survivor.await.expect("survivor");
    // A delivery the survivor held when its partition moved on is fenced (failed,
    // unsettled), never dead-lettered.
    eprintln!("survivor: {survivor:?}");
    assert_eq!(
        (survivor.rejected, survivor.duplicates),
        (0, 0),
        "{survivor:?}"
    );
    if count(store.clone()).await < N {
        // tansu hands a dead member's partitions on only when the membership changes.
        let replacement =
            consume_positioned(&url, &name, &store, (2, 5), Duration::from_secs(15)).await;
        eprintln!("replacement: {replacement:?}");
        assert_eq!(replacement.duplicates, 0, "{replacement:?}");
    }
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert_eq!(
        common::wait_pending(&url, &name, 0).await,
        0,
        "nothing left to settle"
    );
}

/// A new member of `config`'s group, one delivery at a time into `store`, until idle
/// for 8 s.
async fn next_member(config: &KafkaConfig, store: &PgStore) -> idem_engine::ConsumerStats {
    let next = idem_broker::kafka::KafkaConsumer::connect(config)
        .await
        .expect("connect the next member");
    let gate = Gate::new(store.clone(), store.grant_handler());
    consumer::run(
        &gate,
        until_idle(next, Duration::from_secs(8)),
        ConsumerConfig::new(1, 1),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("the next member")
}

/// A member commits offsets 1..=9 of its partition while offset 0 is still in hand (a
/// slow delivery), then dies holding 0. The group's committed offset cannot pass 0, so
/// with broker commits only the successor reads 1..=9 again (nine duplicates); with
/// positions stored, the store holds 1..=9 done and the successor skips them: the gate
/// sees offset 0 alone. Returns the successor's (processed, duplicates).
async fn successor_after_a_slow_first(positions: bool) -> (u64, u64) {
    use idem_broker::kafka::KafkaConsumer;
    const N: usize = 10;
    let store = common::fresh_pg().await;
    let mut config = one_partition(&common::fresh_name("slow-first"));
    if positions {
        config = config.with_position_store(Arc::new(store.clone()));
    }
    let (bodies, ledger) = common::submissions(&config.name, N);
    let url = BrokerUrl::parse(&url_in(&config.group, 1)).expect("URL");
    publish_raw(&url, &config.name, &bodies)
        .await
        .expect("publish");
    let gate = Gate::new(store.clone(), store.grant_handler());
    let mut first = KafkaConsumer::connect(&config).await.expect("connect");
    let mut in_hand = common::take(&mut first, N).await.into_iter();
    let slow = in_hand.next().expect("offset 0");
    assert_eq!(slow.acker.offset(), 0);
    for d in in_hand {
        let o = gate.process(d).await;
        assert_eq!(o.kind(), idem_engine::OutcomeKind::Processed, "{o:?}");
    }
    // The member dies holding offset 0.
    drop(slow);
    drop(first);
    let stats = next_member(&config, &store).await;
    ledger.assert_exactly_once(&common::effects(&store).await);
    (stats.processed, stats.duplicates)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_positions_stored_a_successor_reads_again_only_what_is_not_done() {
    assert_eq!(successor_after_a_slow_first(true).await, (1, 0));
    assert_eq!(successor_after_a_slow_first(false).await, (1, 9));
}

/// A stored position past the end of the partition's log (the topic was deleted and
/// created again; the store kept the old topic's position) would skip records no one
/// processed: the member refuses it, ending its stream with a configuration error, and
/// hands out nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_position_past_the_end_of_the_log_stops_the_member() {
    use idem_broker::kafka::KafkaConsumer;
    use idem_engine::{ClaimStore as _, ClaimTx as _, PositionMove, PositionStore as _};
    let store = common::fresh_pg().await;
    let config =
        one_partition(&common::fresh_name("past-end")).with_position_store(Arc::new(store.clone()));
    let url = BrokerUrl::parse(&url_in(&config.group, 1)).expect("URL");
    let (bodies, _) = common::submissions(&config.name, 3);
    publish_raw(&url, &config.name, &bodies)
        .await
        .expect("publish");
    // The old topic's position: everything below 1000 done.
    let source = config.position_source();
    let epoch = store.take_position(&source, 0).await.expect("take").epoch;
    let mut tx = store.begin().await.expect("begin");
    tx.advance_positions(&[PositionMove {
        source: source.as_str().into(),
        partition: 0,
        offset: 999,
        settled_below: 999,
        epoch,
    }])
    .await
    .expect("advance");
    tx.commit().await.expect("commit");
    let mut consumer = KafkaConsumer::connect(&config).await.expect("connect");
    let first = next_within(&mut consumer, Duration::from_secs(120))
        .await
        .expect("an answer within 120 s")
        .expect("the stream's first item");
    match first {
        Err(idem_broker::BrokerError::Config { detail, .. }) => {
            assert!(detail.contains("past the end of the log"), "{detail}");
        }
        Err(e) => panic!("another error: {e}"),
        Ok(d) => panic!("a delivery was handed out: offset {}", d.acker.offset()),
    }
    assert!(common::effects(&store).await.is_empty());
}

/// With positions stored, the store is the authority: a group offset ahead of the stored
/// position (an operator's offset reset, or another client committing in the group)
/// skips nothing. A positioned member processes offsets 0..3; another consumer of the
/// group, which keeps no positions (its own store), settles 3..8, moving the group's
/// offset to 8; the next positioned member seeks back to the stored position 3 and
/// processes 3..10 into the first store: every submission exactly once there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_forward_commit_skips_nothing_with_positions_stored() {
    use idem_broker::kafka::KafkaConsumer;
    const N: usize = 10;
    let store = common::fresh_pg().await;
    let config = one_partition(&common::fresh_name("foreign-commit"));
    let positioned = config.clone().with_position_store(Arc::new(store.clone()));
    let (bodies, ledger) = common::submissions(&config.name, N);
    publish_all(&config, &bodies).await;
    let gate = Gate::new(store.clone(), store.grant_handler());
    let mut first = KafkaConsumer::connect(&positioned.clone().with_prefetch(3))
        .await
        .expect("connect");
    for d in common::take(&mut first, 3).await {
        let o = gate.process(d).await;
        assert_eq!(o.kind(), idem_engine::OutcomeKind::Processed, "{o:?}");
    }
    drop(first);
    let stored = |store: PgStore, source: String| async move {
        use idem_engine::PositionStore as _;
        store.positions(&source).await.expect("positions")[0].next
    };
    assert_eq!(
        stored(store.clone(), positioned.position_source()).await,
        Some(3)
    );
    // Another consumer in the group, without positions and with a store of its own.
    let foreign_store = common::fresh_pg().await;
    let foreign_gate = Gate::new(foreign_store.clone(), foreign_store.grant_handler());
    let mut foreign = KafkaConsumer::connect(&config.clone().with_prefetch(5))
        .await
        .expect("connect the foreign consumer");
    for d in common::take(&mut foreign, 5).await {
        let offset = d.acker.offset();
        assert!((3..8).contains(&offset), "offset {offset}");
        let o = foreign_gate.process(d).await;
        assert_eq!(o.kind(), idem_engine::OutcomeKind::Processed, "{o:?}");
    }
    assert_eq!(
        common::wait_pending(
            &BrokerUrl::parse(&url_in(&config.group, 1)).expect("URL"),
            &config.name,
            2
        )
        .await,
        2,
        "the group's offset moved to 8"
    );
    drop(foreign);
    let stats = next_member(&positioned, &store).await;
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert_eq!((stats.processed, stats.duplicates), (7, 0), "{stats:?}");
    assert_eq!(
        stored(store.clone(), positioned.position_source()).await,
        Some(10)
    );
}

/// A member that lost the partition took it from the store late, after its new owner had
/// (its take was still in flight at the revoke): the epoch is past the owner's, and every
/// transaction of the owner for the partition is fenced. The owner starts the partition
/// over — takes it again (fencing the late member, which no longer reads it) and reads
/// again from its mark — and processes every submission exactly once in the same run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_fenced_by_a_late_take_takes_the_partition_again() {
    use idem_broker::kafka::KafkaConsumer;
    use idem_engine::PositionStore as _;
    const N: usize = 10;
    let store = common::fresh_pg().await;
    let config = one_partition(&common::fresh_name("late-take"))
        .with_position_store(Arc::new(store.clone()))
        .with_prefetch(2);
    let (bodies, ledger) = common::submissions(&config.name, N);
    publish_all(&config, &bodies).await;
    let gate = Gate::new(store.clone(), store.grant_handler());
    let mut owner = KafkaConsumer::connect(&config).await.expect("connect");
    for d in common::take(&mut owner, 3).await {
        let o = gate.process(d).await;
        assert_eq!(o.kind(), idem_engine::OutcomeKind::Processed, "{o:?}");
    }
    // The late take of a member that lost the partition.
    let source = config.position_source();
    let late = store.take_position(&source, 0).await.expect("take");
    assert_eq!(late.epoch, 2, "the owner took epoch 1");
    let stats = consumer::run(
        &gate,
        until_idle(owner, Duration::from_secs(8)),
        ConsumerConfig::new(1, 1),
        std::future::pending::<()>(),
        |_| {},
    )
    .await
    .expect("the owner's run");
    eprintln!("{stats:?}");
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert!(stats.failed >= 1, "no transaction was fenced: {stats:?}");
    assert_eq!(stats.processed, 7, "{stats:?}");
    let row = &store.positions(&source).await.expect("positions")[0];
    assert_eq!((row.next, row.epoch), (Some(10), 3), "{row:?}");
}
