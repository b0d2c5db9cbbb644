//! Issue 42, items 1 and 2, through the `idem` binary on real services: an `orders`
//! table, a three-line SQL file and `idem consume --handler sql:orders.sql --identity
//! /order_id`, on RabbitMQ into Postgres and on NATS into SQLite. Every order is applied
//! once (its resend acked as a duplicate), its outbox event carries the row the statement
//! returned, and an order whose amount is not a number is dead-lettered with reason
//! `store_rejected` naming the SQLSTATE (SQLite: the result code). A consumer killed with
//! SIGKILL mid-run and started again leaves each order applied exactly once.
//!
//! RabbitMQ at `IDEM_TEST_AMQP_URL`, NATS at `IDEM_TEST_NATS_URL` (default
//! `nats://127.0.0.1:4222`), Postgres at `IDEM_TEST_POSTGRES_URL`; a missing service
//! fails the test.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idem_broker::any::{pending_count, BrokerUrl};
use idem_engine::IdempotencyKey;

use crate::common;
use common::{amqp_url, idem, ok, pg_url, psql, read_queue, report_value, rt, tag, text};

fn nats_url() -> String {
    std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// The orders of a run: `n` good ones, each published twice (a resend of the same bytes),
/// and one whose amount is not a number, between them.
fn orders(tag: &str, n: usize) -> (Vec<String>, String) {
    let good: Vec<String> = (0..n)
        .map(|i| {
            serde_json::json!({
                "order_id": format!("O-{tag}-{i}"),
                "created_at": "2026-07-01T09:00:00Z",
                "amount": format!("{}.50", i + 1),
            })
            .to_string()
        })
        .collect();
    let bad = serde_json::json!({
        "order_id": format!("O-{tag}-bad"),
        "created_at": "2026-07-01T09:00:00Z",
        "amount": "twelve",
    })
    .to_string();
    (good, bad)
}

/// Writes the bodies, one per line, to a file in `dir`.
fn lines(dir: &std::path::Path, bodies: &[&str]) -> String {
    let file = dir.join("orders.jsonl");
    std::fs::write(&file, bodies.join("\n") + "\n").expect("write");
    file.to_str().expect("utf-8").to_owned()
}

fn publish(broker: &str, queue: &str, file: &str) {
    ok(
        &idem(&[
            "publish",
            "--broker",
            broker,
            "--destination",
            queue,
            "--file",
            file,
        ]),
        "publish",
    );
}

fn left(broker: &str, queue: &str) -> u64 {
    rt().block_on(pending_count(
        &BrokerUrl::parse(broker).expect("url"),
        queue,
    ))
    .expect("count")
}

/// The three-line SQL file of the Postgres runs.
fn pg_sql(dir: &std::path::Path, schema: &str) -> String {
    let file = dir.join("orders.sql");
    std::fs::write(
        &file,
        format!(
            "INSERT INTO \"{schema}\".orders (order_id, amount, idempotency_key)\n\
             VALUES ($1->>'order_id', ($1->>'amount')::numeric, $2)\n\
             RETURNING order_id, amount;\n"
        ),
    )
    .expect("write");
    format!("sql:{}", file.display())
}

fn pg_orders_table(schema: &str) {
    psql(&format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\"; \
         CREATE TABLE \"{schema}\".orders (order_id text PRIMARY KEY, amount numeric NOT NULL, \
         idempotency_key text NOT NULL)"
    ));
}

