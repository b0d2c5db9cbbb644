//! A statement timeout on the real server (SQLSTATE 57014, `statement_timeout` set on the
//! connection): when it recurs on one message while others commit, that message is
//! dead-lettered after `max_attempts` with its reason (it used to be nacked for ever, as
//! if the store were down); when every message times out, the store is what fails, and
//! nothing is dead-lettered. A degraded server (a locked table, a read-only node) charges
//! no message, and a handler's deadline leaves nothing running on the server.

use crate::common;

use idem_engine::{Gate, GateConfig};
use idem_store_postgres::{PgConfig, PgStore};
use idem_testkit::{encode_submission, EffectHandlerFor, SimBroker};

/// The migrated schema of `base`, with a trigger that makes inserting an effect whose
/// subject matches `pattern` sleep for a second, and a store on it whose connections
/// have a 300 ms `statement_timeout`.
async fn slow_store(pattern: &str) -> (PgStore, common::TestPg) {
    let base = common::fresh_pg().await;
    let schema = base.schema().to_owned();
    for sql in [
        format!(
            "CREATE FUNCTION \"{schema}\".slow_effect() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN IF NEW.subject LIKE '{pattern}' THEN PERFORM pg_sleep(1); END IF; \
             RETURN NEW; END $$"
        ),
        format!(
            "CREATE TRIGGER slow BEFORE INSERT ON \"{schema}\".effects \
             FOR EACH ROW EXECUTE FUNCTION \"{schema}\".slow_effect()"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(base.pool())
            .await
            .expect("slow trigger");
    }
    let url = format!("{}?options=-c%20statement_timeout%3D300", common::url());
    let store = PgStore::connect(
        &url,
        PgConfig::new(schema)
            .expect("schema")
            .with_max_connections(4),
    )
    .await
    .expect("connect with a statement timeout");
    (base, common::TestPg(store))
}

/// The test effect handler's gate on `store`, with `max_attempts`.
fn gate(
    store: common::TestPg,
    max_attempts: u32,
) -> Gate<common::TestPg, EffectHandlerFor<common::TestPg>> {
    Gate::with_config(
        store,
        EffectHandlerFor::<common::TestPg>::new(),
        GateConfig::default().with_max_attempts(max_attempts),
    )
}

async fn rounds<S, H>(gate: &Gate<S, H>, broker: &SimBroker, n: usize)
where
    S: idem_engine::ClaimStore,
    H: idem_engine::Handler<S::Tx>,
{
    for _ in 0..n {
        if broker.is_settled() {
            break;
        }
        for d in broker.receive_many(1000) {
            gate.process(d).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_timeout_on_one_message_dead_letters_it_after_max_attempts() {
    let (base, store) = slow_store("SLOW%").await;
    let broker = SimBroker::new(3);
    let ts = "2026-07-01T09:00:00Z";
    broker.publish(encode_submission("SLOW-1", ts, 1));
    for i in 0..6 {
        broker.publish(encode_submission(&format!("OK-{i}"), ts, i));
    }
    let gate = gate(store.clone(), 3);
    rounds(&gate, &broker, 10).await;
    assert!(
        broker.is_settled(),
        "the timed-out message was looped, not settled"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1, "only the slow message is dead-lettered");
    let (msg, reason) = &dead[0];
    assert_eq!(msg.payload, encode_submission("SLOW-1", ts, 1));
    assert_eq!(reason.code, idem_engine::gate::ATTEMPTS_EXHAUSTED);
    assert!(
        reason.detail.contains("3 attempts"),
        "the reason says how many attempts: {reason}"
    );
    use idem_testkit::TestStore as _;
    let effects = store.effects().await.expect("effects");
    assert_eq!(effects.len(), 6, "the others are processed once each");
    assert!(effects.iter().all(|e| e.subject.starts_with("OK-")));
    common::drop_schema(&base).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_timeout_on_every_message_dead_letters_nothing() {
    let (base, store) = slow_store("%").await;
    let broker = SimBroker::new(4);
    let ts = "2026-07-01T09:00:00Z";
    for i in 0..3 {
        broker.publish(encode_submission(&format!("ALL-{i}"), ts, i));
    }
    let gate = gate(store.clone(), 2);
    rounds(&gate, &broker, 5).await;
    assert!(
        broker.dead_letters().is_empty(),
        "a store that fails every message is the store's fault: nothing is dead-lettered"
    );
    assert!(!broker.is_settled(), "nothing was processed");
    // The store recovers (the slow trigger goes): every message is processed once.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP TRIGGER slow ON \"{}\".effects",
        base.schema()
    )))
    .execute(base.pool())
    .await
    .expect("drop trigger");
    rounds(&gate, &broker, 5).await;
    assert!(broker.is_settled());
    use idem_testkit::TestStore as _;
    assert_eq!(store.effects().await.expect("effects").len(), 3);
    assert!(broker.dead_letters().is_empty());
    common::drop_schema(&base).await;
}

/// The message whose write always runs past the statement timeout, delivered after
/// three good ones (one at a time): nothing else commits after its first failure, but the
/// store's probe does, so the failure is this message's alone and it is dead-lettered
/// after its attempts. Before, it was deferred for ever (no commit of another delivery
/// after its first fault, so the gate could not tell it from a store slow for everyone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_always_times_out_after_three_good_ones_is_dead_lettered() {
    let (base, store) = slow_store("SLOW%").await;
    let broker = SimBroker::new(3);
    let ts = "2026-07-01T09:00:00Z";
    for i in 0..3 {
        broker.publish(encode_submission(&format!("OK-{i}"), ts, i));
    }
    broker.publish(encode_submission("SLOW-1", ts, 9));
    let gate = gate(store.clone(), 3);
    rounds(&gate, &broker, 10).await;
    assert!(
        broker.is_settled(),
        "the slow message was deferred for ever"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].0.payload, encode_submission("SLOW-1", ts, 9));
    assert_eq!(dead[0].1.code, idem_engine::gate::ATTEMPTS_EXHAUSTED);
    assert!(
        dead[0].1.detail.contains("SQLSTATE 57014"),
        "the reason names the SQLSTATE: {}",
        dead[0].1.detail
    );
    use idem_testkit::TestStore as _;
    assert_eq!(store.effects().await.expect("effects").len(), 3);
    common::drop_schema(&base).await;
}

