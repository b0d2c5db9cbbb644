//! What the lease store alone guarantees, with the business write elsewhere: never lost
//! (a crashed worker's lease expires and the redelivery runs), at least once (the work
//! may run twice), effectively once when the crash comes before the write.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{config, key, lease_store_with, quiet_crashes, LeaseTestStore};
use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, Gate, OutcomeKind, StoreError};
use idem_store_redis::{ClientKind, KeyState, RedisConfig, RedisLeaseStore};
use idem_testkit::{
    encode_submission, CrashPoint, EffectHandler, EffectHandlerFor, FaultPlan, FaultyHandler,
    FaultyStore, Ledger, SimBroker, SimConfig, TestStore, Violation,
};

const LEASE: Duration = Duration::from_millis(400);

async fn short_lease_store(kind: ClientKind) -> LeaseTestStore {
    lease_store_with(config(kind, "lease-expiry").with_lease(LEASE)).await
}

/// A worker claims, does the business write, and dies before its commit (`mem::forget`:
/// no rollback, no drop). The redelivery is deferred while the lease lives — never acked —
/// then runs once the lease has expired. Never lost; the effect happened twice: that is
/// the at-least-once guarantee of a lease store alone.
async fn crash_after_the_write_redelivery_runs_again(kind: ClientKind) {
    let store = short_lease_store(kind).await;
    let broker = SimBroker::new(7);
    let body = encode_submission("L-1", "2026-07-01T09:00:00Z", 500);
    let sub = EffectHandler::parse(&body).expect("valid");
    broker.publish(body);
    let gate = Gate::new(store.clone(), EffectHandlerFor::<LeaseTestStore>::new());

    // Worker A: claim, write, crash.
    let first = broker.receive().expect("delivery");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&sub.key, &ClaimMeta::new("L-1"))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed
    );
    LeaseTestStore::write_effect(&mut tx, &sub.key, "L-1", 500)
        .await
        .expect("write");
    std::mem::forget(tx);
    drop(first.acker); // the process died: the broker never heard an ack
    assert_eq!(
        store.store.state(&sub.key).await.expect("state"),
        KeyState::Leased
    );

    // The redelivery while the lease lives: deferred (nacked), not acked.
    let d = broker.receive().expect("redelivery");
    assert_eq!(gate.process(d).await.kind(), OutcomeKind::Deferred);
    assert_eq!(
        broker.ready_len(),
        1,
        "a deferred delivery must go back to the broker"
    );

    // After the lease: the redelivery runs, and commits.
    tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
    assert_eq!(
        store.store.state(&sub.key).await.expect("state"),
        KeyState::Free
    );
    let d = broker.receive().expect("redelivery");
    assert_eq!(gate.process(d).await.kind(), OutcomeKind::Processed);
    assert_eq!(
        store.store.state(&sub.key).await.expect("state"),
        KeyState::Done
    );

    // A later duplicate is skipped and acked.
    broker.publish(encode_submission("L-1", "2026-07-01T09:00:00Z", 500));
    let d = broker.receive().expect("duplicate");
    assert_eq!(gate.process(d).await.kind(), OutcomeKind::Duplicate);
    assert!(broker.is_settled());

    let effects = store.effects().await.expect("effects");
    assert_eq!(
        effects.len(),
        2,
        "lease store alone: the crashed attempt's write and the redelivery's (at least once)"
    );
    assert!(effects.iter().all(|e| e.key == sub.key && e.amount == 500));
}

/// The same crash before the business write: the redelivery runs after the lease and the
/// effect happens exactly once (effectively once).
async fn crash_before_the_write_is_effectively_once(kind: ClientKind) {
    let store = short_lease_store(kind).await;
    let broker = SimBroker::new(8);
    let body = encode_submission("L-2", "2026-07-01T09:00:00Z", 700);
    let sub = EffectHandler::parse(&body).expect("valid");
    broker.publish(body);
    let gate = Gate::new(store.clone(), EffectHandlerFor::<LeaseTestStore>::new());

    let first = broker.receive().expect("delivery");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&sub.key, &ClaimMeta::new("L-2"))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed
    );
    std::mem::forget(tx);
    drop(first.acker);

    // Keep offering the redelivery, as a broker with a nack delay would.
    let started = tokio::time::Instant::now();
    loop {
        let d = broker.receive().expect("redelivery");
        match gate.process(d).await.kind() {
            OutcomeKind::Deferred => tokio::time::sleep(Duration::from_millis(100)).await,
            OutcomeKind::Processed => break,
            other => panic!("unexpected outcome {other:?}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the lease never expired"
        );
    }
    assert!(
        started.elapsed() >= LEASE - Duration::from_millis(100),
        "the redelivery ran while the crashed worker's lease was live"
    );
    assert!(broker.is_settled());
    let effects = store.effects().await.expect("effects");
    assert_eq!(effects.len(), 1);
}

