//! A password given to `idem` in any supported form appears in no output: every command
//! that takes a URL (`demo`, `migrate`, `consume`, `relay`, `publish`, `purge`, `inspect`,
//! `audit export`, `audit report`) runs with a distinctive password in the store, broker
//! and front-filter URLs — in the userinfo (plain and percent-encoded), as `?password=`,
//! `sasl.password=` and `token=` — on the real Postgres (trust auth: the password is
//! accepted and ignored), Redis (the default user takes any password through `AUTH
//! default …`) and RabbitMQ, and fails against a wrong host, user or password. Its
//! stdout, stderr and every file it wrote are searched for each password.
//!
//! NATS runs with a password and with a token. Every command runs at `RUST_LOG=trace`:
//! the drivers log the URLs they were given at their debug levels (async-nats wrote the
//! server's password or token), and the log writer masks every secret of the arguments.
//!
//! Also: `IDEM_STORE`, `IDEM_BROKER` and `IDEM_FRONT_FILTER` stand for the flags, and
//! `--help` names them without showing their values.

use std::path::Path;
use std::process::{Command, Output};

use crate::common;

use common::{amqp_url, ok, output_within, pg_url, tag, text, COMMAND_LIMIT};

/// Redis: `IDEM_TEST_REDIS_URL`, default the local server (no password).
fn redis_host() -> String {
    let url =
        std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    url.trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned()
}

/// `url` with `user:password@` as its userinfo (the user of `url`, else `default_user`).
fn with_userinfo(url: &str, default_user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (user, host) = match authority.rsplit_once('@') {
        Some((userinfo, host)) => (userinfo.split(':').next().unwrap_or(default_user), host),
        None => (default_user, authority),
    };
    format!("{scheme}://{user}:{password}@{host}{tail}")
}

/// `url` with `k=v` added to its query.
fn with_param(url: &str, kv: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{kv}")
}

/// A distinctive secret and the ways it may show up in text (as written, decoded).
struct Secret {
    forms: Vec<&'static str>,
}

/// Every secret of this test: each form of each password, written and decoded.
fn secrets() -> Vec<Secret> {
    let plain = |s: &'static str| Secret { forms: vec![s] };
    vec![
        plain("Zq9PgUserinfo"),
        plain("Zq9PgQuery"),
        plain("Zq9PgSasl"),
        plain("Zq9PgToken"),
        // percent-encoded, with `@` and `:` in it
        Secret {
            forms: vec!["Zq9Pct", "Enc%3Apw", "Enc:pw", "%40Enc", "@Enc"],
        },
        plain("Zq9PgWrongUser"),
        plain("Zq9PgWrongHost"),
        plain("Zq9RedisFilter"),
        plain("Zq9RedisFilterBad"),
        plain("Zq9RedisStream"),
        plain("Zq9AmqpBad"),
        plain("Zq9AmqpHost"),
        plain("Zq9AmqpToken"),
        plain("Zq9AmqpSasl"),
        plain("Zq9EnvStore"),
        plain("Zq9NatsPass"),
        plain("Zq9NatsToken"),
    ]
}

/// Collects what the commands wrote and checks it for every secret.
#[derive(Default)]
struct Transcript {
    /// (what ran, the text it produced)
    seen: Vec<(String, String)>,
}

impl Transcript {
    /// Runs `idem ARGS` (with `env`), records its stdout and stderr, and returns it.
    fn run(&mut self, args: &[String], env: &[(&str, &str)]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
        // Every driver at its most talkative: none may print a secret.
        cmd.args(args)
            .env("RUST_LOG", "trace")
            .env_remove("IDEM_STORE")
            .env_remove("DATABASE_URL")
            .env_remove("IDEM_BROKER")
            .env_remove("IDEM_FRONT_FILTER");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = output_within(&mut cmd, COMMAND_LIMIT);
        let what = args.join(" ");
        self.seen
            .push((format!("{what} (stdout)"), text(&out.stdout)));
        self.seen
            .push((format!("{what} (stderr)"), text(&out.stderr)));
        out
    }

    /// Runs `idem ARGS`, which must succeed.
    fn ok(&mut self, args: &[String]) -> String {
        let out = self.run(args, &[]);
        ok(&out, &args.join(" "))
    }

    /// Runs `idem ARGS`, which must fail.
    fn fails(&mut self, args: &[String]) {
        let out = self.run(args, &[]);
        assert!(
            !out.status.success(),
            "{} succeeded\nstdout: {}\nstderr: {}",
            args.join(" "),
            text(&out.stdout),
            text(&out.stderr)
        );
    }