#[test]
fn orders_from_rabbitmq_into_postgres_take_effect_once_and_a_bad_amount_is_dead_lettered() {
    let tag = tag();
    let (queue, schema) = (format!("idem-sql-{tag}"), format!("sql_{tag}"));
    let (amqp, store) = (amqp_url(), pg_url());
    let dir = tempfile::tempdir().expect("tempdir");
    let (good, bad) = orders(&tag, 20);
    // Each good order twice, the bad one in the middle.
    let mut bodies: Vec<&str> = good.iter().map(String::as_str).collect();
    bodies.insert(10, &bad);
    bodies.extend(good.iter().map(String::as_str));
    let file = lines(dir.path(), &bodies);
    ok(
        &idem(&["migrate", "--store", &store, "--schema", &schema]),
        "migrate",
    );
    pg_orders_table(&schema);
    let handler = pg_sql(dir.path(), &schema);
    publish(&amqp, &queue, &file);

    let out = idem(&[
        "consume",
        "--broker",
        &amqp,
        "--source",
        &queue,
        "--store",
        &store,
        "--schema",
        &schema,
        "--handler",
        &handler,
        "--identity",
        "/order_id",
        "--event-type",
        "order.recorded",
        "--exit-when-idle",
        "3",
    ]);
    let stdout = ok(&out, "consume");
    assert_eq!(report_value(&stdout, "processed"), 20, "{stdout}");
    assert_eq!(report_value(&stdout, "duplicates"), 20, "{stdout}");
    assert_eq!(report_value(&stdout, "rejected"), 1, "{stdout}");
    assert_eq!(left(&amqp, &queue), 0, "every delivery settled");

    // Each order once, with the key `--identity /order_id` derives from its bytes.
    let rows = psql(&format!(
        "SELECT order_id || ' ' || amount || ' ' || idempotency_key FROM \"{schema}\".orders \
         ORDER BY order_id"
    ));
    let mut want: Vec<String> = good
        .iter()
        .map(|b| {
            let v: serde_json::Value = serde_json::from_str(b).expect("json");
            let id = v["order_id"].as_str().expect("id");
            let key = IdempotencyKey::derive(id, "-", b.as_bytes()).expect("key");
            format!("{id} {} {key}", v["amount"].as_str().expect("amount"))
        })
        .collect();
    want.sort();
    assert_eq!(rows.lines().collect::<Vec<_>>(), want);
    // The claims carry the subject; the events the returned row.
    assert_eq!(
        psql(&format!(
            "SELECT count(*) FROM \"{schema}\".processed_messages WHERE award_id LIKE 'O-{tag}-%'"
        )),
        "20"
    );
    let event = psql(&format!(
        "SELECT payload::text FROM \"{schema}\".outbox WHERE event_type = 'order.recorded' \
         AND subject = 'O-{tag}-3'"
    ));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&event).expect("json"),
        serde_json::json!({"order_id": format!("O-{tag}-3"), "amount": 4.50})
    );
    assert_eq!(
        psql(&format!(
            "SELECT count(*) FROM \"{schema}\".outbox WHERE event_type = 'order.recorded'"
        )),
        "20"
    );

    // The bad amount: dead-lettered with the SQLSTATE of the failed cast, nothing written.
    let dead = read_queue(&amqp, &format!("{queue}.dead-letter"));
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, bad.as_bytes());
    assert!(
        dead[0].1.starts_with("store_rejected") && dead[0].1.contains("SQLSTATE 22P02"),
        "{}",
        dead[0].1
    );
    // `idem inspect --subject` finds an order's claim (and `--award-id` still works).
    for flag in ["--subject", "--award-id"] {
        let out = idem(&[
            "inspect",
            "--store",
            &store,
            "--schema",
            &schema,
            flag,
            &format!("O-{tag}-3"),
        ]);
        let shown = ok(&out, "inspect");
        assert!(shown.contains("order.recorded"), "{shown}");
    }
    psql(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"));
}

