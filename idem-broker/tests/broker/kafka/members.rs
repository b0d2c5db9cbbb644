//! Group members killed, joining and leaving mid-run.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::Broker;
use idem_broker::any::{publish_raw, AnyConsumer, BrokerUrl};
use idem_store_postgres::PgStore;

use super::{
    broker_in, brokers, member, next_within, spawn_member, url_in, wait_for_disbursements,
};
use crate::common;

/// Two members of one group share a topic's partitions; one (a child process) is killed
/// with SIGKILL in the middle of its work: messages processed and committed to Postgres
/// but not to the group, others received and not processed. The survivor consumes until
/// it has been idle longer than the session timeout plus a rebalance, then leaves; a
/// replacement member joins the group and consumes until idle. End: exactly one
/// disbursement per submission, and nothing left uncommitted in the group.
///
/// On Kafka the survivor takes the dead member's partitions once its session times out
/// and the replacement finds nothing left. tansu 0.6 never gives them to the survivor
/// (seen with `IDEM_KAFKA_DEBUG=cgrp`): the survivor's heartbeat that finds the dead
/// member's session expired removes it and answers REBALANCE_IN_PROGRESS, but the group
/// stays "formed" with its generation and stored assignments, so the survivor's rejoin
/// gets the same generation, the dead member still named leader, and from SyncGroup its
/// old partitions (a formed group's SyncGroup returns the stored assignment). Only a join
/// or leave that changes the membership forms the group again; here the survivor leaves
/// when idle and, if it could not finish, the replacement joins, owns every partition
/// and resumes from the committed offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_members_one_killed_mid_run_exactly_once() {
    const N: usize = 400;
    const D: usize = 100;
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let broker = Broker {
        // Longer than the session timeout (6 s) plus a rebalance.
        idle: Duration::from_secs(12),
        ..broker_in(&group)
    };
    let name = common::fresh_name("killed");
    let store = common::fresh_pg().await;
    let (distinct, ledger) = common::submissions(&name, N);
    let mut bodies = distinct.clone();
    bodies.extend_from_slice(&distinct[..D]);
    publish_raw(&broker.url, &name, &bodies)
        .await
        .expect("publish");

    let mut child = spawn_member(&group, &name, &store, &["--delay-ms", "15"]);
    let count = |store: PgStore| async move { common::effects(&store).await.len() };
    // The child has joined and works.
    wait_for_disbursements(&store, &mut child, 10).await;
    // Kill it once the group has done a good part, while it is still busy.
    let killer_store = store.clone();
    let killer = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(180);
        while count(killer_store.clone()).await < 150 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        child.kill().expect("SIGKILL the child member");
        let _ = child.wait();
        count(killer_store).await
    });
    let survivor = common::consume_all(&broker, &name, &store, 1, 1).await;
    let at_kill = killer.await.expect("killer");
    assert!(
        at_kill < N,
        "the child was killed mid-run ({at_kill} of {N} done at the kill)"
    );
    assert_eq!((survivor.rejected, survivor.failed), (0, 0), "{survivor:?}");
    let after_survivor = count(store.clone()).await;
    eprintln!(
        "killed at {at_kill} disbursements; {after_survivor} of {N} when the survivor went idle"
    );

    // Where the survivor could not finish (tansu left the dead member's partitions
    // assigned to it), a replacement joins the same group and resumes from its committed
    // offsets. Where the survivor finished, tansu's group may stay formed around the dead
    // member for minutes and refuse a newcomer any partition: nothing is left for one.
    if after_survivor < N {
        let replacement = spawn_member(&group, &name, &store, &["--exit-when-idle", "15"])
            .wait_with_output()
            .expect("the replacement member");
        assert!(replacement.status.success(), "replacement: {replacement:?}");
    }
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert_eq!(
        common::wait_pending(&broker.url, &name, 0).await,
        0,
        "nothing left to settle"
    );
}

