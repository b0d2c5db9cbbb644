//! `idem audit report` rendered in a real browser: a demo run's store (SQLite, and
//! Postgres at `IDEM_TEST_POSTGRES_URL`), the page rendered by headless Chromium
//! (`chromium`, installed by `scripts/ensure-chromium`; a missing browser fails the
//! test), the rendered DOM read back and its figures compared with the store's own
//! counts — and its duplicates suppressed and dead letters with what the demo itself
//! counted (the outcome tally in `idem_outcome_counts`) — and a screenshot kept under the
//! target directory (its path is printed). A consume from RabbitMQ (`IDEM_TEST_AMQP_URL`)
//! with duplicates, a conflict and poison checks the tally against what `idem consume`
//! printed and what the dead-letter queue holds.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use idem_broker::any::{pending_count, BrokerUrl};
use idem_store_postgres::{PgConfig, PgStore};

use crate::common;
use common::rt;

fn idem(args: &[&str]) -> Output {
    common::idem(args)
}

#[track_caller]
fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {stdout}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn pg_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Where screenshots are kept: under the target directory.
fn artefacts() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("audit-report");
    std::fs::create_dir_all(&dir).expect("artefact dir");
    dir
}

/// Headless Chromium with the flags a sandbox-less CI needs, and a profile of its own.
fn chromium(profile: &Path, args: &[&str]) -> Output {
    Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .output()
        .expect("chromium is installed (scripts/ensure-chromium)")
}

/// The rendered DOM of `page`, and a screenshot of it at `png`.
fn render(page: &Path, png: &Path) -> String {
    let profile = tempfile::tempdir().expect("profile");
    let url = format!("file://{}", page.display());
    let out = chromium(profile.path(), &["--dump-dom", &url]);
    let dom = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && dom.contains("</html>"),
        "chromium --dump-dom failed: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let shot = chromium(
        profile.path(),
        &[
            &format!("--screenshot={}", png.display()),
            "--window-size=1100,2600",
            &url,
        ],
    );
    assert!(
        shot.status.success() && png.metadata().map(|m| m.len() > 10_000).unwrap_or(false),
        "chromium --screenshot failed: {:?}\n{}",
        shot.status,
        String::from_utf8_lossy(&shot.stderr)
    );
    println!("screenshot: {}", png.display());
    dom
}

/// `data-value` of the element with `id` in the DOM.
fn value(dom: &str, id: &str) -> String {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no element #{id} in the rendered page"));
    let tag_end = at + dom[at..].find('>').expect("tag end");
    let tag_start = dom[..at].rfind('<').expect("tag start");
    let tag = &dom[tag_start..tag_end];
    let v = tag
        .split("data-value=\"")
        .nth(1)
        .unwrap_or_else(|| panic!("#{id} has no data-value: {tag}"));
    v[..v.find('"').expect("quote")].to_owned()
}

fn number(dom: &str, id: &str) -> i64 {
    value(dom, id)
        .parse()
        .unwrap_or_else(|e| panic!("#{id}: {e}"))
}

/// Per-day rows of the rendered table: day → claims.
fn day_claims(dom: &str) -> HashMap<String, i64> {
    dom.split("<tr class=\"day\"")
        .skip(1)
        .map(|row| {
            let attr = |name: &str| {
                let v = row.split(&format!("{name}=\"")).nth(1).expect(name);
                v[..v.find('"').expect("quote")].to_owned()
            };
            (
                attr("data-day"),
                attr("data-claims").parse().expect("claims"),
            )
        })
        .collect()
}

/// What the store says, counted by the test itself.
#[derive(Debug, PartialEq)]
struct Counts {
    claims: i64,
    rows: i64,
    amount: i64,
    events: i64,
    published: i64,
}

