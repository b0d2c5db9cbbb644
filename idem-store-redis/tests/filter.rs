//! The front filter in front of a durable store (the in-memory reference store): the
//! mark is written only after the durable commit, so it never loses a message — under
//! crashes at every point, and through a Redis outage — while the naive
//! mark-before-commit filter does lose one. Its marks are scoped: filters on different
//! stores never see each other's marks, and a store whose identity went back in time (a
//! restore) or was copied gets a new identity. (The same on real Postgres and SQLite
//! stores, through the `idem` binary: `idem-cli/tests/cli/filter_scoping.rs`.)

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{config, key, quiet_crashes, FilteredMem, NaiveFiltered};
use idem_engine::{async_trait, StoreError};
use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, DoneFilter, Gate, OutcomeKind};
use idem_store_redis::{
    ClientKind, IdentitySession, RedisConfig, RedisFilter, StoreIdentitySource,
};
use idem_testkit::sim::{check_exactly_once, Case};
use idem_testkit::{encode_submission, CrashPoint, EffectHandlerFor, MemoryStore, SimBroker};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;

async fn filter(kind: ClientKind, tag: &str) -> RedisFilter {
    let config = config(kind, tag);
    RedisFilter::connect(config.clone())
        .await
        .unwrap_or_else(|e| panic!("Redis at {} must be running: {e}", config.url))
}

/// `seen` answers true only for marked keys, for a whole slice in one call.
async fn seen_only_after_mark(kind: ClientKind) {
    let f = filter(kind, "seen").await;
    let keys: Vec<_> = (0..100).map(|i| key(&format!("seen-{i}"))).collect();
    assert_eq!(f.seen(&keys).await.expect("seen"), vec![false; 100]);
    let marked: Vec<_> = keys.iter().step_by(3).copied().collect();
    f.mark_done(&marked).await.expect("mark");
    let seen = f.seen(&keys).await.expect("seen");
    for (i, s) in seen.iter().enumerate() {
        assert_eq!(*s, i % 3 == 0, "key {i}");
    }
    assert_eq!(f.seen(&[]).await.expect("seen"), Vec::<bool>::new());
}

/// Through the gate: the replay of a committed submission is answered by the filter;
/// a rolled-back claim leaves no mark.
async fn hits_only_after_the_durable_commit(kind: ClientKind) {
    let store = FilteredMem::new(filter(kind, "hits").await);
    let gate = Gate::new(store.clone(), EffectHandlerFor::<FilteredMem>::new());
    let broker = SimBroker::new(5);
    let body = encode_submission("F-1", "2026-07-01T09:00:00Z", 42);
    broker.publish(body.clone());
    broker.publish(body);
    let first = gate.process(broker.receive().expect("d")).await.kind();
    let second = gate.process(broker.receive().expect("d")).await.kind();
    assert_eq!(
        (first, second),
        (OutcomeKind::Processed, OutcomeKind::Duplicate)
    );
    assert_eq!(
        store.0.stats().hits(),
        1,
        "the replay must be answered by Redis"
    );

    let k = key("rolled-back");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&k, &ClaimMeta::new("r")).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(
        store.0.filter().seen(&[k]).await.expect("seen"),
        vec![false]
    );
}

fn crash_case(seed: u64) -> Case {
    Case {
        submissions: (0..12)
            .map(|i| {
                (
                    format!("A-{i}"),
                    "2026-07-01T09:00:00Z".to_owned(),
                    1000 + i,
                )
            })
            .collect(),
        poison: 1,
        redelivery_rate: 0.5,
        crashes: CrashPoint::ALL
            .iter()
            .flat_map(|&p| [(p, 1), (p, 4)])
            .collect(),
        errors: Vec::new(),
        expiry_rate: 0.0,
        concurrency: 3,
        batch_size: 3,
        seed,
    }
}

/// The exactly-once property with crashes everywhere, on generated schedules.
async fn exactly_once_under_crashes(kind: ClientKind) {
    quiet_crashes();
    let mut runner = TestRunner::deterministic();
    let strategy = idem_testkit::strategies::case();
    let mut cases: Vec<Case> = (0..24)
        .map(|_| strategy.new_tree(&mut runner).expect("case").current())
        .collect();
    cases.push(crash_case(1));
    let mut hits = 0;
    for case in &cases {
        let store = FilteredMem::new(filter(kind, "prop").await);
        if let Err(e) = check_exactly_once(store.clone(), case).await {
            panic!("{e}\nin case {case:?}");
        }
        hits += store.0.stats().hits();
    }
    assert!(
        hits > 0,
        "the filter answered no duplicate in {} schedules",
        cases.len()
    );
}

/// Redis unreachable (a port where nothing listens): every lookup errors and falls
/// through; the durable store alone keeps it exactly once.
async fn redis_outage_falls_through(kind: ClientKind) {
    quiet_crashes();
    let down = RedisConfig::new("redis://127.0.0.1:1")
        .with_client(kind)
        .with_timeout(Duration::from_millis(100));
    let f = RedisFilter::connect_lazy(down)
        .await
        .expect("a lazy filter needs no server");
    assert!(f.seen(&[key("x")]).await.is_err());
    let store = FilteredMem::new(f);
    check_exactly_once(store.clone(), &crash_case(2))
        .await
        .expect("exactly once through the durable store");
    assert_eq!(store.0.stats().hits(), 0);
    assert!(store.0.stats().errors() > 0, "the outage was not noticed");
}