    /// Records every file under `dir`.
    fn files(&mut self, dir: &Path) {
        for entry in std::fs::read_dir(dir).expect("read the output directory") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                self.files(&path);
            } else {
                let bytes = std::fs::read(&path).expect("read an output file");
                self.seen.push((path.display().to_string(), text(&bytes)));
            }
        }
    }

    /// Panics naming every output that holds a secret.
    fn assert_no_secret(&self) {
        let mut leaks = Vec::new();
        for (what, body) in &self.seen {
            for s in secrets() {
                for form in &s.forms {
                    if let Some(i) = body.find(form) {
                        let line_start = body[..i].rfind('\n').map_or(0, |n| n + 1);
                        let line_end = body[i..].find('\n').map_or(body.len(), |n| i + n);
                        leaks.push(format!(
                            "{form:?} in {what}:\n    {}",
                            &body[line_start..line_end]
                        ));
                    }
                }
            }
        }
        assert!(
            leaks.is_empty(),
            "{} secret(s) printed:\n{}",
            leaks.len(),
            leaks.join("\n")
        );
    }
}

fn args(words: &[&str]) -> Vec<String> {
    words.iter().map(|s| (*s).to_owned()).collect()
}

/// One submission per line, for `idem publish`.
fn submissions(dir: &Path, n: usize) -> String {
    let path = dir.join("submissions.jsonl");
    let body: String = (0..n)
        .map(|i| {
            format!(
                "{{\"award_id\": \"SEC-{i}\", \"submission_timestamp\": \"2026-07-01T09:00:00Z\", \"amount_cents\": {}}}\n",
                100 + i
            )
        })
        .collect();
    std::fs::write(&path, body).expect("write submissions");
    path.display().to_string()
}