/// Checks the page against `want`, and that it renders the verdict `agree`.
fn check(dom: &str, want: &Counts, agree: bool) {
    let got = Counts {
        claims: number(dom, "processed"),
        rows: number(dom, "business-rows"),
        amount: number(dom, "amount-total"),
        events: number(dom, "events"),
        published: number(dom, "published"),
    };
    assert_eq!(&got, want, "the page's figures and the store's");
    // The per-day chart and table add up to the total.
    assert_eq!(number(dom, "processed-by-day"), want.claims);
    assert_eq!(day_claims(dom).values().sum::<i64>(), want.claims);
    let bars: i64 = dom
        .split("data-series=\"claims\" data-value=\"")
        .skip(1)
        .map(|s| {
            s[..s.find('"').expect("quote")]
                .parse::<i64>()
                .expect("bar")
        })
        .sum();
    assert_eq!(bars, want.claims, "the chart's claim bars");
    let verdict = value_attr(dom, "verdict", "data-agree");
    assert_eq!(verdict, agree.to_string());
    if agree {
        assert!(
            dom.contains("Totals agree"),
            "the page says the totals agree"
        );
    } else {
        assert!(dom.contains("Totals DISAGREE"), "the page says they do not");
    }
    assert!(dom.contains("idem key --subject"));
    for remote in ["src=\"http", "href=\"http", "url(http", "@import"] {
        assert!(!dom.contains(remote), "a network resource: {remote}");
    }
}

fn value_attr(dom: &str, id: &str, attr: &str) -> String {
    let at = dom.find(&format!("id=\"{id}\"")).expect("id");
    let tag_start = dom[..at].rfind('<').expect("tag start");
    let tag = &dom[tag_start..tag_start + dom[tag_start..].find('>').expect("end")];
    let v = tag.split(&format!("{attr}=\"")).nth(1).expect(attr);
    v[..v.find('"').expect("quote")].to_owned()
}

/// A `name: value` line of a command's report, as the report's SQL counts come.
fn count_line(stdout: &str, name: &str) -> i64 {
    i64::try_from(common::report_value(stdout, name)).expect("a count within i64")
}

/// Sums an attribute over the rendered per-day rows.
fn day_sum(dom: &str, attr: &str) -> i64 {
    dom.split("<tr class=\"day\"")
        .skip(1)
        .map(|row| {
            let v = row.split(&format!("{attr}=\"")).nth(1).expect(attr);
            v[..v.find('"').expect("quote")]
                .parse::<i64>()
                .expect("number")
        })
        .sum()
}

/// Sums the chart's bars of one series.
fn bar_sum(dom: &str, series: &str) -> i64 {
    dom.split(&format!("data-series=\"{series}\" data-value=\""))
        .skip(1)
        .map(|s| {
            s[..s.find('"').expect("quote")]
                .parse::<i64>()
                .expect("bar")
        })
        .sum()
}

/// The dead-letter reasons table: reason → count.
fn reasons(dom: &str) -> HashMap<String, i64> {
    dom.split("<tr class=\"reason\"")
        .skip(1)
        .map(|row| {
            let attr = |name: &str| {
                let v = row.split(&format!("{name}=\"")).nth(1).expect(name);
                v[..v.find('"').expect("quote")].to_owned()
            };
            (
                attr("data-reason"),
                attr("data-value").parse().expect("count"),
            )
        })
        .collect()
}

/// Checks the page's tallied figures — totals, per-day table, chart and reasons — against
/// `duplicates`, `conflicts` and `dead_letters` (counted by the run itself).
fn check_outcomes(dom: &str, duplicates: i64, conflicts: i64, dead_letters: i64) {
    assert_eq!(number(dom, "duplicates"), duplicates, "#duplicates");
    assert_eq!(number(dom, "conflicts"), conflicts, "#conflicts");
    assert_eq!(number(dom, "dead-letters"), dead_letters, "#dead-letters");
    assert_eq!(number(dom, "duplicates-by-day"), duplicates);
    assert_eq!(number(dom, "conflicts-by-day"), conflicts);
    assert_eq!(number(dom, "dead-letters-by-day"), dead_letters);
    assert_eq!(day_sum(dom, "data-duplicates"), duplicates);
    assert_eq!(day_sum(dom, "data-conflicts"), conflicts);
    assert_eq!(day_sum(dom, "data-dead-letters"), dead_letters);
    assert_eq!(bar_sum(dom, "duplicates"), duplicates, "duplicate bars");
    assert_eq!(bar_sum(dom, "conflicts"), conflicts, "conflict bars");
    assert_eq!(
        bar_sum(dom, "dead-letters"),
        dead_letters,
        "dead-letter bars"
    );
    assert_eq!(number(dom, "dead-letters-by-reason"), dead_letters);
    assert_eq!(reasons(dom).values().sum::<i64>(), dead_letters);
    assert_eq!(
        reasons(dom).get("conflict").copied().unwrap_or(0),
        conflicts
    );
    assert!(
        dom.contains("id=\"outcomes-note\""),
        "the note on the counts"
    );
    assert!(!dom.contains("outcomes-missing"));
}