/// The issue's key test: a crash after the claim. The naive filter (mark at claim time)
/// skips the redelivery and loses the message; ours does not.
async fn naive_filter_loses_a_message_ours_does_not(kind: ClientKind) {
    quiet_crashes();
    let case = Case {
        submissions: (0..5)
            .map(|i| (format!("N-{i}"), "2026-07-01T09:00:00Z".to_owned(), 10 + i))
            .collect(),
        poison: 0,
        redelivery_rate: 0.0,
        crashes: vec![(CrashPoint::AfterClaim, 1)],
        errors: Vec::new(),
        expiry_rate: 0.0,
        concurrency: 1,
        batch_size: 1,
        seed: 3,
    };
    let naive = NaiveFiltered {
        store: MemoryStore::new(),
        filter: filter(kind, "naive").await,
    };
    let err = check_exactly_once(naive, &case)
        .await
        .expect_err("the naive filter must lose the crashed message");
    assert!(err.contains("lost"), "expected a lost message, got: {err}");

    let ours = FilteredMem::new(filter(kind, "ours").await);
    let report = check_exactly_once(ours, &case)
        .await
        .expect("ours is exactly once");
    assert_eq!(
        report.total_crashes(),
        1,
        "the crash after the claim must have happened"
    );
}

/// A durable store's identity row, in memory, that can be snapshotted and restored like
/// a database (the real ones are `idem_store_identity` in Postgres and SQLite; the
/// binary's tests restore those from real dumps). Sessions hold the row's lock.
#[derive(Clone)]
struct Row {
    row: Arc<tokio::sync::Mutex<(String, i64)>>,
    fail: Arc<Mutex<bool>>,
}

impl Row {
    fn new() -> Self {
        Self {
            row: Arc::new(tokio::sync::Mutex::new((random_id(), 0))),
            fail: Arc::new(Mutex::new(false)),
        }
    }
    async fn snapshot(&self) -> (String, i64) {
        self.row.lock().await.clone()
    }
    async fn restore(&self, snap: (String, i64)) {
        *self.row.lock().await = snap;
    }
    fn set_failing(&self, fail: bool) {
        *self.fail.lock().expect("lock") = fail;
    }
}

fn random_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

struct RowSession {
    guard: tokio::sync::OwnedMutexGuard<(String, i64)>,
    pending: (String, i64),
}

#[async_trait]
impl StoreIdentitySource for Row {
    async fn begin_session(&self) -> Result<Box<dyn IdentitySession>, StoreError> {
        if *self.fail.lock().expect("lock") {
            return Err(StoreError::unavailable(
                "store down",
                std::io::Error::other("down"),
            ));
        }
        let guard = self.row.clone().lock_owned().await;
        let pending = (guard.0.clone(), guard.1 + 1);
        Ok(Box::new(RowSession { guard, pending }))
    }
}

#[async_trait]
impl IdentitySession for RowSession {
    fn store_id(&self) -> &str {
        &self.pending.0
    }
    fn session(&self) -> i64 {
        self.pending.1
    }
    async fn rotate(&mut self) -> Result<(), StoreError> {
        self.pending = (random_id(), 1);
        Ok(())
    }
    async fn commit(mut self: Box<Self>) -> Result<(), StoreError> {
        *self.guard = self.pending.clone();
        Ok(())
    }
}

async fn for_store(kind: ClientKind, prefix: &RedisConfig, row: &Row) -> RedisFilter {
    RedisFilter::connect_for_store(
        prefix
            .clone()
            .with_client(kind)
            .with_identity_heartbeat(Duration::from_millis(200)),
        Arc::new(row.clone()),
    )
    .await
    .expect("connect for store")
}

/// Three stores behind one Redis (one key prefix): each sees only its own marks; two
/// processes on one store share theirs.
async fn stores_sharing_one_redis_never_see_each_others_marks(kind: ClientKind) {
    let shared = config(kind, "shared");
    let (a, b, c) = (Row::new(), Row::new(), Row::new());
    let fa = for_store(kind, &shared, &a).await;
    let fb = for_store(kind, &shared, &b).await;
    let fc = for_store(kind, &shared, &c).await;
    let k = key("same-submission");
    fa.mark_done(&[k]).await.expect("mark");
    assert_eq!(fa.seen(&[k]).await.expect("seen"), vec![true]);
    assert_eq!(
        fb.seen(&[k]).await.expect("seen"),
        vec![false],
        "store B saw A's mark"
    );
    assert_eq!(
        fc.seen(&[k]).await.expect("seen"),
        vec![false],
        "store C saw A's mark"
    );
    let fa2 = for_store(kind, &shared, &a).await;
    assert_eq!(fa2.scope(), fa.scope(), "one store, one scope");
    assert_eq!(
        fa2.seen(&[k]).await.expect("seen"),
        vec![true],
        "same store, new process"
    );
    assert_eq!(fa2.rotations(), 0);
    // Filters without a store identity: private to each filter.
    let p1 = RedisFilter::connect(shared.clone()).await.expect("connect");
    let p2 = RedisFilter::connect(shared.clone()).await.expect("connect");
    p1.mark_done(&[k]).await.expect("mark");
    assert_eq!(p1.seen(&[k]).await.expect("seen"), vec![true]);
    assert_eq!(p2.seen(&[k]).await.expect("seen"), vec![false]);
    assert_eq!(fb.seen(&[k]).await.expect("seen"), vec![false]);
}

