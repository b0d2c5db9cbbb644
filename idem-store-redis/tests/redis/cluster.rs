//! Redis Cluster through each client's cluster mode (fred's, redis-rs's `cluster-async`),
//! against a real three-node cluster on local ports that `scripts/redis-cluster` starts (or
//! finds running). `IDEM_TEST_REDIS_CLUSTER_URL` points the test at another cluster
//! instead. A cluster that cannot be had fails the test.

use crate::common;

use std::collections::HashSet;
use std::sync::OnceLock;
use std::time::Duration;

use common::{key, lease_store_with, quiet_crashes, FilteredMem};
use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, DoneFilter};
use idem_store_redis::{ClientKind, KeyState, RedisConfig, RedisFilter, RedisLeaseStore};
use idem_testkit::sim::{check_exactly_once, Case};
use idem_testkit::CrashPoint;

fn cluster_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = std::env::var("IDEM_TEST_REDIS_CLUSTER_URL") {
            return url;
        }
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/redis-cluster");
        let out = std::process::Command::new("bash")
            .arg(script)
            .output()
            .unwrap_or_else(|e| panic!("running {script}: {e}"));
        assert!(
            out.status.success(),
            "{script} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    })
    .clone()
}

fn cluster_config(kind: ClientKind, tag: &str) -> RedisConfig {
    RedisConfig::new(cluster_url())
        .with_key_prefix(common::fresh_prefix(tag))
        .with_timeout(Duration::from_secs(3))
        .with_client(kind)
}