#[test]
fn no_command_prints_a_password() {
    let pg = pg_url();
    let redis = redis_host();
    let pg_forms = [
        with_userinfo(&pg, "postgres", "Zq9PgUserinfo"),
        with_param(&pg, "password=Zq9PgQuery"),
        with_param(&pg, "sasl.password=Zq9PgSasl"),
        with_param(&pg, "token=Zq9PgToken"),
        with_userinfo(&pg, "postgres", "Zq9Pct%40Enc%3Apw"),
    ];
    let filter = format!("redis://default:Zq9RedisFilter@{redis}");
    let stream_broker = format!("redis://default:Zq9RedisStream@{redis}");
    let dir = tempfile::tempdir().expect("temp dir");
    let file = submissions(dir.path(), 5);
    let mut t = Transcript::default();

    for (i, store) in pg_forms.iter().enumerate() {
        let schema = format!("sec_{}_{i}", tag());
        let source = format!("sec-in-{}-{i}", tag());
        let dest = format!("sec-out-{}-{i}", tag());
        let s = |w: &[&str]| args(w);
        t.ok(&s(&[
            "demo",
            "--store",
            store,
            "--schema",
            &schema,
            "--submissions",
            "20",
            "--front-filter",
            &filter,
            "--seed",
            "7",
        ]));
        t.ok(&s(&["migrate", "--store", store, "--schema", &schema]));
        t.ok(&s(&[
            "publish",
            "--broker",
            &stream_broker,
            "--destination",
            &source,
            "--file",
            &file,
        ]));
        t.ok(&s(&[
            "consume",
            "--broker",
            &stream_broker,
            "--source",
            &source,
            "--store",
            store,
            "--schema",
            &schema,
            "--front-filter",
            &filter,
            "--exit-when-idle",
            "2",
        ]));
        t.ok(&s(&[
            "relay",
            "--store",
            store,
            "--schema",
            &schema,
            "--broker",
            &stream_broker,
            "--destination",
            &dest,
            "--exit-when-idle",
            "2",
        ]));
        t.ok(&s(&[
            "inspect",
            "--store",
            store,
            "--schema",
            &schema,
            "--award-id",
            "SEC-1",
        ]));
        t.ok(&s(&[
            "inspect",
            "--store",
            store,
            "--schema",
            &schema,
            "--award-id",
            "SEC-1",
            "--broker",
            &stream_broker,
            "--source",
            &source,
        ]));
        t.ok(&s(&[
            "purge",
            "--store",
            store,
            "--schema",
            &schema,
            "--older-than",
            "4y",
            "--dry-run",
        ]));
        // the horizon of the source bounds the purge: refused or not, no password shown
        t.run(
            &s(&[
                "purge",
                "--store",
                store,
                "--schema",
                &schema,
                "--older-than",
                "4y",
                "--dry-run",
                "--broker",
                &stream_broker,
                "--source",
                &source,
            ]),
            &[],
        );
        let export = dir.path().join(format!("export-{i}.jsonl"));
        t.ok(&s(&[
            "audit",
            "export",
            "--store",
            store,
            "--schema",
            &schema,
            "--since",
            "2000-01-01T00:00:00Z",
            "--until",
            "2100-01-01T00:00:00Z",
            "--output",
            &export.display().to_string(),
        ]));
        let report = dir.path().join(format!("report-{i}.html"));
        t.ok(&s(&[
            "audit",
            "report",
            "--store",
            store,
            "--schema",
            &schema,
            "--since",
            "2000-01-01",
            "--until",
            "2100-01-01",
            "--out",
            &report.display().to_string(),
        ]));
    }

    // Failures: a wrong user, a wrong host, a wrong password, a refused parameter.
    let schema = format!("sec_fail_{}", tag());
    let q = format!("sec-fail-{}", tag());
    let wrong_user = with_userinfo(&pg, "postgres", "Zq9PgWrongUser").replacen(
        "://postgres:",
        "://no_such_role_sec:",
        1,
    );
    let wrong_host = "postgres://postgres:Zq9PgWrongHost@127.0.0.1:1/test".to_owned();
    for store in [&wrong_user, &wrong_host] {
        t.fails(&args(&["migrate", "--store", store, "--schema", &schema]));
        t.fails(&args(&[
            "demo",
            "--store",
            store,
            "--schema",
            &schema,
            "--submissions",
            "5",
        ]));
        t.fails(&args(&[
            "consume",
            "--broker",
            &stream_broker,
            "--source",
            &q,
            "--store",
            store,
            "--schema",
            &schema,
            "--exit-when-idle",
            "1",
            "--reconnect-timeout",
            "1",
        ]));
        t.fails(&args(&[
            "relay",
            "--store",
            store,
            "--schema",
            &schema,
            "--broker",
            &stream_broker,
            "--destination",
            &q,
            "--exit-when-idle",
            "1",
            "--reconnect-timeout",
            "1",
        ]));
        t.fails(&args(&[
            "purge",
            "--store",
            store,
            "--schema",
            &schema,
            "--older-than",
            "4y",
            "--dry-run",
        ]));
        t.fails(&args(&[
            "inspect",
            "--store",
            store,
            "--schema",
            &schema,
            "--award-id",
            "x",
        ]));
        t.fails(&args(&[
            "audit",
            "export",
            "--store",
            store,
            "--schema",
            &schema,
            "--since",
            "2000-01-01T00:00:00Z",
            "--until",
            "2100-01-01T00:00:00Z",
        ]));
    }
    let bad_filter = format!("redis://:Zq9RedisFilterBad@{redis}");
    t.fails(&args(&[
        "demo",
        "--store",
        &pg_forms[0],
        "--schema",
        &schema,
        "--submissions",
        "5",
        "--front-filter",
        &bad_filter,
    ]));
    t.fails(&args(&[
        "consume",
        "--broker",
        &stream_broker,
        "--source",
        &q,
        "--store",
        &pg_forms[0],
        "--schema",
        &schema,
        "--front-filter",
        &bad_filter,
        "--exit-when-idle",
        "1",
        "--reconnect-timeout",
        "1",
    ]));
    let amqp = amqp_url();
    let amqp_bad = with_userinfo(&amqp, "guest", "Zq9AmqpBad");
    let amqp_host = "amqp://guest:Zq9AmqpHost@127.0.0.1:1/%2f".to_owned();
    let amqp_token = with_param(&amqp, "token=Zq9AmqpToken");
    let amqp_sasl = with_param(&amqp, "sasl.password=Zq9AmqpSasl");
    for broker in [&amqp_bad, &amqp_host, &amqp_token, &amqp_sasl] {
        t.fails(&args(&[
            "publish",
            "--broker",
            broker,
            "--destination",
            &q,
            "--file",
            &file,
        ]));
        t.fails(&args(&[
            "consume",
            "--broker",
            broker,
            "--source",
            &q,
            "--store",
            &pg_forms[0],
            "--schema",
            &schema,
            "--exit-when-idle",
            "1",
            "--reconnect-timeout",
            "1",
        ]));
        t.fails(&args(&[
            "relay",
            "--store",
            &pg_forms[0],
            "--schema",
            &schema,
            "--broker",
            broker,
            "--destination",
            &q,
            "--exit-when-idle",
            "1",
            "--reconnect-timeout",
            "1",
        ]));
        t.fails(&args(&[
            "purge",
            "--store",
            &pg_forms[0],
            "--schema",
            &schema,
            "--older-than",
            "4y",
            "--dry-run",
            "--broker",
            broker,
            "--source",
            &q,
        ]));
        t.fails(&args(&[
            "inspect",
            "--store",
            &pg_forms[0],
            "--schema",
            &schema,
            "--award-id",
            "x",
            "--broker",
            broker,
            "--source",
            &q,
        ]));
    }
    // NATS with a password and with a token: the server here takes any (it has no
    // users), so every command runs through; async-nats logs the server's URL, secret
    // and all, at its debug level.
    let nats_host = std::env::var("IDEM_TEST_NATS_URL")
        .unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
        .trim_start_matches("nats://")
        .trim_end_matches('/')
        .to_owned();
    for (i, broker) in [
        format!("nats://idem:Zq9NatsPass@{nats_host}"),
        format!("nats://Zq9NatsToken@{nats_host}"),
    ]
    .iter()
    .enumerate()
    {
        let schema = format!("sec_nats_{}_{i}", tag());
        let source = format!("sec-nats-in-{}-{i}", tag());
        let dest = format!("sec-nats-out-{}-{i}", tag());
        t.ok(&args(&[
            "migrate",
            "--store",
            &pg_forms[0],
            "--schema",
            &schema,
        ]));
        t.ok(&args(&[
            "publish",
            "--broker",
            broker,
            "--destination",
            &source,
            "--file",
            &file,
        ]));
        t.ok(&args(&[
            "consume",
            "--broker",
            broker,
            "--source",
            &source,
            "--store",
            &pg_forms[0],
            "--schema",
            &schema,
            "--exit-when-idle",
            "2",
        ]));
        t.ok(&args(&[
            "relay",
            "--store",
            &pg_forms[0],
            "--schema",
            &schema,
            "--broker",
            broker,
            "--destination",
            &dest,
            "--exit-when-idle",
            "2",
        ]));
    }
    t.files(dir.path());
    t.assert_no_secret();
}

