//! `idem audit export`: the window, the order, the paging and the line format, against
//! the Postgres at `IDEM_TEST_POSTGRES_URL` (a missing server fails the test).

use std::process::Output;

use idem_engine::{
    ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent, OutboxWriter,
};
use idem_store_postgres::{PgConfig, PgStore};

use crate::common;
use common::rt;

fn idem(args: &[&str]) -> Output {
    common::idem(args)
}

fn url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn schema() -> String {
    format!(
        "cli_audit_{}_{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// Claims `A-<i>` at `2026-07-01T09:00:0<i>Z` (an event for each even i), and one more
/// claim with the same time as `A-2` to exercise ties.
async fn seed(store: &PgStore) -> Vec<IdempotencyKey> {
    store.migrate().await.unwrap();
    let mut keys = Vec::new();
    for i in 0..6u32 {
        let award = format!("A-{i}");
        let key = IdempotencyKey::derive(&award, "2026-07-01T09:00:00Z", b"{}").unwrap();
        let mut tx = store.begin().await.unwrap();
        assert_eq!(
            tx.claim(&key, &ClaimMeta::new(award.clone()))
                .await
                .unwrap(),
            ClaimOutcome::Claimed
        );
        if i % 2 == 0 {
            tx.enqueue(&OutboxEvent::new(
                key,
                "disbursement.recorded",
                award.clone(),
                format!(r#"{{"award_id":"{award}"}}"#),
            ))
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
        let at = format!("2026-07-01T09:00:0{}Z", if i == 5 { 2 } else { i });
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {} SET claimed_at = $1::timestamptz WHERE idempotency_key = $2",
            store.table("processed_messages")
        )))
        .bind(at)
        .bind(key.to_hex())
        .execute(store.pool())
        .await
        .unwrap();
        keys.push(key);
    }
    keys
}

#[test]
fn export_writes_the_window_in_order_as_json_lines() {
    let rt = rt();
    let schema = schema();
    let store = rt.block_on(async {
        PgStore::connect(&url(), PgConfig::new(schema.clone()).unwrap())
            .await
            .expect("Postgres at IDEM_TEST_POSTGRES_URL")
    });
    let keys = rt.block_on(seed(&store));
    // [09:00:01, 09:00:04): A-1, A-2, A-5 (tie at :02, by key), A-3.
    let mut tie = [(keys[2].to_hex(), "A-2"), (keys[5].to_hex(), "A-5")];
    tie.sort();
    let expected: Vec<(String, &str)> = [(keys[1].to_hex(), "A-1")]
        .into_iter()
        .chain(tie)
        .chain([(keys[3].to_hex(), "A-3")])
        .collect();
    for page in ["1", "2", "1000"] {
        let o = idem(&[
            "audit",
            "export",
            "--store",
            &url(),
            "--schema",
            &schema,
            "--since",
            "2026-07-01T09:00:01Z",
            "--until",
            "2026-07-01T11:00:04+02:00",
            "--page-size",
            page,
        ]);
        assert!(o.status.success(), "{o:?}");
        let out = String::from_utf8(o.stdout).unwrap();
        let lines: Vec<serde_json::Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect();
        let got: Vec<(String, String)> = lines
            .iter()
            .map(|v| {
                (
                    v["idempotency_key"].as_str().unwrap().to_owned(),
                    v["award_id"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        let want: Vec<(String, String)> = expected
            .iter()
            .map(|(k, a)| (k.clone(), (*a).to_owned()))
            .collect();
        assert_eq!(got, want, "page size {page}");
        for v in &lines {
            assert_eq!(v["format"], "idem-audit/1");
            let award = v["award_id"].as_str().unwrap();
            let events = v["events"].as_array().unwrap();
            if award == "A-2" {
                assert_eq!(v["claimed_at"], "2026-07-01T09:00:02.000000Z");
                assert_eq!(events.len(), 1, "{v}");
                let e = &events[0];
                assert_eq!(e["event_type"], "disbursement.recorded");
                assert_eq!(e["event_id"].as_str().unwrap().len(), 64);
                assert!(e["created_at"].as_str().unwrap().ends_with('Z'));
                assert!(e["published_at"].is_null());
                assert!(e.get("payload").is_none(), "payloads are never exported");
            } else {
                assert!(events.is_empty(), "{v}");
            }
        }
        // Key order of the documented format.
        let first = out.lines().next().unwrap();
        assert!(
            first.starts_with(r#"{"format":"idem-audit/1","idempotency_key":""#),
            "{first}"
        );
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("exported: 4 claims, 1 events"),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }

    // --output: a new file, never overwritten.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("audit.jsonl");
    let file_s = file.to_str().unwrap();
    let args = [
        "audit",
        "export",
        "--store",
        &url(),
        "--schema",
        &schema,
        "--since",
        "2026-01-01T00:00:00Z",
        "--until",
        "2027-01-01T00:00:00Z",
        "--output",
        file_s,
    ];
    let o = idem(&args);
    assert!(o.status.success(), "{o:?}");
    assert!(o.stdout.is_empty());
    assert_eq!(std::fs::read_to_string(&file).unwrap().lines().count(), 6);
    let o = idem(&args);
    assert_eq!(
        o.status.code(),
        Some(2),
        "an existing file is not overwritten: {o:?}"
    );

    rt.block_on(async {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA \"{schema}\" CASCADE"
        )))
        .execute(store.pool())
        .await
        .unwrap();
    });
}

#[test]
fn bad_timestamps_and_stores_exit_2_with_one_line() {
    for args in [
        vec!["--since", "yesterday", "--until", "2026-07-01T00:00:00Z"],
        vec!["--since", "2026-07-01T00:00:00Z", "--until", "2026-07-01"],
        // RFC 3339 in shape, but no such day: the server says so.
        vec![
            "--since",
            "2026-02-30T00:00:00Z",
            "--until",
            "2026-07-01T00:00:00Z",
        ],
    ] {
        let url = url();
        let mut all = vec!["audit", "export", "--store", url.as_str()];
        all.extend(args.iter().copied());
        let o = idem(&all);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains("timestamp"), "{err}");
    }
    let o = idem(&[
        "audit",
        "export",
        "--store",
        "memory://",
        "--since",
        "2026-07-01T00:00:00Z",
        "--until",
        "2026-08-01T00:00:00Z",
    ]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    // A missing SQLite file is bad input, and is not created.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.db");
    let o = idem(&[
        "audit",
        "export",
        "--store",
        &format!("sqlite://{}", missing.display()),
        "--since",
        "2026-07-01T00:00:00Z",
        "--until",
        "2026-08-01T00:00:00Z",
    ]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(!missing.exists());
}

#[test]
fn migrate_append_only_installs_the_trigger() {
    let schema = schema();
    let o = idem(&[
        "migrate",
        "--store",
        &url(),
        "--schema",
        &schema,
        "--append-only",
    ]);
    assert!(o.status.success(), "{o:?}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("append-only: processed_messages"), "{out}");
    let rt = rt();
    rt.block_on(async {
        let store = PgStore::connect(&url(), PgConfig::new(schema.clone()).unwrap())
            .await
            .unwrap();
        let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").unwrap();
        let mut tx = store.begin().await.unwrap();
        tx.claim(&key, &ClaimMeta::new("A-1")).await.unwrap();
        tx.commit().await.unwrap();
        let err = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM {}",
            store.table("processed_messages")
        )))
        .execute(store.pool())
        .await
        .expect_err("DELETE refused");
        assert!(err.to_string().contains("append-only"), "{err}");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA \"{schema}\" CASCADE"
        )))
        .execute(store.pool())
        .await
        .unwrap();
    });
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite://{}", dir.path().join("m.db").display());
    let o = idem(&["migrate", "--store", &sqlite, "--append-only"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
}

#[test]
fn export_from_sqlite_has_the_same_window_order_and_format() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("a.db").display());
    let o = idem(&["migrate", "--store", &url]);
    assert!(o.status.success(), "{o:?}");
    let rt = rt();
    let keys = rt.block_on(async {
        let store = idem_store_sqlite::SqliteStore::connect(&url, Default::default())
            .await
            .unwrap();
        let mut keys = Vec::new();
        for i in 0..4u32 {
            let award = format!("A-{i}");
            let key = IdempotencyKey::derive(&award, "2026-07-01T09:00:00Z", b"{}").unwrap();
            let mut tx = store.begin().await.unwrap();
            assert_eq!(
                tx.claim(&key, &ClaimMeta::new(award.clone()))
                    .await
                    .unwrap(),
                ClaimOutcome::Claimed
            );
            if i == 1 {
                tx.enqueue(&OutboxEvent::new(
                    key,
                    "disbursement.recorded",
                    award.clone(),
                    r#"{"award_id":"A-1"}"#,
                ))
                .await
                .unwrap();
            }
            tx.commit().await.unwrap();
            idem_store_sqlite::sqlx::query(
                "UPDATE processed_messages SET claimed_at = ?1 WHERE idempotency_key = ?2",
            )
            .bind(format!("2026-07-01T09:00:0{i}.250Z"))
            .bind(key.to_hex())
            .execute(store.pool())
            .await
            .unwrap();
            keys.push(key);
        }
        keys
    });
    let o = idem(&[
        "audit",
        "export",
        "--store",
        &url,
        "--since",
        "2026-07-01T11:00:01+02:00",
        "--until",
        "2026-07-01T09:00:03Z",
        "--page-size",
        "1",
    ]);
    assert!(o.status.success(), "{o:?}");
    let out = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert_eq!(lines[0]["idempotency_key"], keys[1].to_hex().as_str());
    assert_eq!(lines[0]["award_id"], "A-1");
    assert_eq!(lines[0]["claimed_at"], "2026-07-01T09:00:01.250000Z");
    assert_eq!(lines[0]["events"][0]["event_type"], "disbursement.recorded");
    assert!(lines[0]["events"][0]["published_at"].is_null());
    assert_eq!(lines[1]["award_id"], "A-2");
    assert!(out.starts_with(r#"{"format":"idem-audit/1","idempotency_key":""#));
    let o = idem(&[
        "audit",
        "export",
        "--store",
        &url,
        "--since",
        "2026-07-01T09:00:00Z",
        "--until",
        "soon",
    ]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
}
