//! The `idem` command's contract, run as a user runs it.

use std::process::{Command, Output};

use crate::common;

fn idem(args: &[&str]) -> Output {
    common::idem(args)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn report_value(out: &str, name: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .unwrap_or_else(|| panic!("no `{name}:` line in\n{out}"))
        .to_owned()
}

#[test]
fn key_matches_the_reference_vector() {
    let dir = tempfile::tempdir().unwrap();
    let payload = dir.path().join("p");
    std::fs::write(&payload, b"{...}").unwrap();
    let o = idem(&[
        "key",
        "--award-id",
        "A-2026-014",
        "--timestamp",
        "2026-07-01T09:00:00Z",
        "--payload",
        payload.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(
        stdout(&o).trim(),
        "d3ed6c4d8acb11aa58dcdb03e400559b1e415626580e4a00466ae631bea74acd"
    );
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    for args in [
        vec![
            "key",
            "--award-id",
            "A|B",
            "--timestamp",
            "t",
            "--payload",
            "/dev/null",
        ],
        vec![
            "key",
            "--award-id",
            "A",
            "--timestamp",
            "t",
            "--payload",
            "/no/such/file",
        ],
        vec!["demo", "--store", "mysql://x"],
        vec![
            "demo",
            "--store",
            "postgres://postgres@127.0.0.1/test",
            "--schema",
            "bad-name; drop",
        ],
        vec!["migrate", "--store", "sqlite://"],
    ] {
        let o = idem(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.trim().is_empty(), "{args:?}: no message");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn argument_mistakes_exit_2_with_clap_s_whole_message() {
    for (args, names) in [
        (vec!["demo", "--redeliveries", "2"], "--redeliveries"),
        (vec!["demo", "--no-such-flag"], "--no-such-flag"),
    ] {
        let o = idem(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(err.contains(names), "{args:?}: {err}");
        assert!(err.contains("try '--help'"), "{args:?}: {err}");
    }
}

#[test]
fn demo_on_sqlite_is_exactly_once_and_the_database_agrees() {
    let o = idem(&[
        "demo",
        "--submissions",
        "600",
        "--redeliveries",
        "0.25",
        "--crash-rate",
        "0.05",
        "--poison-rate",
        "0.05",
        "--seed",
        "7",
        "--batch-size",
        "5",
    ]);
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.ends_with("exactly-once: OK\n"), "{out}");
    let url = out
        .lines()
        .next()
        .unwrap()
        .strip_prefix("store: sqlite://")
        .expect("store line first")
        .to_owned();
    let rejected: i64 = report_value(&out, "rejected").parse().unwrap();
    let disbursements: i64 = report_value(&out, "disbursements").parse().unwrap();
    assert!(rejected > 0, "poison was generated");
    assert_eq!(disbursements + rejected, 600);
    assert!(report_value(&out, "crashes").parse::<u64>().unwrap() > 0);
    assert_eq!(
        report_value(&out, "ledger_total_cents"),
        report_value(&out, "expected_total_cents")
    );
    // Read the file it names, independently.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = idem_store_sqlite::SqliteStore::connect(&url, Default::default())
            .await
            .unwrap();
        assert_eq!(
            store.count("processed_messages").await.unwrap(),
            disbursements
        );
        assert_eq!(store.count("disbursements").await.unwrap(), disbursements);
        let distinct: i64 =
            sqlx::query_scalar("SELECT count(DISTINCT idempotency_key) FROM disbursements")
                .fetch_one(store.pool())
                .await
                .unwrap();
        assert_eq!(distinct, disbursements);
    });
}

#[test]
fn demo_on_postgres_is_exactly_once() {
    let url = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("cli_demo_{}", std::process::id());
    let o = idem(&[
        "demo",
        "--store",
        &url,
        "--schema",
        &schema,
        "--submissions",
        "400",
        "--redeliveries",
        "0.25",
        "--crash-rate",
        "0.05",
        "--concurrency",
        "4",
        "--seed",
        "3",
    ]);
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.ends_with("exactly-once: OK\n"), "{out}");
    assert_eq!(report_value(&out, "disbursements"), "400");
    assert_eq!(report_value(&out, "processed"), "400");
}

/// `idem migrate` creates idem's own tables and no handler's; `--handler grant` adds the
/// grant pipeline's `disbursements`. Both are idempotent.
#[test]
fn migrate_creates_idems_tables_and_the_grant_table_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("m.db").display());
    let o = idem(&["migrate", "--store", &url]);
    assert!(o.status.success(), "{o:?}");
    let o = idem(&["migrate", "--store", &url]);
    assert!(o.status.success(), "migrate is idempotent: {o:?}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let tables = |url: &str| {
        rt.block_on(async {
            let store = idem_store_sqlite::SqliteStore::connect(url, Default::default())
                .await
                .unwrap();
            let mut out = Vec::new();
            for t in ["processed_messages", "disbursements", "outbox"] {
                out.push(store.count(t).await.map(|_| t).ok());
            }
            out
        })
    };
    assert_eq!(
        tables(&url),
        [Some("processed_messages"), None, Some("outbox")]
    );
    for _ in 0..2 {
        let o = idem(&["migrate", "--store", &url, "--handler", "grant"]);
        assert!(o.status.success(), "{o:?}");
    }
    assert_eq!(
        tables(&url),
        [
            Some("processed_messages"),
            Some("disbursements"),
            Some("outbox")
        ]
    );
}