/// Samples the group's committed offsets of `topic` until `stop`; returns every
/// backward move seen (partition, before, after) and the number of samples.
async fn watch_commits(
    group: String,
    topic: String,
    stop: Arc<AtomicBool>,
) -> (Vec<(i32, i64, i64)>, usize) {
    tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let c: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("watcher");
        let mut last: HashMap<i32, i64> = HashMap::new();
        let mut back = Vec::new();
        let mut samples = 0;
        while !stop.load(Ordering::SeqCst) {
            let mut tpl = rdkafka::TopicPartitionList::new();
            for p in 0..4 {
                tpl.add_partition(&topic, p);
            }
            if let Ok(got) = c.committed_offsets(tpl, Duration::from_secs(5)) {
                samples += 1;
                for e in got.elements_for_topic(&topic) {
                    if let rdkafka::Offset::Offset(o) = e.offset() {
                        let prev = last.insert(e.partition(), o);
                        if let Some(p) = prev.filter(|p| o < *p) {
                            back.push((e.partition(), p, o));
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        (back, samples)
    })
    .await
    .expect("watcher thread")
}

/// A rebalance with deliveries in flight: member A works through a 4-partition topic,
/// four deliveries at a time, each held 40 ms; once it has done a good part, member B
/// joins the group, the partitions are split between them (A's in-flight deliveries on
/// the partitions that move are dropped and B receives them again), both run until idle.
/// Meanwhile a watcher samples the group's committed offsets every 50 ms. End: B took
/// part, each submission has exactly one effect (nothing doubled, nothing lost), nothing
/// is left uncommitted, and no committed offset ever moved back (a mark A took before
/// the revoke and committed after it would move it back below B's).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_joining_mid_run_takes_partitions_with_deliveries_in_flight() {
    const N: usize = 400;
    const D: usize = 50;
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let url = BrokerUrl::parse(&format!(
        "{}&assignment={}",
        url_in(&group, 4),
        assignment()
    ))
    .expect("url");
    let name = common::fresh_name("rebalance");
    let store = common::fresh_pg().await;
    let (distinct, ledger) = common::submissions(&name, N);
    let mut bodies = distinct.clone();
    bodies.extend_from_slice(&distinct[..D]);
    publish_raw(&url, &name, &bodies).await.expect("publish");

    let stop = Arc::new(AtomicBool::new(false));
    let watcher = tokio::spawn(watch_commits(
        group.clone(),
        name.clone(),
        Arc::clone(&stop),
    ));
    let idle = Duration::from_secs(12);
    // Each delivery held 40 ms: A's last three quarters take about 14 s, time for the
    // rebalance B's join starts to hand it partitions even on a loaded machine (at 20 ms,
    // A once finished all 400 first).
    let hold = Duration::from_millis(40);
    let a = tokio::spawn(member(url.clone(), name.clone(), store.clone(), hold, idle));
    let deadline = Instant::now() + Duration::from_secs(60);
    while common::effects(&store).await.len() < N / 4 {
        assert!(Instant::now() < deadline, "member A processed too little");
        assert!(!a.is_finished(), "member A ended early");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let at_join = common::effects(&store).await.len();
    let b = tokio::spawn(member(url.clone(), name.clone(), store.clone(), hold, idle));
    let (a, b) = (a.await.expect("A"), b.await.expect("B"));
    stop.store(true, Ordering::SeqCst);
    let (back, samples) = watcher.await.expect("watcher");
    eprintln!("B joined at {at_join} of {N}; A {a:?}; B {b:?}; {samples} commit samples");
    assert!(at_join < N, "B joined mid-run");
    assert!(b.processed > 0, "B took partitions and processed: {b:?}");
    assert_eq!(a.processed + b.processed, N as u64, "A {a:?} B {b:?}");
    assert_eq!((a.rejected + b.rejected, a.failed + b.failed), (0, 0));
    ledger.assert_exactly_once(&common::effects(&store).await);
    assert!(samples > 10, "the watcher sampled the commits ({samples})");
    assert!(back.is_empty(), "committed offsets moved back: {back:?}");
    assert_eq!(
        common::wait_pending(&url, &name, 0).await,
        0,
        "nothing left uncommitted"
    );
}

/// The rebalance strategy under test: `IDEM_TEST_KAFKA_ASSIGNMENT`, default
/// `cooperative-sticky`.
fn assignment() -> String {
    std::env::var("IDEM_TEST_KAFKA_ASSIGNMENT").unwrap_or_else(|_| "cooperative-sticky".to_owned())
}

/// A member that lost its partition in a rebalance does not dead-letter a delivery it
/// received before: member A holds a delivery; member B joins the group (an eager
/// protocol, so every partition is revoked and assigned again); once one of them has
/// received the message again, A's dead letter of its old delivery is refused and the
/// dead-letter topic stays empty — its new owner decides (before, A's dead letter went
/// out beside the new owner's processing).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_that_lost_its_partition_does_not_dead_letter_its_delivery() {
    use idem_engine::{Acker as _, RejectReason};
    let group = format!("idem-test-{:08x}", rand::random::<u32>());
    let url = BrokerUrl::parse(&format!("{}&assignment=range", url_in(&group, 1))).expect("url");
    let name = common::fresh_name("stale-dead-letter");
    publish_raw(&url, &name, &[b"held".to_vec()])
        .await
        .expect("publish");
    let mut a = AnyConsumer::connect(&url, &name, 8).await.expect("A");
    let d = next_within(&mut a, Duration::from_secs(60))
        .await
        .expect("A's delivery within 60 s")
        .expect("A's stream goes on")
        .expect("A's delivery");
    let mut b = AnyConsumer::connect(&url, &name, 8).await.expect("B");
    // The rebalance: the message comes again, to A (a new ownership) or to B.
    let again = tokio::time::timeout(Duration::from_secs(90), async {
        use futures::StreamExt as _;
        tokio::select! {
            Some(r) = a.next() => r,
            Some(r) = b.next() => r,
        }
    })
    .await
    .expect("the message delivered again within 90 s of B's join")
    .expect("a delivery");
    assert_eq!(again.payload, b"held");
    let refused = d
        .acker
        .dead_letter(
            &d.payload,
            &d.headers,
            &RejectReason::new("test", "dead-lettered by a member that lost the partition"),
        )
        .await;
    assert!(refused.is_err(), "a stale member's dead letter is refused");
    // A reader in a group of its own (a member of the test's group would rebalance it).
    let reader = BrokerUrl::parse(&url_in(&format!("{group}-letters"), 1)).expect("url");
    let mut letters = AnyConsumer::connect(&reader, &idem_broker::dead_letter_name(&name), 8)
        .await
        .expect("dead-letter consumer");
    let letters = common::drain(&mut letters, Duration::from_secs(8)).await;
    assert!(
        letters.is_empty(),
        "nothing dead-lettered: {} letters",
        letters.len()
    );
    drop(again);
}