fn report(store: &str, schema: Option<&str>, out: &Path) -> String {
    let out_s = out.to_str().expect("utf-8");
    let mut args = vec![
        "audit",
        "report",
        "--store",
        store,
        "--since",
        "2000-01-01",
        "--until",
        "2100-01-01",
        "--out",
        out_s,
    ];
    if let Some(s) = schema {
        args.extend(["--schema", s]);
    }
    ok(&idem(&args))
}

#[test]
fn report_of_a_sqlite_demo_renders_in_chromium_and_agrees_with_the_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("demo.db");
    let store = format!("sqlite://{}", db.display());
    let demo = ok(&idem(&[
        "demo",
        "--store",
        &store,
        "--submissions",
        "300",
        "--redeliveries",
        "0.3",
        "--poison-rate",
        "0.05",
        "--seed",
        "7",
    ]));
    assert!(demo.contains("exactly-once: OK"), "{demo}");

    let counts = |db: &Path| {
        rt().block_on(async {
            let s = idem_store_sqlite::SqliteStore::connect(
                db.to_str().expect("utf-8"),
                Default::default(),
            )
            .await
            .expect("open");
            let q = |sql: &'static str| {
                let pool = s.pool().clone();
                async move {
                    idem_store_sqlite::sqlx::query_scalar::<_, i64>(sql)
                        .fetch_one(&pool)
                        .await
                        .expect(sql)
                }
            };
            Counts {
                claims: q("SELECT count(*) FROM processed_messages").await,
                rows: q("SELECT count(*) FROM disbursements").await,
                amount: q("SELECT coalesce(sum(amount_cents), 0) FROM disbursements").await,
                events: q("SELECT count(*) FROM outbox").await,
                published: q("SELECT count(*) FROM outbox WHERE published_at IS NOT NULL").await,
            }
        })
    };
    let want = counts(&db);
    assert!(want.claims > 200, "{want:?}");

    let page = dir.path().join("report.html");
    let printed = report(&store, None, &page);
    assert!(printed.contains("totals: agree"), "{printed}");
    let html = std::fs::read_to_string(&page).expect("page");
    assert!(!html.contains("<script"), "no scripts");
    assert!(!html.contains("<link"), "no external stylesheets");
    assert!(html.contains("@media print"), "print CSS");
    let dom = render(&page, &artefacts().join("report-sqlite.png"));
    check(&dom, &want, true);
    // What the demo counted itself: its duplicates and the broker's dead letters.
    let (duplicates, dead) = (
        count_line(&demo, "duplicates"),
        count_line(&demo, "rejected"),
    );
    assert!(duplicates > 0 && dead > 0, "{demo}");
    assert!(demo.contains("outcome_counts: written"), "{demo}");
    check_outcomes(&dom, duplicates, 0, dead);
    println!("sqlite demo: duplicates {duplicates}, dead letters {dead}; the page agrees");

    // A second payment for a processed key: the recount must disagree, and say so.
    rt().block_on(async {
        let s = idem_store_sqlite::SqliteStore::connect(
            db.to_str().expect("utf-8"),
            Default::default(),
        )
        .await
        .expect("open");
        idem_store_sqlite::sqlx::query(
            "INSERT INTO disbursements (award_id, amount_cents, idempotency_key) \
             SELECT award_id, amount_cents, idempotency_key FROM disbursements LIMIT 1",
        )
        .execute(s.pool())
        .await
        .expect("double payment");
    });
    let want = counts(&db);
    let page = dir.path().join("report-bad.html");
    let printed = report(&store, None, &page);
    assert!(printed.contains("totals: DISAGREE"), "{printed}");
    let dom = render(&page, &artefacts().join("report-sqlite-disagree.png"));
    check(&dom, &want, false);
    assert_eq!(number(&dom, "claims-with-several-rows"), 1);
    check_outcomes(&dom, duplicates, 0, dead);

    // A database from before the outcome tally: the page says so instead of failing.
    rt().block_on(async {
        let s = idem_store_sqlite::SqliteStore::connect(
            db.to_str().expect("utf-8"),
            Default::default(),
        )
        .await
        .expect("open");
        idem_store_sqlite::sqlx::query("DROP TABLE idem_outcome_counts")
            .execute(s.pool())
            .await
            .expect("drop");
    });
    let page = dir.path().join("report-old.html");
    report(&store, None, &page);
    let html = std::fs::read_to_string(&page).expect("page");
    assert!(html.contains("id=\"outcomes-missing\""), "the page says so");
    assert_eq!(value(&html, "duplicates"), "");
    assert_eq!(value(&html, "dead-letters"), "");
}