#[test]
fn inspect_answers_by_award_and_by_key_on_sqlite() {
    let o = idem(&[
        "demo",
        "--submissions",
        "50",
        "--crash-rate",
        "0",
        "--seed",
        "9",
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}");
    let url = out
        .lines()
        .next()
        .unwrap()
        .strip_prefix("store: ")
        .unwrap()
        .to_owned();
    let award = format!("A-{:016x}-{:07}", 9, 3);
    let o = idem(&["inspect", "--store", &url, "--award-id", &award]);
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    assert_eq!(report_value(&text, "processed"), "yes");
    assert_eq!(report_value(&text, "claims"), "1");
    assert_eq!(report_value(&text, "subject"), award);
    assert_eq!(report_value(&text, "events"), "1");
    assert!(text.contains("disbursement.recorded"));
    let key = report_value(&text, "key");
    let o = idem(&["inspect", "--store", &url, "--key", &key]);
    assert_eq!(report_value(&stdout(&o), "subject"), award);
    let o = idem(&["inspect", "--store", &url, "--award-id", "A-never"]);
    assert_eq!(report_value(&stdout(&o), "processed"), "no");
    let o = idem(&["inspect", "--store", &url, "--key", "not-hex"]);
    assert_eq!(o.status.code(), Some(2));
}

/// `idem purge` on the store that `store` names (`--store URL [--schema NAME]`): the floor
/// refuses, a dry run counts, batches delete, unpublished outbox rows stay, and a purged
/// award is no longer "processed".
fn purge_contract(store: &[&str]) {
    let with = |args: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = vec![args[0].to_owned()];
        v.extend(store.iter().map(|s| (*s).to_owned()));
        v.extend(args[1..].iter().map(|s| (*s).to_owned()));
        v
    };
    let run = |args: &[&str]| {
        let v = with(args);
        idem(&v.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let o = run(&[
        "demo",
        "--submissions",
        "120",
        "--crash-rate",
        "0",
        "--seed",
        "4",
    ]);
    assert!(o.status.success(), "{}", stdout(&o));
    // A cutoff below the three-year floor is refused unless overridden.
    let o = run(&["purge", "--older-than", "30d"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("floor"),
        "{o:?}"
    );
    // Nothing is three years old: a legal purge deletes nothing.
    let o = run(&["purge", "--older-than", "3y"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(report_value(&stdout(&o), "dedup_records"), "0");
    let base = [
        "purge",
        "--older-than",
        "0s",
        "--allow-below-floor",
        "--batch-size",
        "50",
    ];
    let mut dry = base.to_vec();
    dry.push("--dry-run");
    let o = run(&dry);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(report_value(&stdout(&o), "dedup_records"), "120");
    assert_eq!(report_value(&stdout(&o), "dry_run"), "true");
    let award = format!("A-{:016x}-{:07}", 4, 1);
    let processed = || {
        report_value(
            &stdout(&run(&["inspect", "--award-id", &award])),
            "processed",
        )
    };
    assert_eq!(processed(), "yes");
    let o = run(&base);
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    assert_eq!(report_value(&text, "dedup_records"), "120");
    assert_eq!(
        report_value(&text, "batches"),
        "4",
        "120 rows in batches of 50, then none"
    );
    assert_eq!(
        report_value(&text, "outbox_events"),
        "0",
        "unpublished outbox rows are kept"
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("purge:"),
        "progress is shown"
    );
    assert_eq!(processed(), "no");
}

#[test]
fn purge_respects_the_floor_counts_dry_and_deletes_in_batches() {
    let url = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("cli_purge_{}", std::process::id());
    purge_contract(&["--store", &url, "--schema", &schema]);
}

#[test]
fn purge_on_sqlite_as_on_postgres() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("idem.db").display());
    purge_contract(&["--store", &url]);
    // A store that does not exist is not created by a purge.
    let missing = format!("sqlite://{}", dir.path().join("missing.db").display());
    let o = idem(&["purge", "--store", &missing, "--older-than", "3y"]);
    assert!(!o.status.success(), "{o:?}");
    assert!(!dir.path().join("missing.db").exists());
}

#[test]
fn migrate_partitioned_then_demo_and_purge_by_partition() {
    let url = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("cli_part_{}", std::process::id());
    let o = idem(&[
        "migrate",
        "--store",
        &url,
        "--schema",
        &schema,
        "--layout",
        "partitioned",
    ]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(report_value(&stdout(&o), "layout"), "partitioned");
    // Asking a plain table for the partitioned layout is refused.
    let plain = format!("cli_plain_{}", std::process::id());
    assert!(idem(&["migrate", "--store", &url, "--schema", &plain])
        .status
        .success());
    let o = idem(&[
        "migrate",
        "--store",
        &url,
        "--schema",
        &plain,
        "--layout",
        "partitioned",
    ]);
    assert!(!o.status.success(), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("plain table"),
        "{o:?}"
    );
    let o = idem(&[
        "migrate",
        "--store",
        "sqlite:///tmp/x.db",
        "--layout",
        "partitioned",
    ]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");

    let o = idem(&[
        "demo",
        "--store",
        &url,
        "--schema",
        &schema,
        "--submissions",
        "150",
        "--batch-size",
        "10",
        "--crash-rate",
        "0.05",
        "--seed",
        "8",
    ]);
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.ends_with("exactly-once: OK\n"), "{text}");
    assert_eq!(report_value(&text, "processed"), "150");

    let purge = |extra: &[&str]| {
        let mut args = vec![
            "purge",
            "--store",
            url.as_str(),
            "--schema",
            schema.as_str(),
        ];
        args.extend_from_slice(extra);
        idem(&args)
    };
    let o = purge(&["--older-than", "30d"]);
    assert_eq!(o.status.code(), Some(2), "below the floor: {o:?}");
    let o = purge(&["--older-than", "0s", "--allow-below-floor"]);
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    assert_eq!(report_value(&text, "layout"), "partitioned");
    let dropped: u64 = report_value(&text, "partitions_dropped").parse().unwrap();
    let rows: u64 = report_value(&text, "dedup_records").parse().unwrap();
    assert!(dropped >= 1 || rows == 150, "{text}");
    let award = format!("A-{:016x}-{:07}", 8, 1);
    let o = idem(&[
        "inspect",
        "--store",
        &url,
        "--schema",
        &schema,
        "--award-id",
        &award,
    ]);
    assert_eq!(report_value(&stdout(&o), "processed"), "no", "{o:?}");
    for s in [&schema, &plain] {
        let _ = std::process::Command::new("psql")
            .args([
                url.as_str(),
                "-qc",
                &format!("DROP SCHEMA IF EXISTS \"{s}\" CASCADE"),
            ])
            .output();
    }
}

#[test]
fn migrate_distributed_then_demo_inspect_and_purge() {
    let url = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("cli_dist_{}", std::process::id());
    let migrate = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args([
                "migrate",
                "--store",
                url.as_str(),
                "--schema",
                schema.as_str(),
            ])
            .args(extra)
            .env("RUST_LOG", "idem::migrate=info")
            .output()
            .expect("run idem")
    };
    let o = migrate(&["--layout", "distributed"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(report_value(&stdout(&o), "layout"), "distributed");
    // No Citus on the test server: the step is skipped, and said so on stdout and in the log.
    assert!(
        report_value(&stdout(&o), "citus").starts_with("not installed"),
        "{o:?}"
    );
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(
        log.contains("INFO") && log.contains("create_distributed_table skipped"),
        "{log}"
    );
    // Migrating again without --layout finds the layout.
    let o = migrate(&[]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(report_value(&stdout(&o), "layout"), "distributed");
    // Another layout over it is refused.
    let o = migrate(&["--layout", "partitioned"]);
    assert!(!o.status.success(), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("distributed table"),
        "{o:?}"
    );

    let o = idem(&[
        "demo",
        "--store",
        &url,
        "--schema",
        &schema,
        "--submissions",
        "150",
        "--batch-size",
        "10",
        "--crash-rate",
        "0.05",
        "--redeliveries",
        "0.3",
        "--seed",
        "9",
    ]);
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    assert!(text.ends_with("exactly-once: OK\n"), "{text}");
    assert_eq!(report_value(&text, "processed"), "150");
    assert_eq!(report_value(&text, "disbursements"), "150");
    // One disbursement per submission, keyed (award_id, idempotency_key) by the migration.
    let psql = |sql: &str| {
        let o = Command::new("psql")
            .args([url.as_str(), "-qAtc", sql])
            .output()
            .expect("run psql");
        assert!(o.status.success(), "{o:?}");
        String::from_utf8_lossy(&o.stdout).trim().to_owned()
    };
    assert_eq!(
        psql(&format!(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
             WHERE conrelid = '\"{schema}\".disbursements'::regclass AND contype = 'p'"
        )),
        "PRIMARY KEY (award_id, idempotency_key)"
    );

    let award = format!("A-{:016x}-{:07}", 9, 1);
    let inspect = || {
        idem(&[
            "inspect",
            "--store",
            &url,
            "--schema",
            &schema,
            "--award-id",
            &award,
        ])
    };
    assert_eq!(report_value(&stdout(&inspect()), "processed"), "yes");
    let o = idem(&[
        "purge",
        "--store",
        &url,
        "--schema",
        &schema,
        "--older-than",
        "0s",
        "--allow-below-floor",
    ]);
    let text = stdout(&o);
    assert!(o.status.success(), "{text}");
    assert_eq!(report_value(&text, "layout"), "distributed");
    assert_eq!(report_value(&text, "dedup_records"), "150", "{text}");
    assert_eq!(report_value(&stdout(&inspect()), "processed"), "no");
    psql(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"));
}