#[test]
fn urls_come_from_the_environment_and_help_never_shows_them() {
    let store = with_userinfo(&pg_url(), "postgres", "Zq9EnvStore");
    let schema = format!("sec_env_{}", tag());
    let mut t = Transcript::default();
    // --store from IDEM_STORE, then from DATABASE_URL
    for var in ["IDEM_STORE", "DATABASE_URL"] {
        let out = t.run(&args(&["migrate", "--schema", &schema]), &[(var, &store)]);
        ok(&out, &format!("migrate with {var}"));
    }
    // --broker from IDEM_BROKER and --front-filter from IDEM_FRONT_FILTER
    let redis = redis_host();
    let broker = format!("redis://default:Zq9RedisStream@{redis}");
    let filter = format!("redis://default:Zq9RedisFilter@{redis}");
    let dir = tempfile::tempdir().expect("temp dir");
    let file = submissions(dir.path(), 3);
    let source = format!("sec-env-{}", tag());
    let env = [
        ("IDEM_STORE", store.as_str()),
        ("IDEM_BROKER", broker.as_str()),
        ("IDEM_FRONT_FILTER", filter.as_str()),
    ];
    let out = t.run(
        &args(&["publish", "--destination", &source, "--file", &file]),
        &env,
    );
    ok(&out, "publish with IDEM_BROKER");
    let out = t.run(
        &args(&[
            "consume",
            "--source",
            &source,
            "--schema",
            &schema,
            "--exit-when-idle",
            "2",
        ]),
        &env,
    );
    let stdout = ok(
        &out,
        "consume with IDEM_STORE, IDEM_BROKER, IDEM_FRONT_FILTER",
    );
    assert!(stdout.contains("processed: 3"), "{stdout}");
    // the front filter came from IDEM_FRONT_FILTER: a bad one there fails the run
    let bad_filter = format!("redis://:Zq9RedisFilterBad@{redis}");
    let env_bad = [env[0], env[1], ("IDEM_FRONT_FILTER", bad_filter.as_str())];
    let out = t.run(
        &args(&[
            "consume",
            "--source",
            &source,
            "--schema",
            &schema,
            "--exit-when-idle",
            "1",
            "--reconnect-timeout",
            "1",
        ]),
        &env_bad,
    );
    assert!(
        !out.status.success(),
        "IDEM_FRONT_FILTER was not read: {}",
        text(&out.stderr)
    );
    // a flag still wins over the environment
    let out = t.run(
        &args(&["migrate", "--store", "sqlite://", "--schema", &schema]),
        &[("IDEM_STORE", &store)],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    // --help names the variables, never their values
    for sub in [
        &["migrate"][..],
        &["demo"],
        &["consume"],
        &["relay"],
        &["publish"],
        &["purge"],
        &["inspect"],
        &["audit", "export"],
        &["audit", "report"],
    ] {
        let mut a = args(sub);
        a.push("--help".into());
        let out = t.run(&a, &env);
        let help = ok(&out, &a.join(" "));
        let vars: &[&str] = match sub[0] {
            "publish" => &["IDEM_BROKER"],
            "relay" => &["IDEM_STORE", "IDEM_BROKER"],
            "consume" => &["IDEM_STORE", "IDEM_BROKER", "IDEM_FRONT_FILTER"],
            "demo" => &[],
            _ => &["IDEM_STORE"],
        };
        for v in vars {
            assert!(
                help.contains(v),
                "{} --help does not name {v}:\n{help}",
                sub.join(" ")
            );
        }
    }
    t.assert_no_secret();
}
