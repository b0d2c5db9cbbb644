//! The front filter can never make a store skip work it did not commit, on real
//! services through the `idem` binary: issue 12's reproduction (the demo run twice on
//! fresh SQLite stores behind one Redis), three stores behind one Redis at once, and
//! stores restored from earlier dumps (a Postgres schema through pg_dump/psql, an SQLite
//! file copy) that re-process what the dump lacks — automatically, and with the
//! runbook's `idem migrate --rotate-store-identity`. Postgres at `IDEM_TEST_POSTGRES_URL`,
//! Redis at `IDEM_TEST_REDIS_URL`; a missing service fails the test.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use crate::common;

fn idem<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    common::idem(args)
}

fn spawn<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idem")
}

fn pg_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn tag() -> String {
    format!("{}_{:08x}", std::process::id(), rand::random::<u32>())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn value(stdout: &str, name: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .unwrap_or_else(|| panic!("no `{name}:` line in\n{stdout}"))
        .trim()
        .to_owned()
}

/// A demo run that must end `exactly-once: OK`; its stdout and stderr.
fn assert_exact(out: &Output, what: &str) -> (String, String) {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success() && stdout.lines().last() == Some("exactly-once: OK"),
        "{what}: exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status.code()
    );
    let ledger: u64 = value(&stdout, "expected_total_cents")
        .parse()
        .expect("number");
    assert_eq!(
        value(&stdout, "ledger_total_cents"),
        ledger.to_string(),
        "{what}: the ledger"
    );
    (stdout, stderr)
}

fn demo(store: &[&str], seed: u64, n: u64) -> Vec<String> {
    let mut args: Vec<String> = vec!["demo".into()];
    args.extend(store.iter().map(|s| (*s).to_owned()));
    args.extend(
        [
            "--submissions",
            &n.to_string(),
            "--seed",
            &seed.to_string(),
            "--front-filter",
            &redis_url(),
        ]
        .map(str::to_owned),
    );
    args
}

/// Runs SQL with psql on the test database.
fn psql(sql: &str) -> String {
    let out = Command::new("psql")
        .args([&pg_url(), "-v", "ON_ERROR_STOP=1", "-qAtc", sql])
        .output()
        .expect("run psql (the PostgreSQL client must be installed)");
    assert!(out.status.success(), "psql {sql}: {}", text(&out.stderr));
    text(&out.stdout).trim().to_owned()
}

fn pg_identity(schema: &str) -> String {
    psql(&format!(
        "SELECT store_id FROM \"{schema}\".idem_store_identity"
    ))
}

/// The identity row of the SQLite file at `path`, read through the driver, read-only (no
/// `sqlite3` program needed: a fresh machine has none).
fn sqlite_identity(path: &Path) -> String {
    use sqlx::ConnectOptions as _;
    common::rt().block_on(async {
        let mut conn = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(path)
            .read_only(true)
            .connect()
            .await
            .expect("open the SQLite file");
        sqlx::query_scalar::<_, String>("SELECT store_id FROM idem_store_identity")
            .fetch_one(&mut conn)
            .await
            .expect("read the store identity")
    })
}