/// Crashes at every point of the pipeline, redeliveries, several workers: no submission
/// is ever lost, and every one ends committed. Duplicated effects are allowed (at least
/// once) and counted.
async fn crashes_anywhere_never_lose_a_message(kind: ClientKind) {
    quiet_crashes();
    let store =
        lease_store_with(config(kind, "lease-sim").with_lease(Duration::from_secs(2))).await;
    let broker = SimBroker::with_redelivery_rate(11, 0.3);
    let mut ledger = Ledger::new();
    let mut keys = Vec::new();
    for i in 0..40 {
        let body = encode_submission(
            &format!("S-{}", i % 30),
            "2026-07-01T09:00:00Z",
            100 + i64::from(i % 30),
        );
        let sub = EffectHandler::parse(&body).expect("valid");
        ledger.expect(sub.key, sub.subject.clone(), sub.input.amount);
        keys.push(sub.key);
        broker.publish(body);
    }
    let crashes: Vec<(CrashPoint, u64)> = CrashPoint::ALL
        .iter()
        .flat_map(|&p| [(p, 2), (p, 5), (p, 9)])
        .collect();
    let plan = FaultPlan::scripted(crashes, 11);
    let gate = Arc::new(Gate::new(
        FaultyStore::new(store.clone(), plan.clone()),
        FaultyHandler::new(EffectHandlerFor::<LeaseTestStore>::new(), plan.clone()),
    ));
    let config = SimConfig {
        concurrency: 3,
        batch_size: 4,
        max_deliveries: 20_000,
    };
    let report = idem_testkit::sim::drive(gate, &broker, &plan, &config, |_| {})
        .await
        .expect("the run settles");
    assert!(broker.is_settled(), "every delivery must be settled");
    assert!(
        report.total_crashes() >= 6,
        "crashes were injected: {:?}",
        report.crashes
    );
    let effects = store.effects().await.expect("effects");
    for v in ledger.violations(&effects) {
        assert!(
            matches!(v, Violation::Duplicated { .. }),
            "a lease store may duplicate, never lose or invent: {v}"
        );
    }
    for k in &keys {
        assert_eq!(store.store.state(k).await.expect("state"), KeyState::Done);
    }
}

/// A long handler extends its lease: nobody else gets the key meanwhile.
async fn extend_lease_keeps_the_key(kind: ClientKind) {
    let store =
        RedisLeaseStore::connect(config(kind, "extend").with_lease(Duration::from_millis(300)))
            .await
            .expect("connect");
    let k = key("extend");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &ClaimMeta::new("e")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    assert!(tx
        .extend_lease(Duration::from_secs(10))
        .await
        .expect("extend"));
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut other = store.begin().await.expect("begin");
    assert_eq!(
        other.claim(&k, &ClaimMeta::new("e")).await.expect("claim"),
        ClaimOutcome::InProgress,
        "an extended lease expired anyway"
    );
    other.rollback().await.expect("rollback");
    assert_eq!(
        store.state(&k).await.expect("state"),
        KeyState::Leased,
        "a rollback deleted someone else's lease"
    );
    tx.commit().await.expect("commit");
    assert_eq!(store.state(&k).await.expect("state"), KeyState::Done);
}