/// A handler past its deadline is dropped by the client; the server cancels its
/// statement at the same bound (`PgConfig::statement_timeout`), so the rollback waits for
/// nothing and no statement stays running on the server. Before, a write sleeping 300 s
/// kept running there long after the deadline (sqlx sends no cancel).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_past_its_deadline_leaves_no_statement_running_on_the_server() {
    let base = common::fresh_pg().await;
    let schema = base.schema().to_owned();
    for sql in [
        format!(
            "CREATE FUNCTION \"{schema}\".stuck_effect() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN PERFORM pg_sleep(300); RETURN NEW; END $$"
        ),
        format!(
            "CREATE TRIGGER stuck BEFORE INSERT ON \"{schema}\".effects \
             FOR EACH ROW EXECUTE FUNCTION \"{schema}\".stuck_effect()"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(base.pool())
            .await
            .expect("stuck trigger");
    }
    let limit = std::time::Duration::from_secs(1);
    let store = PgStore::connect(
        &common::url(),
        PgConfig::new(schema.clone())
            .expect("schema")
            .with_max_connections(2)
            .with_statement_timeout(Some(limit)),
    )
    .await
    .expect("connect");
    let gate = Gate::new(
        common::TestPg(store),
        idem_runtime::Deadline::new(EffectHandlerFor::<common::TestPg>::new(), limit),
    );
    let broker = SimBroker::new(1);
    broker.publish(encode_submission("STUCK-1", "2026-07-01T09:00:00Z", 1));
    let started = std::time::Instant::now();
    let outcome = gate.process(broker.receive().expect("delivery")).await;
    let took = started.elapsed();
    assert_eq!(outcome.kind(), idem_engine::OutcomeKind::Failed);
    assert!(
        took < std::time::Duration::from_secs(5),
        "the attempt and its rollback took {took:?}"
    );
    let running: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' \
         AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()",
    )
    .bind(format!("\"{schema}\".\"effects\""))
    .fetch_one(base.pool())
    .await
    .expect("pg_stat_activity");
    assert_eq!(running, 0, "the stuck statement still runs on the server");
    common::drop_schema(&base).await;
}

/// An operator's `LOCK TABLE` on the business table: each write waits out the lock
/// timeout (SQLSTATE 55P03, `StoreError::Degraded`) and is deferred; no message is
/// charged, even with one attempt allowed, and all are processed once the lock goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_business_table_charges_no_message() {
    let base = common::fresh_pg().await;
    let store = PgStore::connect(
        &common::url(),
        PgConfig::new(base.schema())
            .expect("schema")
            .with_max_connections(2)
            .with_lock_timeout(Some(std::time::Duration::from_millis(200))),
    )
    .await
    .expect("connect");
    let store = common::TestPg(store);
    let mut locker = base.pool().begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE \"{}\".effects IN ACCESS EXCLUSIVE MODE",
        base.schema()
    )))
    .execute(&mut *locker)
    .await
    .expect("lock");
    let broker = SimBroker::new(1);
    let ts = "2026-07-01T09:00:00Z";
    for i in 0..3 {
        broker.publish(encode_submission(&format!("L-{i}"), ts, i));
    }
    let gate = gate(store.clone(), 1);
    rounds(&gate, &broker, 3).await;
    assert!(
        broker.dead_letters().is_empty(),
        "{:?}",
        broker.dead_letters()
    );
    assert!(!broker.is_settled());
    locker.rollback().await.expect("unlock");
    rounds(&gate, &broker, 5).await;
    assert!(broker.is_settled());
    assert!(broker.dead_letters().is_empty());
    use idem_testkit::TestStore as _;
    assert_eq!(store.effects().await.expect("effects").len(), 3);
    common::drop_schema(&base).await;
}