#[test]
fn orders_from_nats_into_sqlite_take_effect_once_and_a_bad_amount_is_dead_lettered() {
    let tag = tag();
    let subject = format!("idem-sql-{tag}");
    let nats = nats_url();
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("orders.db");
    let store = format!("sqlite://{}", db.display());
    let (good, bad) = orders(&tag, 20);
    let mut bodies: Vec<&str> = good.iter().map(String::as_str).collect();
    bodies.insert(5, &bad);
    bodies.extend(good.iter().rev().map(String::as_str));
    let file = lines(dir.path(), &bodies);
    ok(&idem(&["migrate", "--store", &store]), "migrate");
    rt().block_on(async {
        use sqlx::Connection as _;
        let mut conn = sqlx::SqliteConnection::connect(&store).await.expect("open");
        // STRICT: a value that is not a number is refused, not stored as text.
        sqlx::query(
            "CREATE TABLE orders (order_id TEXT PRIMARY KEY, amount REAL NOT NULL, \
             idempotency_key TEXT NOT NULL) STRICT",
        )
        .execute(&mut conn)
        .await
        .expect("create orders");
    });
    let sql = dir.path().join("orders.sql");
    std::fs::write(
        &sql,
        "INSERT INTO orders (order_id, amount, idempotency_key)\n\
         VALUES (json_extract($1, '$.order_id'), json_extract($1, '$.amount'), $2)\n\
         RETURNING order_id, amount;\n",
    )
    .expect("write");
    publish(&nats, &subject, &file);

    let out = idem(&[
        "consume",
        "--broker",
        &nats,
        "--source",
        &subject,
        "--store",
        &store,
        "--handler",
        &format!("sql:{}", sql.display()),
        "--identity",
        "/order_id,/created_at",
        "--event-type",
        "order.recorded",
        "--exit-when-idle",
        "3",
    ]);
    let stdout = ok(&out, "consume");
    assert_eq!(report_value(&stdout, "processed"), 20, "{stdout}");
    assert_eq!(report_value(&stdout, "duplicates"), 20, "{stdout}");
    assert_eq!(report_value(&stdout, "rejected"), 1, "{stdout}");
    assert_eq!(left(&nats, &subject), 0, "every delivery settled");

    type Orders = Vec<(String, f64, String)>;
    let (rows, events): (Orders, Vec<(String, String)>) = rt().block_on(async {
        use sqlx::Connection as _;
        let mut conn = sqlx::SqliteConnection::connect(&store).await.expect("open");
        let rows = sqlx::query_as("SELECT order_id, amount, idempotency_key FROM orders")
            .fetch_all(&mut conn)
            .await
            .expect("orders");
        let events = sqlx::query_as(
            "SELECT subject, payload FROM outbox WHERE event_type = 'order.recorded'",
        )
        .fetch_all(&mut conn)
        .await
        .expect("outbox");
        (rows, events)
    });
    assert_eq!(rows.len(), 20, "{rows:?}");
    for (id, amount, key) in &rows {
        let body = good
            .iter()
            .find(|b| b.contains(&format!("\"{id}\"")))
            .expect("a published order");
        let i: f64 = id.rsplit('-').next().expect("n").parse().expect("n");
        assert!((amount - (i + 1.5)).abs() < 1e-9, "{id}: {amount}");
        // Two pointers: the reference derivation of (order_id, created_at, body).
        let want =
            IdempotencyKey::derive(id, "2026-07-01T09:00:00Z", body.as_bytes()).expect("key");
        assert_eq!(key, &want.to_hex());
    }
    assert_eq!(events.len(), 20);
    let (subject3, payload3) = events
        .iter()
        .find(|(s, _)| s == &format!("O-{tag}-3"))
        .expect("the event of order 3");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(payload3).expect("json"),
        serde_json::json!({"order_id": subject3, "amount": 4.5})
    );

    let dead = read_queue(&nats, &format!("{subject}.dead-letter"));
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, bad.as_bytes());
    assert!(
        dead[0].1.starts_with("store_rejected") && dead[0].1.contains("SQLite result code 3091"),
        "{}",
        dead[0].1
    );
}

