//! Redis Cluster through fred's cluster mode, against a real three-node cluster on local
//! ports that `scripts/redis-cluster` starts (or finds running). `IDEM_TEST_REDIS_CLUSTER_URL`
//! points the test at another cluster instead. A cluster that cannot be had fails the test.
#![cfg(feature = "fred")]

mod common;

use std::collections::HashSet;
use std::sync::OnceLock;
use std::time::Duration;

use common::{key, lease_store_with, quiet_crashes, FilteredMem};
use idem_core::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, DoneFilter};
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

fn cluster_config(tag: &str) -> RedisConfig {
    RedisConfig::new(cluster_url())
        .with_key_prefix(common::fresh_prefix(tag))
        .with_timeout(Duration::from_secs(3))
        .with_client(ClientKind::Fred)
}

/// The key slots of a set of keys cover many slots, so a batch spans the three nodes.
fn distinct_slots(store: &RedisLeaseStore, keys: &[idem_core::IdempotencyKey]) -> usize {
    let slots: HashSet<u16> = keys
        .iter()
        .map(|k| fred::util::redis_keyslot(store.redis_key(k).as_bytes()))
        .collect();
    slots.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_a_cluster() {
    let url = cluster_url();
    idem_testkit::conformance::run_all(|| async {
        lease_store_with(cluster_config("cluster-conf")).await
    })
    .await;
    assert!(url.starts_with("redis-cluster://"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_span_the_nodes() {
    let store = RedisLeaseStore::connect(cluster_config("cluster-batch"))
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
        .map(|k| (fred::util::redis_keyslot(store.redis_key(k).as_bytes()) / 5461).min(2))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn front_filter_on_a_cluster() {
    quiet_crashes();
    let filter = RedisFilter::connect(cluster_config("cluster-filter"))
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