/// A read-only node (a failover left the connections on a standby; here every
/// transaction is read-only): each claim is refused with SQLSTATE 25006
/// (`StoreError::Degraded`), the probe cannot commit either, and no message is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_store_charges_no_message() {
    let base = common::fresh_pg().await;
    let url = format!(
        "{}?options=-c%20default_transaction_read_only%3Don",
        common::url()
    );
    let store = PgStore::connect(
        &url,
        PgConfig::new(base.schema())
            .expect("schema")
            .with_max_connections(2),
    )
    .await
    .expect("connect");
    use idem_engine::ClaimStore as _;
    assert!(
        store.probe().await.is_err(),
        "a read-only node commits no transaction id"
    );
    let broker = SimBroker::new(1);
    let ts = "2026-07-01T09:00:00Z";
    broker.publish(encode_submission("RO-1", ts, 1));
    let gate = gate(common::TestPg(store), 1);
    rounds(&gate, &broker, 4).await;
    assert!(
        broker.dead_letters().is_empty(),
        "{:?}",
        broker.dead_letters()
    );
    assert!(!broker.is_settled(), "nothing could be written");
    common::drop_schema(&base).await;
}

/// A handler that ignores the error of its own statement on `PgTx::conn`, or ends the
/// transaction itself: Postgres answers the `COMMIT` of an aborted transaction with the
/// tag `ROLLBACK` and no error, so without a check the gate would ack a message whose
/// claim was never committed.
mod lent {
    use super::common;
    use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, StoreError};

    async fn claimed(store: &idem_store_postgres::PgStore, n: &str) -> idem_store_postgres::PgTx {
        let key = IdempotencyKey::derive(n, "2026-07-01T09:00:00Z", n.as_bytes()).expect("key");
        let mut tx = store.begin().await.expect("begin");
        let meta = ClaimMeta::new(n).with_submission_timestamp("2026-07-01T09:00:00Z");
        assert_eq!(
            tx.claim(&key, &meta).await.expect("claim"),
            ClaimOutcome::Claimed
        );
        tx
    }

    async fn claims(store: &idem_store_postgres::PgStore) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {}",
            store.table("processed_messages")
        )))
        .fetch_one(store.pool())
        .await
        .expect("count")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_commit_after_an_ignored_error_is_an_error_not_a_silent_rollback() {
        let store = common::fresh_pg().await;
        let mut tx = claimed(&store, "IGNORED-1").await;
        // The handler's statement fails, and the handler goes on.
        let failed = sqlx::query("SELECT 1/0").execute(tx.conn()).await;
        assert!(failed.is_err());
        let committed = tx.commit().await;
        assert!(
            matches!(committed, Err(StoreError::Conflict { .. })),
            "COMMIT of an aborted transaction must not report success: {committed:?}"
        );
        assert_eq!(claims(&store).await, 0, "nothing was committed");
        // The connection is usable for the next transaction.
        let tx = claimed(&store, "IGNORED-2").await;
        tx.commit().await.expect("commit");
        assert_eq!(claims(&store).await, 1);
        common::drop_schema(&store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_handler_that_ends_the_transaction_itself_is_a_config_error() {
        let store = common::fresh_pg().await;
        for end in ["ROLLBACK", "COMMIT"] {
            let mut tx = claimed(&store, &format!("ENDED-{end}")).await;
            sqlx::raw_sql(sqlx::AssertSqlSafe(end))
                .execute(tx.conn())
                .await
                .expect("the handler's own end");
            let committed = tx.commit().await;
            assert!(
                matches!(committed, Err(StoreError::Config(_))),
                "{end} sent by the handler must be reported: {committed:?}"
            );
        }
        // Only the claim the handler committed itself is there; the next transaction works.
        assert_eq!(claims(&store).await, 1);
        claimed(&store, "AFTER")
            .await
            .commit()
            .await
            .expect("commit");
        assert_eq!(claims(&store).await, 2);
        common::drop_schema(&store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lent_connection_that_worked_commits() {
        let store = common::fresh_pg().await;
        let mut tx = claimed(&store, "LENT-OK").await;
        sqlx::query("SELECT 1")
            .execute(tx.conn())
            .await
            .expect("select");
        tx.commit().await.expect("commit");
        assert_eq!(claims(&store).await, 1);
        common::drop_schema(&store).await;
    }
}

/// A TCP hop to the test server whose path can go dead: frozen, it forwards nothing in
/// either direction but keeps every connection open (the kernel acknowledges what is
/// sent, so the client sees neither an error nor an answer — a path that drops packets
/// looks the same to the application until the kernel's retransmissions give up).
struct Hop {
    port: u16,
    frozen: tokio::sync::watch::Sender<bool>,
}

impl Hop {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the hop");
        let port = listener.local_addr().expect("hop address").port();
        let server = common::url();
        let server = server
            .split('@')
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap_or("127.0.0.1:5432")
            .to_owned();
        let (frozen, _) = tokio::sync::watch::channel(false);
        let watch = frozen.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(&server).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (ur, uw) = upstream.into_split();
                tokio::spawn(Self::pipe(cr, uw, watch.subscribe()));
                tokio::spawn(Self::pipe(ur, cw, watch.subscribe()));
            }
        });
        Self { port, frozen }
    }

    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut frozen: tokio::sync::watch::Receiver<bool>,
    ) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            if frozen.wait_for(|f| !*f).await.is_err() {
                return;
            }
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            // Read just before the path froze: held until it thaws.
            if frozen.wait_for(|f| !*f).await.is_err() {
                return;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    fn url(&self) -> String {
        let url = common::url();
        let (head, tail) = url.split_once('@').expect("a URL with user@host");
        let db = tail.split_once('/').map_or("test", |(_, db)| db);
        format!("{head}@127.0.0.1:{}/{db}", self.port)
    }

    fn freeze(&self, frozen: bool) {
        self.frozen.send_replace(frozen);
    }
}