fn drop_schema(schema: &str) {
    psql(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"));
}

/// Issue 12's first reproduction, as a user runs it: the demo twice, each on a fresh
/// SQLite store, behind one Redis. The second run used to find every key marked by the
/// first store and ack all 2,000 with no effect.
#[test]
fn the_demo_twice_on_fresh_stores_behind_one_redis_is_exact_both_times() {
    let args = [
        "demo",
        "--submissions",
        "2000",
        "--seed",
        "7",
        "--front-filter",
        &redis_url(),
    ];
    let mut stores = Vec::new();
    for run in 1..=2 {
        let out = idem(&args);
        let (stdout, _) = assert_exact(&out, &format!("run {run}"));
        assert_eq!(
            value(&stdout, "disbursements"),
            "2000",
            "run {run}:\n{stdout}"
        );
        stores.push(value(&stdout, "store"));
    }
    assert_ne!(stores[0], stores[1], "each run has a fresh store");
    for s in stores {
        if let Some(path) = s.strip_prefix("sqlite://") {
            if let Some(dir) = Path::new(path).parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}

/// Two Postgres schemas and an SQLite file, one Redis, the same submissions, at once:
/// each store processes every one of them itself.
#[test]
fn three_stores_behind_one_redis_each_stay_exact() {
    let t = tag();
    let (a, b) = (format!("scope_a_{t}"), format!("scope_b_{t}"));
    let dir = tempfile::tempdir().expect("tempdir");
    let file = format!("sqlite://{}", dir.path().join("c.db").display());
    let pg = pg_url();
    let runs: Vec<(String, Child)> = [
        vec!["--store", pg.as_str(), "--schema", a.as_str()],
        vec!["--store", pg.as_str(), "--schema", b.as_str()],
        vec!["--store", file.as_str()],
    ]
    .into_iter()
    .map(|store| (store.join(" "), spawn(&demo(&store, 7, 600))))
    .collect();
    for (what, child) in runs {
        let out = child.wait_with_output().expect("wait");
        let (stdout, _) = assert_exact(&out, &what);
        assert_eq!(value(&stdout, "disbursements"), "600", "{what}:\n{stdout}");
    }
    let ids = [
        pg_identity(&a),
        pg_identity(&b),
        sqlite_identity(&dir.path().join("c.db")),
    ];
    assert!(
        ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2],
        "{ids:?}"
    );
    drop_schema(&a);
    drop_schema(&b);
}

/// A schema restored (pg_dump, then psql) to a dump taken before the second batch: the
/// next start notices the store went back in time, rotates its identity, and the second
/// batch — marked done in Redis for the lost timeline — is processed again.
#[test]
fn a_postgres_schema_restored_from_a_dump_reprocesses_what_the_dump_lacks() {
    let schema = format!("scope_restore_{}", tag());
    let pg = pg_url();
    let store = ["--store", pg.as_str(), "--schema", schema.as_str()];
    assert_exact(&idem(&demo(&store, 11, 300)), "first batch");
    let dir = tempfile::tempdir().expect("tempdir");
    let dump = dir.path().join("dump.sql");
    let out = Command::new("pg_dump")
        .args([pg.as_str(), "-n", schema.as_str(), "-f"])
        .arg(&dump)
        .output()
        .expect("run pg_dump");
    assert!(out.status.success(), "pg_dump: {}", text(&out.stderr));
    let before = pg_identity(&schema);

    let (stdout, _) = assert_exact(&idem(&demo(&store, 12, 300)), "second batch");
    assert_eq!(value(&stdout, "disbursements"), "600");

    drop_schema(&schema);
    let out = Command::new("psql")
        .args([pg.as_str(), "-v", "ON_ERROR_STOP=1", "-q", "-f"])
        .arg(&dump)
        .output()
        .expect("run psql");
    assert!(out.status.success(), "restore: {}", text(&out.stderr));
    assert_eq!(
        pg_identity(&schema),
        before,
        "the dump carries the old identity"
    );
    assert_eq!(
        psql(&format!("SELECT count(*) FROM \"{schema}\".disbursements")),
        "300",
        "the dump lacks the second batch"
    );

    let (stdout, stderr) = assert_exact(&idem(&demo(&store, 12, 300)), "after the restore");
    assert_eq!(
        value(&stdout, "disbursements"),
        "600",
        "re-processed:\n{stdout}"
    );
    assert!(
        stderr.contains("store identity rotated"),
        "the rotation is logged:\n{stderr}"
    );
    assert_ne!(pg_identity(&schema), before);
    drop_schema(&schema);
}

fn copy_db(from: &Path, to: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let (f, t) = (
            format!("{}{suffix}", from.display()),
            format!("{}{suffix}", to.display()),
        );
        let _ = std::fs::remove_file(&t);
        if Path::new(&f).exists() {
            std::fs::copy(&f, &t).expect("copy");
        }
    }
}

/// An SQLite file restored from a copy taken before the second batch: the same, for the
/// embedded store; and the runbook's rotation for the case automation cannot see.
#[test]
fn an_sqlite_file_restored_from_a_copy_reprocesses_what_the_copy_lacks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("grants.db");
    let backup = dir.path().join("backup.db");
    let url = format!("sqlite://{}", db.display());
    let store = ["--store", url.as_str()];
    assert_exact(&idem(&demo(&store, 21, 300)), "first batch");
    copy_db(&db, &backup);
    let before = sqlite_identity(&db);
    assert_exact(&idem(&demo(&store, 22, 300)), "second batch");
    copy_db(&backup, &db);
    let (stdout, stderr) = assert_exact(&idem(&demo(&store, 22, 300)), "after the restore");
    assert_eq!(
        value(&stdout, "disbursements"),
        "600",
        "re-processed:\n{stdout}"
    );
    assert!(stderr.contains("store identity rotated"), "{stderr}");
    assert_ne!(sqlite_identity(&db), before);

    // The runbook step: rotate before starting on a restored copy. The start then finds a
    // fresh identity and has nothing to rotate.
    copy_db(&backup, &db);
    let out = idem(&[
        "migrate",
        "--store",
        url.as_str(),
        "--rotate-store-identity",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rotated = sqlite_identity(&db);
    assert!(text(&out.stdout).contains(&format!("store identity: {rotated} (rotated)")));
    assert_ne!(rotated, before);
    let (stdout, stderr) = assert_exact(&idem(&demo(&store, 22, 300)), "after the runbook");
    assert_eq!(value(&stdout, "disbursements"), "600", "{stdout}");
    assert!(!stderr.contains("store identity rotated"), "{stderr}");
    assert_eq!(sqlite_identity(&db), rotated);
}

/// `--rotate-store-identity` on Postgres, and its bad input.
#[test]
fn migrate_rotates_a_postgres_identity_on_request() {
    let schema = format!("scope_rotate_{}", tag());
    let pg = pg_url();
    let out = idem(&[
        "migrate",
        "--store",
        pg.as_str(),
        "--schema",
        schema.as_str(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let first = pg_identity(&schema);
    assert_eq!(first.len(), 32);
    let out = idem(&[
        "migrate",
        "--store",
        pg.as_str(),
        "--schema",
        schema.as_str(),
    ]);
    assert!(out.status.success());
    assert_eq!(pg_identity(&schema), first, "migrate keeps the identity");
    let out = idem(&[
        "migrate",
        "--store",
        pg.as_str(),
        "--schema",
        schema.as_str(),
        "--rotate-store-identity",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_ne!(pg_identity(&schema), first);
    let out = idem(&["migrate", "--store", "memory://", "--rotate-store-identity"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    drop_schema(&schema);
}