/// A consumer killed with SIGKILL in the middle of a run, and started again: each order
/// applied exactly once, its resends duplicates.
#[test]
fn a_sql_consumer_killed_mid_run_and_restarted_applies_each_order_once() {
    let tag = tag();
    let (queue, schema) = (format!("idem-sql-kill-{tag}"), format!("sqlkill_{tag}"));
    let (amqp, store) = (amqp_url(), pg_url());
    let dir = tempfile::tempdir().expect("tempdir");
    let n = 3000;
    let (good, _) = orders(&tag, n);
    let mut bodies: Vec<&str> = good.iter().map(String::as_str).collect();
    bodies.extend(good.iter().step_by(3).map(String::as_str));
    let file = lines(dir.path(), &bodies);
    ok(
        &idem(&["migrate", "--store", &store, "--schema", &schema]),
        "migrate",
    );
    pg_orders_table(&schema);
    let handler = pg_sql(dir.path(), &schema);
    publish(&amqp, &queue, &file);

    let args = [
        "consume",
        "--broker",
        &amqp,
        "--source",
        &queue,
        "--store",
        &store,
        "--schema",
        &schema,
        "--handler",
        &handler,
        "--identity",
        "/order_id",
        "--batch-size",
        "1",
        "--concurrency",
        "1",
    ];
    let count = || -> usize {
        psql(&format!("SELECT count(*) FROM \"{schema}\".orders"))
            .parse()
            .expect("count")
    };
    let mut first = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the first consumer");
    let deadline = Instant::now() + Duration::from_secs(60);
    while count() < 200 {
        assert!(
            Instant::now() < deadline,
            "the first consumer applied nothing"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    first.kill().expect("SIGKILL");
    let _ = first.wait();
    let at_kill = count();
    assert!(at_kill < n, "killed mid-run: {at_kill} of {n} applied");

    let out = idem(&[&args[..], &["--exit-when-idle", "3"]].concat());
    let stdout = ok(&out, "the restarted consumer");
    assert_eq!(count(), n, "{stdout}");
    assert_eq!(
        psql(&format!(
            "SELECT count(DISTINCT idempotency_key) FROM \"{schema}\".orders"
        )),
        n.to_string()
    );
    // The restarted one did what the killed one had not committed, no more: what it had
    // committed but not acked came back as duplicates.
    assert_eq!(
        report_value(&stdout, "processed") as usize,
        n - at_kill,
        "{stdout}"
    );
    assert_eq!(report_value(&stdout, "rejected"), 0, "{stdout}");
    assert_eq!(left(&amqp, &queue), 0);
    psql(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"));
}

/// A statement that waits on a row another transaction holds, past the lock timeout, is
/// the store's: deferred and retried once the lock is gone, never dead-lettered.
#[test]
fn a_sql_statement_waiting_on_a_lock_is_deferred_not_dead_lettered() {
    let tag = tag();
    let (queue, schema) = (format!("idem-sql-lock-{tag}"), format!("sqllock_{tag}"));
    let (amqp, store) = (amqp_url(), pg_url());
    let dir = tempfile::tempdir().expect("tempdir");
    let (good, _) = orders(&tag, 5);
    let bodies: Vec<&str> = good.iter().map(String::as_str).collect();
    let file = lines(dir.path(), &bodies);
    ok(
        &idem(&["migrate", "--store", &store, "--schema", &schema]),
        "migrate",
    );
    pg_orders_table(&schema);
    let handler = pg_sql(dir.path(), &schema);
    publish(&amqp, &queue, &file);
    // Another transaction inserts order 0's row and holds it for 9 s: the consumer's
    // insert of order 0 waits on it (lock_timeout, SQLSTATE 55P03).
    let marker = format!("pg_sleep(9) /* {tag} */");
    let mut holder = Command::new("psql")
        .args([
            &store,
            "-qAt",
            "-c",
            &format!(
                "BEGIN; INSERT INTO \"{schema}\".orders VALUES ('O-{tag}-0', 1, 'held'); \
                 SELECT {marker}; ROLLBACK;"
            ),
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("psql");
    let deadline = Instant::now() + Duration::from_secs(30);
    while psql(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() \
         AND state = 'active' AND query LIKE '%{tag} */%'"
    )) != "1"
    {
        assert!(Instant::now() < deadline, "the holder never held its row");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = idem(&[
        "consume",
        "--broker",
        &amqp,
        "--source",
        &queue,
        "--store",
        &store,
        "--schema",
        &schema,
        "--handler",
        &handler,
        "--identity",
        "/order_id",
        "--exit-when-idle",
        "3",
    ]);
    let _ = holder.wait();
    let stdout = ok(&out, "consume");
    assert_eq!(report_value(&stdout, "processed"), 5, "{stdout}");
    assert_eq!(report_value(&stdout, "rejected"), 0, "{stdout}");
    assert!(
        report_value(&stdout, "deferred") + report_value(&stdout, "failed") >= 1,
        "order 0 waited: {stdout}"
    );
    assert_eq!(
        psql(&format!(
            "SELECT count(*) FROM \"{schema}\".orders WHERE idempotency_key <> 'held'"
        )),
        "5"
    );
    psql(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"));
}

/// Mistakes are usage errors (exit 2) before any message is taken: a statement the
/// server cannot parse, a missing --identity, --handler sql: on memory://, --identity with
/// the grant handler, a last statement that returns no row with --event-type.
#[test]
fn sql_handler_mistakes_are_usage_errors_before_any_delivery() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = format!("sqlite://{}", dir.path().join("db.sqlite").display());
    let nats = nats_url();
    let queue = format!("idem-sql-usage-{}", tag());
    let sql = |name: &str, text: &str| {
        let f = dir.path().join(name);
        std::fs::write(&f, text).expect("write");
        format!("sql:{}", f.display())
    };
    ok(&idem(&["migrate", "--store", &store]), "migrate");
    let typo = sql("typo.sql", "INSERT INTO processed_messages VALUES ($2,;\n");
    let no_row = sql(
        "norow.sql",
        "UPDATE processed_messages SET award_id = award_id WHERE idempotency_key = $2",
    );
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--store", &store, "--handler", &typo, "--identity", "/id"],
            "statement 1 of",
        ),
        (vec!["--store", &store, "--handler", &typo], "--identity"),
        (
            vec![
                "--store",
                "memory://",
                "--handler",
                &typo,
                "--identity",
                "/id",
            ],
            "memory://",
        ),
        (
            vec!["--store", &store, "--identity", "/id"],
            "--handler sql",
        ),
        (
            vec![
                "--store",
                &store,
                "--handler",
                &no_row,
                "--identity",
                "/id",
                "--event-type",
                "e",
            ],
            "returns no row",
        ),
    ];
    for (extra, says) in cases {
        let args = [
            &["consume", "--broker", &nats, "--source", &queue][..],
            &extra[..],
        ]
        .concat();
        let out = idem(&args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(says),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}