#[test]
fn report_of_a_postgres_demo_renders_in_chromium_and_agrees_with_the_store() {
    let pg = pg_url();
    let schema = format!(
        "report_{}_{:08x}",
        std::process::id(),
        rand::random::<u32>()
    );
    let demo = ok(&idem(&[
        "demo",
        "--store",
        &pg,
        "--schema",
        &schema,
        "--submissions",
        "300",
        "--redeliveries",
        "0.3",
        "--poison-rate",
        "0.05",
        "--seed",
        "11",
    ]));
    assert!(demo.contains("exactly-once: OK"), "{demo}");
    let want = rt().block_on(async {
        let s = PgStore::connect(&pg, PgConfig::new(schema.clone()).expect("schema"))
            .await
            .expect("connect");
        let q = |sql: String| {
            let pool = s.pool().clone();
            async move {
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
                    .fetch_one(&pool)
                    .await
                    .expect("count")
            }
        };
        let t = |name: &str| format!("\"{schema}\".{name}");
        Counts {
            claims: q(format!("SELECT count(*) FROM {}", t("processed_messages"))).await,
            rows: q(format!("SELECT count(*) FROM {}", t("disbursements"))).await,
            amount: q(format!(
                "SELECT coalesce(sum(amount_cents), 0)::bigint FROM {}",
                t("disbursements")
            ))
            .await,
            events: q(format!("SELECT count(*) FROM {}", t("outbox"))).await,
            published: q(format!(
                "SELECT count(*) FROM {} WHERE published_at IS NOT NULL",
                t("outbox")
            ))
            .await,
        }
    });
    assert!(want.claims > 200, "{want:?}");
    let dir = tempfile::tempdir().expect("tempdir");
    let page = dir.path().join("report.html");
    let printed = report(&pg, Some(&schema), &page);
    assert!(printed.contains("totals: agree"), "{printed}");
    let dom = render(&page, &artefacts().join("report-postgres.png"));
    check(&dom, &want, true);
    let (duplicates, dead) = (
        count_line(&demo, "duplicates"),
        count_line(&demo, "rejected"),
    );
    assert!(duplicates > 0 && dead > 0, "{demo}");
    assert!(demo.contains("outcome_counts: written"), "{demo}");
    check_outcomes(&dom, duplicates, 0, dead);
    println!("postgres demo: duplicates {duplicates}, dead letters {dead}; the page agrees");
    let _ = Command::new("psql")
        .args([&pg, "-qc", &format!("DROP SCHEMA \"{schema}\" CASCADE")])
        .output();
}