/// A store restored to a backup taken before a later session: its next start registers
/// a session number Redis has already seen, so the identity is rotated and no mark
/// written before applies — not those after the backup, and (conservatively) not those
/// before it either.
async fn a_store_restored_from_a_backup_gets_a_new_identity(kind: ClientKind) {
    let shared = config(kind, "restore");
    let row = Row::new();
    let before = key("before-the-backup");
    let after = key("after-the-backup");
    let f1 = for_store(kind, &shared, &row).await;
    f1.mark_done(&[before]).await.expect("mark");
    drop(f1);
    let backup = row.snapshot().await;
    let f2 = for_store(kind, &shared, &row).await; // a later start: session 2
    f2.mark_done(&[after]).await.expect("mark");
    let old_scope = f2.scope();
    drop(f2);
    row.restore(backup).await;

    let f3 = for_store(kind, &shared, &row).await;
    assert_eq!(f3.rotations(), 1, "the restore was not noticed");
    assert_ne!(f3.scope(), old_scope);
    assert_eq!(
        row.snapshot().await.1,
        1,
        "a new identity starts at session 1"
    );
    assert_eq!(
        f3.seen(&[before, after]).await.expect("seen"),
        vec![false, false],
        "a mark written for the store before its restore still applies"
    );
    // The new identity is stable: the next start is not a rotation.
    let f4 = for_store(kind, &shared, &row).await;
    assert_eq!((f4.rotations(), f4.scope()), (0, f3.scope()));
}

/// A running consumer whose store is restored under it: its heartbeat registers a
/// session Redis has seen, rotates the identity and stops trusting the old marks.
async fn a_restore_under_a_running_filter_is_caught_at_its_heartbeat(kind: ClientKind) {
    let shared = config(kind, "running");
    let row = Row::new();
    let f = for_store(kind, &shared, &row).await;
    let backup = row.snapshot().await;
    // Let a heartbeat register a session after the backup.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let k = key("committed-after-the-backup");
    f.mark_done(&[k]).await.expect("mark");
    let old = f.scope();
    row.restore(backup).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while f.rotations() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no rotation after the restore"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_ne!(f.scope(), old);
    assert_eq!(f.seen(&[k]).await.expect("seen"), vec![false]);
}

/// A copy of a store (an SQLite file copy, a database clone) started beside the
/// original: the second of the two to register a session is rotated, so they stop
/// sharing one identity.
async fn a_copy_of_a_store_is_given_its_own_identity(kind: ClientKind) {
    let shared = config(kind, "copy");
    let original = Row::new();
    let f = for_store(kind, &shared, &original).await;
    let copy = Row::new();
    copy.restore(original.snapshot().await).await;
    let fc = for_store(kind, &shared, &copy).await;
    // The copy's first session is above what Redis saw; the original's next heartbeat
    // then is not, and the original rotates (within one heartbeat).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while f.rotations() + fc.rotations() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the copy was never noticed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_ne!(
        fc.scope(),
        f.scope(),
        "the original and its copy share marks"
    );
    assert_ne!(original.snapshot().await.0, copy.snapshot().await.0);
}

/// Until a session is registered — the store is down at start, or a heartbeat failed —
/// the filter answers nothing and writes nothing: every claim goes to the durable store.
async fn without_a_registered_session_the_filter_answers_nothing(kind: ClientKind) {
    let shared = config(kind, "unverified");
    let row = Row::new();
    row.set_failing(true);
    let f = for_store(kind, &shared, &row).await;
    assert_eq!(f.scope(), None);
    assert!(f.seen(&[key("x")]).await.is_err());
    assert!(f.mark_done(&[key("x")]).await.is_err());
    row.set_failing(false);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while f.scope().is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the heartbeat never registered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f.mark_done(&[key("x")]).await.expect("mark");
    // A failed heartbeat turns it off again.
    row.set_failing(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while f.scope().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a failed heartbeat left it on"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(f.seen(&[key("x")]).await.is_err());
}

per_client!(
    stores_sharing_one_redis_never_see_each_others_marks,
    a_store_restored_from_a_backup_gets_a_new_identity,
    a_restore_under_a_running_filter_is_caught_at_its_heartbeat,
    a_copy_of_a_store_is_given_its_own_identity,
    without_a_registered_session_the_filter_answers_nothing,
    seen_only_after_mark,
    hits_only_after_the_durable_commit,
    exactly_once_under_crashes,
    redis_outage_falls_through,
    naive_filter_loses_a_message_ours_does_not,
);