/// A worker that outlived its lease, while another took the key: its commit is refused
/// (retryable), its rollback leaves the other's lease alone, and extending says `false`.
async fn lost_lease_is_detected(kind: ClientKind) {
    let store =
        RedisLeaseStore::connect(config(kind, "lost").with_lease(Duration::from_millis(200)))
            .await
            .expect("connect");
    let (a, b) = (key("lost-a"), key("lost-b"));
    let mut slow = store.begin().await.expect("begin");
    assert_eq!(
        slow.claim(&a, &ClaimMeta::new("l")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    let mut slow2 = store.begin().await.expect("begin");
    assert_eq!(
        slow2.claim(&b, &ClaimMeta::new("l")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tokio::time::sleep(Duration::from_millis(350)).await;
    let mut fast = store.begin().await.expect("begin");
    let out = fast
        .claim_batch(&[(a, ClaimMeta::new("l")), (b, ClaimMeta::new("l"))])
        .await
        .expect("claim");
    assert_eq!(out, vec![ClaimOutcome::Claimed, ClaimOutcome::Claimed]);

    assert!(!slow
        .extend_lease(Duration::from_secs(5))
        .await
        .expect("extend"));
    let err = slow
        .commit()
        .await
        .expect_err("a lost lease must not commit");
    assert!(
        matches!(err, StoreError::Conflict { .. }) && err.is_retryable(),
        "{err:?}"
    );
    slow2.rollback().await.expect("rollback");
    assert_eq!(store.state(&a).await.expect("state"), KeyState::Leased);
    assert_eq!(
        store.state(&b).await.expect("state"),
        KeyState::Leased,
        "rollback deleted another worker's lease"
    );
    fast.commit().await.expect("commit");
    assert_eq!(store.state(&a).await.expect("state"), KeyState::Done);
    assert_eq!(store.state(&b).await.expect("state"), KeyState::Done);
}

/// A lease that expired with nobody else on the key still commits: the work is done.
async fn expired_but_free_lease_still_commits(kind: ClientKind) {
    let store =
        RedisLeaseStore::connect(config(kind, "expired").with_lease(Duration::from_millis(150)))
            .await
            .expect("connect");
    let k = key("expired");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &ClaimMeta::new("x")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.state(&k).await.expect("state"), KeyState::Free);
    tx.commit().await.expect("commit");
    assert_eq!(store.state(&k).await.expect("state"), KeyState::Done);
}

/// Done-marks live for the retention period, then the key is free again.
async fn done_marks_expire_after_retention(kind: ClientKind) {
    let store = RedisLeaseStore::connect(
        config(kind, "retention").with_retention(Duration::from_millis(300)),
    )
    .await
    .expect("connect");
    let k = key("retention");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &ClaimMeta::new("r")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &ClaimMeta::new("r")).await.expect("claim"),
        ClaimOutcome::Duplicate
    );
    drop(tx);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(store.state(&k).await.expect("state"), KeyState::Free);
}

/// An unreachable server is a retryable `Unavailable`; a bad prefix a `Config` error.
async fn connect_errors_say_what_is_wrong(kind: ClientKind) {
    let down = RedisConfig::new("redis://127.0.0.1:1")
        .with_client(kind)
        .with_timeout(Duration::from_millis(300));
    let err = RedisLeaseStore::connect(down)
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        matches!(err, StoreError::Unavailable { .. }) && err.is_retryable(),
        "{err:?}"
    );
    let bad = config(kind, "bad").with_key_prefix("{tag}");
    let err = RedisLeaseStore::connect(bad)
        .await
        .expect_err("invalid prefix");
    assert!(
        matches!(err, StoreError::Config(_)) && !err.is_retryable(),
        "{err:?}"
    );
}

per_client!(
    crash_after_the_write_redelivery_runs_again,
    crash_before_the_write_is_effectively_once,
    crashes_anywhere_never_lose_a_message,
    extend_lease_keeps_the_key,
    lost_lease_is_detected,
    expired_but_free_lease_still_commits,
    done_marks_expire_after_retention,
    connect_errors_say_what_is_wrong,
);

/// A store and a filter over a client the application built itself (here with a
/// connection timeout of its own): claims and marks work as over a URL; a client whose
/// server does not answer is `Unavailable`, not a configuration error.
async fn built_from_the_application_s_own_client(
    client: impl Fn(&str) -> idem_store_redis::RedisClient,
) {
    use idem_engine::DoneFilter as _;
    let url = common::redis_url();
    // The client given decides; the settings' kind is the build's default.
    let settings = config(ClientKind::default(), "own-client");
    let store = RedisLeaseStore::from_client(client(&url), settings.clone())
        .await
        .expect("a store over the application's client");
    let k = key("own-client-1");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &ClaimMeta::new("own-client-1"))
            .await
            .expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.commit().await.expect("commit");
    assert_eq!(store.state(&k).await.expect("state"), KeyState::Done);

    let filter = idem_store_redis::RedisFilter::from_client(client(&url), settings.clone())
        .await
        .expect("a filter over the application's client");
    filter.mark_done(&[k]).await.expect("mark");
    assert_eq!(filter.seen(&[k]).await.expect("seen"), vec![true]);

    let down = RedisLeaseStore::from_client(client("redis://127.0.0.1:1"), settings).await;
    assert!(
        matches!(down, Err(StoreError::Unavailable { .. })),
        "{down:?}"
    );
}

#[cfg(feature = "redis-rs")]
#[tokio::test]
async fn a_store_and_a_filter_over_the_application_s_redis_rs_client() {
    built_from_the_application_s_own_client(|url| {
        idem_store_redis::RedisClient::RedisRs(
            idem_store_redis::redis::Client::open(url).expect("a redis-rs client"),
        )
    })
    .await;
}

#[cfg(feature = "fred")]
#[tokio::test]
async fn a_store_and_a_filter_over_the_application_s_fred_client() {
    use idem_store_redis::fred::prelude::{Builder, Config};
    built_from_the_application_s_own_client(|url| {
        let client = Builder::from_config(Config::from_url(url).expect("a fred config"))
            .with_connection_config(|c| c.connection_timeout = Duration::from_secs(2))
            .build()
            .expect("a fred client");
        idem_store_redis::RedisClient::Fred(client)
    })
    .await;
}