/// A network path that goes dead under an open claim transaction: its `COMMIT` gets no
/// answer, and instead of waiting for the kernel's retransmissions to give up (about
/// fifteen minutes), the store answers `Unavailable` once the lock timeout plus
/// `reply_timeout` have passed, closing the connection (nothing is acked: the commit's
/// outcome is unknown). Once the path is back, the key's claim is settled one way or the
/// other on a new connection: claimed again (the server rolled the first transaction back
/// when its connection closed) or a duplicate (the `COMMIT`, held in the path, arrived
/// after all) — never stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_network_path_fails_the_commit_within_the_reply_timeout() {
    use idem_engine::{ClaimMeta, ClaimOutcome, ClaimStore as _, ClaimTx as _, IdempotencyKey};
    use std::time::{Duration, Instant};
    let base = common::fresh_pg().await;
    let hop = Hop::start().await;
    let store = PgStore::connect(
        &hop.url(),
        PgConfig::new(base.schema())
            .expect("schema")
            .with_lock_timeout(Some(Duration::from_millis(500)))
            .with_reply_timeout(Duration::from_millis(1_500))
            .with_max_connections(2),
    )
    .await
    .expect("connect through the hop");
    let key = IdempotencyKey::derive("PATH-1", "2026-07-01T09:00:00Z", b"1").expect("key");
    let meta = ClaimMeta::new("PATH-1");
    let mut tx = store.begin().await.expect("begin");
    assert_eq!(
        tx.claim(&key, &meta).await.expect("claim"),
        ClaimOutcome::Claimed
    );
    hop.freeze(true);
    let started = Instant::now();
    let committed = tokio::time::timeout(Duration::from_secs(20), tx.commit())
        .await
        .expect("the commit on a dead path answers within 20 s");
    let took = started.elapsed();
    let e = committed.expect_err("no answer is no commit");
    assert!(
        e.is_retryable() && matches!(e, idem_engine::StoreError::Unavailable { .. }),
        "{e:?}"
    );
    assert!(
        took >= Duration::from_millis(1_900) && took < Duration::from_secs(10),
        "answered after {took:?} (the bound is 2 s)"
    );
    hop.freeze(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // A connection opened while the path was dead may fail once: the store's to retry.
        let mut tx = match store.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                assert!(e.is_retryable() && Instant::now() < deadline, "{e:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        match tx.claim(&key, &meta).await {
            Ok(ClaimOutcome::Claimed) => {
                tx.commit().await.expect("commit once the path is back");
                break;
            }
            // The COMMIT was on its way when the path died, and arrived once it was back:
            // its outcome was unknown, and the redelivery finds the claim done.
            Ok(ClaimOutcome::Duplicate) => {
                tx.rollback().await.expect("rollback");
                break;
            }
            other => {
                let _ = tx.rollback().await;
                assert!(
                    Instant::now() < deadline,
                    "the key is not claimable again: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}