fn psql(url: &str, sql: &str) -> String {
    let out = Command::new("psql")
        .args([url, "-v", "ON_ERROR_STOP=1", "-qAtc", sql])
        .output()
        .expect("run psql");
    assert!(
        out.status.success(),
        "psql: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `idem consume` from RabbitMQ into Postgres with redelivered bodies, a conflicting
/// resubmission and poison: the outcome tally it leaves in `idem_outcome_counts` equals
/// what it printed and what the dead-letter queue holds, and the report shows it.
#[test]
fn consume_tallies_duplicates_conflicts_and_dead_letters_into_the_store() {
    let amqp = std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let pg = pg_url();
    let tag = format!("{}_{:08x}", std::process::id(), rand::random::<u32>());
    let (queue, schema) = (format!("idem-report-{tag}"), format!("report_c_{tag}"));
    let ts = "2026-07-01T09:00:00Z";
    let body = |award: &str, amount: u64| {
        serde_json::json!({"award_id": award, "submission_timestamp": ts, "amount_cents": amount})
            .to_string()
    };
    let mut lines = Vec::new();
    for i in 0..20 {
        lines.push(body(&format!("R-{tag}-{i}"), 100 + i));
    }
    // Every fourth body again (not the first award: it gets a conflict): duplicates.
    for i in (1..20).step_by(4) {
        lines.push(body(&format!("R-{tag}-{i}"), 100 + i));
    }
    // The first award again with another amount: a conflict.
    lines.push(body(&format!("R-{tag}-0"), 999));
    // Poison: three bad bodies.
    lines.extend(["not json".to_owned(), "{}".to_owned(), "[1]".to_owned()]);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("bodies.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").expect("write");
    ok(&idem(&[
        "publish",
        "--broker",
        &amqp,
        "--destination",
        &queue,
        "--file",
        file.to_str().expect("utf-8"),
    ]));
    let out = ok(&idem(&[
        "consume",
        "--broker",
        &amqp,
        "--source",
        &queue,
        "--store",
        &pg,
        "--schema",
        &schema,
        "--exit-when-idle",
        "3",
    ]));
    let (processed, duplicates) = (
        count_line(&out, "processed"),
        count_line(&out, "duplicates"),
    );
    let (rejected, conflicts) = (count_line(&out, "rejected"), count_line(&out, "conflicts"));
    assert_eq!(
        (processed, duplicates, rejected, conflicts),
        (20, 5, 3, 1),
        "{out}"
    );
    let url = BrokerUrl::parse(&amqp).expect("url");
    let dead = rt()
        .block_on(pending_count(&url, &format!("{queue}.dead-letter")))
        .expect("count the dead letters");
    assert_eq!(dead, 4, "the dead-letter queue");
    let dead = i64::try_from(dead).expect("count");

    let sum = |filter: &str| -> i64 {
        psql(
            &pg,
            &format!(
                "SELECT coalesce(sum(count), 0) FROM \"{schema}\".idem_outcome_counts WHERE {filter}"
            ),
        )
        .parse()
        .expect("sum")
    };
    assert_eq!(sum("outcome = 'processed'"), processed);
    assert_eq!(sum("outcome = 'duplicate'"), duplicates);
    assert_eq!(
        sum("outcome = 'conflict' AND reason = 'conflict'"),
        conflicts
    );
    assert_eq!(sum("outcome = 'rejected'"), rejected);
    assert_eq!(sum("outcome IN ('rejected', 'conflict')"), dead);
    assert_eq!(
        sum("reason = '' AND outcome IN ('rejected', 'conflict')"),
        0
    );

    let page = dir.path().join("report.html");
    report(&pg, Some(&schema), &page);
    let html = std::fs::read_to_string(&page).expect("page");
    check_outcomes(&html, duplicates, conflicts, dead);
    assert_eq!(number(&html, "processed-tallied"), processed);
    assert_eq!(number(&html, "processed"), processed);
    psql(&pg, &format!("DROP SCHEMA \"{schema}\" CASCADE"));
}