/// A key's cluster slot: CRC16 (XMODEM) of the key modulo 16384 (our keys have no hash
/// tag), written out here so the test does not trust either client's routing.
fn keyslot(key: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in key {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

#[test]
fn keyslot_matches_the_cluster_spec() {
    // The reference value from the Redis Cluster specification.
    assert_eq!(keyslot(b"123456789"), 0x31C3);
}

/// The key slots of a set of keys cover many slots, so a batch spans the three nodes.
fn distinct_slots(store: &RedisLeaseStore, keys: &[idem_engine::IdempotencyKey]) -> usize {
    let slots: HashSet<u16> = keys
        .iter()
        .map(|k| keyslot(store.redis_key(k).as_bytes()))
        .collect();
    slots.len()
}

per_client!(
    conformance_on_a_cluster,
    batches_span_the_nodes,
    batch_outcomes_on_a_cluster,
    front_filter_on_a_cluster
);

async fn conformance_on_a_cluster(kind: ClientKind) {
    let url = cluster_url();
    idem_testkit::conformance::run_all(|| async {
        lease_store_with(cluster_config(kind, "cluster-conf")).await
    })
    .await;
    assert!(url.starts_with("redis-cluster://"));
}

/// A batch on a cluster with a key repeated in it, a key another transaction holds and a
/// key already done, spread over the nodes: each answers as on one server.
async fn batch_outcomes_on_a_cluster(kind: ClientKind) {
    let store = RedisLeaseStore::connect(cluster_config(kind, "cluster-outcomes"))
        .await
        .expect("the cluster must be running");
    let done: Vec<_> = (0..20).map(|i| key(&format!("co-done-{i}"))).collect();
    let held: Vec<_> = (0..20).map(|i| key(&format!("co-held-{i}"))).collect();
    let fresh: Vec<_> = (0..20).map(|i| key(&format!("co-new-{i}"))).collect();
    let meta = ClaimMeta::new("co");
    let mut tx = store.begin().await.expect("begin");
    let items: Vec<_> = done.iter().map(|k| (*k, meta.clone())).collect();
    tx.claim_batch(&items).await.expect("claim");
    tx.commit().await.expect("commit");
    let mut other = store.begin().await.expect("begin");
    let items: Vec<_> = held.iter().map(|k| (*k, meta.clone())).collect();
    other.claim_batch(&items).await.expect("claim");

    // fresh[i], done[i], held[i], fresh[i] again: Claimed, Duplicate, InProgress, Duplicate.
    let mut items = Vec::new();
    for i in 0..20 {
        for k in [fresh[i], done[i], held[i], fresh[i]] {
            items.push((k, meta.clone()));
        }
    }
    let mut tx = store.begin().await.expect("begin");
    let out = tx.claim_batch(&items).await.expect("claim_batch");
    for (i, chunk) in out.chunks(4).enumerate() {
        assert_eq!(
            chunk,
            [
                ClaimOutcome::Claimed,
                ClaimOutcome::Duplicate,
                ClaimOutcome::InProgress,
                ClaimOutcome::Duplicate
            ],
            "item group {i}"
        );
    }
    assert_eq!(tx.claimed().count(), 20);
    tx.commit().await.expect("commit");
    other.rollback().await.expect("rollback");
    for i in 0..20 {
        assert_eq!(store.state(&fresh[i]).await.expect("state"), KeyState::Done);
        assert_eq!(store.state(&held[i]).await.expect("state"), KeyState::Free);
    }
}

async fn batches_span_the_nodes(kind: ClientKind) {
    let store = RedisLeaseStore::connect(cluster_config(kind, "cluster-batch"))
        .await
        .expect("the cluster must be running");
    let keys: Vec<_> = (0..300).map(|i| key(&format!("cb-{i}"))).collect();
    assert!(
        distinct_slots(&store, &keys) > 250,
        "keys must spread over slots"
    );
    // Slots 0-5460, 5461-10922, 10923-16383 belong to the three nodes.
    let nodes: HashSet<u16> = keys
        .iter()
        .map(|k| (keyslot(store.redis_key(k).as_bytes()) / 5461).min(2))
        .collect();
    assert_eq!(nodes.len(), 3);

    let items: Vec<_> = keys.iter().map(|k| (*k, ClaimMeta::new("cb"))).collect();
    let mut tx = store.begin().await.expect("begin");
    let out = tx.claim_batch(&items).await.expect("claim_batch");
    assert!(out.iter().all(|o| *o == ClaimOutcome::Claimed));
    tx.commit().await.expect("commit");
    let mut tx = store.begin().await.expect("begin");
    let out = tx.claim_batch(&items).await.expect("claim_batch");
    assert!(out.iter().all(|o| *o == ClaimOutcome::Duplicate));
    tx.rollback().await.expect("rollback");
    for k in keys.iter().step_by(37) {
        assert_eq!(store.state(k).await.expect("state"), KeyState::Done);
    }

    // A rolled-back batch frees every key, on every node.
    let fresh: Vec<_> = (0..60)
        .map(|i| (key(&format!("cr-{i}")), ClaimMeta::new("cr")))
        .collect();
    let mut tx = store.begin().await.expect("begin");
    tx.claim_batch(&fresh).await.expect("claim_batch");
    tx.rollback().await.expect("rollback");
    for (k, _) in &fresh {
        assert_eq!(store.state(k).await.expect("state"), KeyState::Free);
    }
}

async fn front_filter_on_a_cluster(kind: ClientKind) {
    quiet_crashes();
    let filter = RedisFilter::connect(cluster_config(kind, "cluster-filter"))
        .await
        .expect("the cluster must be running");
    let keys: Vec<_> = (0..200).map(|i| key(&format!("cf-{i}"))).collect();
    let marked: Vec<_> = keys.iter().step_by(2).copied().collect();
    filter.mark_done(&marked).await.expect("mark");
    let seen = filter.seen(&keys).await.expect("seen");
    assert!(seen.iter().enumerate().all(|(i, s)| *s == (i % 2 == 0)));

    let case = Case {
        submissions: (0..15)
            .map(|i| (format!("C-{i}"), "2026-07-01T09:00:00Z".to_owned(), 5 + i))
            .collect(),
        poison: 1,
        redelivery_rate: 0.5,
        crashes: CrashPoint::ALL.iter().map(|&p| (p, 2)).collect(),
        errors: Vec::new(),
        expiry_rate: 0.0,
        concurrency: 3,
        batch_size: 4,
        seed: 9,
    };
    let store = FilteredMem::new(filter);
    check_exactly_once(store.clone(), &case)
        .await
        .expect("exactly once on a cluster");
    assert!(
        store.0.stats().hits() > 0,
        "the cluster filter answered nothing"
    );
}
