//! What a newcomer meets first: the demo's output, argument mistakes, colours, and a URL
//! whose broker or store this build does not have. Run as a user runs the binary.

use std::process::{Command, Output};

use crate::common;

use common::{output_within, text, COMMAND_LIMIT};

/// `idem ARGS` with `env` set, and none of the variables these tests are about inherited.
fn idem_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args);
    for name in [
        "NO_COLOR",
        "CLICOLOR_FORCE",
        "CLICOLOR",
        "RUST_LOG",
        "IDEM_STORE",
        "IDEM_BROKER",
        "DATABASE_URL",
    ] {
        cmd.env_remove(name);
    }
    cmd.envs(env.iter().copied());
    output_within(&mut cmd, COMMAND_LIMIT)
}

/// A small demo with many crashes, on a new SQLite file.
fn demo(extra: &[&str], env: &[(&str, &str)]) -> (Output, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = format!("sqlite://{}", dir.path().join("demo.db").display());
    let mut args = vec![
        "demo",
        "--store",
        &store,
        "--submissions",
        "300",
        "--crash-rate",
        "0.2",
        "--poison-rate",
        "0.05",
        "--seed",
        "11",
    ];
    args.extend_from_slice(extra);
    (idem_with(&args, env), dir)
}

fn report_value(out: &str, name: &str) -> u64 {
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .unwrap_or_else(|| panic!("no `{name}:` line in\n{out}"))
        .parse()
        .expect("a number")
}

/// The colour a log line's `WARN` level gets.
const YELLOW: &str = "\x1b[33m";

#[test]
fn the_demo_reports_its_crashes_without_warnings_and_explains_itself() {
    let (o, _dir) = demo(&[], &[]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.ends_with("exactly-once: OK\n"), "{out}");
    let crashes = report_value(&out, "crashes");
    assert!(crashes > 20, "crashes were injected: {out}");
    // No warning (nor any log line) for a crash the demo injected on purpose.
    assert!(!err.contains("WARN"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // The closing explanation counts them as simulated, and says where to look.
    let prose = err.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        prose.contains(&format!("Simulated crashes: {crashes} (")),
        "{err}"
    );
    assert!(prose.contains("on purpose"), "{err}");
    assert!(prose.contains("That is exactly-once."), "{err}");
    for command in [
        "idem inspect --store sqlite://",
        "idem audit export --store sqlite://",
    ] {
        assert!(err.contains(command), "{command}: {err}");
    }
    assert!(err.contains("--verbose"), "{err}");
}

#[test]
fn the_demo_explanation_names_commands_that_work() {
    let (o, _dir) = demo(&[], &[]);
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    for prefix in ["idem inspect ", "idem audit export "] {
        let line = err
            .lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line in\n{err}"));
        let line = line.split(" | ").next().unwrap_or(line);
        let mut args: Vec<&str> = prefix.split_whitespace().skip(1).collect();
        args.extend(line.split_whitespace());
        let run = idem_with(&args, &[]);
        let out = text(&run.stdout);
        assert!(
            run.status.success(),
            "idem {args:?}: {out}\n{}",
            text(&run.stderr)
        );
        match prefix {
            "idem inspect " => assert!(out.starts_with("processed: yes\n"), "{out}"),
            _ => assert!(out.lines().count() > 100, "the run's claims: {out}"),
        }
    }
}

#[test]
fn the_demo_shows_its_logs_with_verbose() {
    let (o, _dir) = demo(&["--verbose"], &[]);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.ends_with("exactly-once: OK\n"), "{out}");
    assert!(err.contains("WARN"), "{err}");
    assert!(err.contains("the handler panicked"), "{err}");
    // Not at a terminal, nothing asked for colour: none.
    assert!(!err.contains('\x1b'), "{err:?}");
}

#[test]
fn logs_are_coloured_as_color_and_the_environment_say() {
    let coloured = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["--verbose"];
        args.extend_from_slice(extra);
        let (o, _dir) = demo(&args, env);
        let err = text(&o.stderr);
        assert!(o.status.success(), "{err}");
        assert!(err.contains("WARN"), "{err}");
        err.contains(YELLOW)
    };
    assert!(coloured(&["--color", "always"], &[]));
    assert!(coloured(&["--color=always"], &[("NO_COLOR", "1")]));
    assert!(!coloured(&["--color", "never"], &[("CLICOLOR_FORCE", "1")]));
    assert!(coloured(&[], &[("CLICOLOR_FORCE", "1")]));
    assert!(!coloured(
        &[],
        &[("CLICOLOR_FORCE", "1"), ("NO_COLOR", "1")]
    ));
    assert!(!coloured(&["--color", "auto"], &[]));
}

/// At a terminal (a pseudo-terminal from util-linux's `script`), logs are coloured unless
/// `NO_COLOR` is set.
#[test]
fn at_a_terminal_no_color_turns_log_colours_off() {
    let at_terminal = |env: &[(&str, &str)]| {
        let dir = tempfile::tempdir().expect("tempdir");
        let command = format!(
            "{} demo --store sqlite://{} --submissions 200 --crash-rate 0.2 --seed 3 --verbose",
            env!("CARGO_BIN_EXE_idem"),
            dir.path().join("t.db").display()
        );
        let mut cmd = Command::new("script");
        cmd.args(["-qec", &command, "/dev/null"]);
        for name in ["NO_COLOR", "CLICOLOR_FORCE", "RUST_LOG"] {
            cmd.env_remove(name);
        }
        cmd.envs(env.iter().copied());
        let o = output_within(&mut cmd, COMMAND_LIMIT);
        let all = text(&o.stdout);
        assert!(o.status.success(), "{all}");
        assert!(all.contains("WARN"), "{all}");
        all.contains(YELLOW)
    };
    assert!(at_terminal(&[]), "coloured at a terminal");
    assert!(!at_terminal(&[("NO_COLOR", "1")]), "NO_COLOR");
}

#[test]
fn an_argument_mistake_is_shown_whole() {
    let o = idem_with(&["consume", "--broker", "x"], &[]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    // clap's message: which arguments are missing, by name, and the usage.
    assert!(
        err.contains("required arguments were not provided"),
        "{err}"
    );
    assert!(err.contains("--source <NAME>"), "{err}");
    assert!(err.contains("--store <STORE>"), "{err}");
    assert!(err.contains("Usage: idem consume"), "{err}");
    assert!(err.contains("--help"), "{err}");

    let o = idem_with(&["demo", "--redeliveries", "2"], &[]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("'--redeliveries <REDELIVERIES>'"), "{err}");
    assert!(err.contains("2 is not a fraction between 0 and 1"), "{err}");
    assert!(err.contains("try '--help'"), "{err}");
    assert!(!err.contains('\x1b'), "no colour in a pipe: {err:?}");

    // --help and --version still go to stdout with exit 0.
    let o = idem_with(&["--version"], &[]);
    assert!(
        o.status.success() && text(&o.stdout).starts_with("idem "),
        "{o:?}"
    );
}

#[test]
fn argument_mistakes_are_coloured_as_color_says() {
    let err = |args: &[&str], env: &[(&str, &str)]| {
        let o = idem_with(args, env);
        assert_eq!(o.status.code(), Some(2), "{o:?}");
        text(&o.stderr)
    };
    assert!(err(&["--color", "always", "consume", "--broker", "x"], &[]).contains('\x1b'));
    assert!(err(&["consume", "--broker", "x"], &[("CLICOLOR_FORCE", "1")]).contains('\x1b'));
    assert!(!err(
        &["consume", "--broker", "x", "--color", "never"],
        &[("CLICOLOR_FORCE", "1")]
    )
    .contains('\x1b'));
    assert!(!err(
        &["consume", "--broker", "x"],
        &[("CLICOLOR_FORCE", "1"), ("NO_COLOR", "1")]
    )
    .contains('\x1b'));
}

/// Each broker and store URL is refused with exit 2 naming its feature when this build
/// lacks it (`cargo test -p idem-cli` with the default features runs the SQS and Kafka
/// rows; the unit tests check the same mapping for every broker in every build).
#[test]
fn a_url_not_built_in_names_the_feature_that_brings_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sqlite = format!("sqlite://{}", dir.path().join("f.db").display());
    let consume = |broker: &str| {
        vec![
            "consume".to_owned(),
            "--broker".into(),
            broker.into(),
            "--source".into(),
            "q".into(),
            "--store".into(),
            sqlite.clone(),
            "--reconnect-timeout".into(),
            "1".into(),
        ]
    };
    let rows: Vec<(&str, bool, Vec<String>)> = vec![
        (
            "kafka",
            cfg!(feature = "kafka"),
            consume("kafka://127.0.0.1:1"),
        ),
        ("sqs", cfg!(feature = "sqs"), consume("sqs://127.0.0.1:1")),
        (
            "rabbitmq",
            cfg!(feature = "rabbitmq"),
            consume("amqp://127.0.0.1:1"),
        ),
        (
            "nats",
            cfg!(feature = "nats"),
            consume("nats://127.0.0.1:1"),
        ),
        (
            "redis-streams",
            cfg!(feature = "redis-streams"),
            consume("redis://127.0.0.1:1"),
        ),
        (
            "postgres",
            cfg!(feature = "postgres"),
            vec![
                "migrate".into(),
                "--store".into(),
                "postgres://postgres@127.0.0.1:1/test?connect_timeout=1".into(),
            ],
        ),
        (
            "redis",
            cfg!(any(feature = "redis", feature = "redis-rs")),
            vec![
                "demo".into(),
                "--submissions".into(),
                "10".into(),
                "--store".into(),
                sqlite.clone(),
                "--front-filter".into(),
                "redis://127.0.0.1:1".into(),
            ],
        ),
    ];
    for (feature, built_in, args) in rows {
        if built_in {
            // Connecting is the business of each broker's and store's own tests.
            continue;
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = idem_with(&args, &[]);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{feature}: {err}");
        assert!(err.contains(&format!("`{feature}` feature")), "{err}");
        assert!(
            err.contains(&format!("cargo install idem-cli --features {feature}")),
            "{err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

#[test]
fn completions_and_man_pages_are_generated_for_every_command() {
    for (shell, mark) in [
        ("bash", "_idem()"),
        ("zsh", "#compdef idem"),
        ("fish", "complete -c idem"),
        ("elvish", "edit:completion:arg-completer[idem]"),
        ("powershell", "Register-ArgumentCompleter"),
    ] {
        let o = idem_with(&["completions", shell], &[]);
        let out = text(&o.stdout);
        assert!(o.status.success(), "{shell}: {}", text(&o.stderr));
        assert!(out.contains(mark), "{shell}: no {mark:?} in\n{out}");
        for sub in ["consume", "purge", "audit"] {
            assert!(out.contains(sub), "{shell} completes no {sub}");
        }
    }
    let o = idem_with(&["completions", "tcsh"], &[]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );

    let o = idem_with(&["man"], &[]);
    let page = text(&o.stdout);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        page.starts_with(".ie \\n(.g .ds Aq") || page.contains(".TH idem"),
        "{page}"
    );
    assert!(page.contains(".TH idem"), "{page}");
    assert!(page.contains("consume"), "{page}");
    let o = idem_with(&["man", "consume"], &[]);
    let page = text(&o.stdout);
    assert!(page.contains(".TH idem-consume"), "{page}");
    assert!(page.contains("\\-\\-broker"), "{page}");
    let o = idem_with(&["man", "nothing"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("no command \"nothing\""));
}

/// `--json` gives the same results as one JSON object: `inspect` and `purge` over the
/// demo's store, with the values their lines show.
#[test]
fn json_results_carry_what_the_lines_show() {
    let (o, dir) = demo(&[], &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let store = format!("sqlite://{}", dir.path().join("demo.db").display());
    let err = text(&o.stderr);
    let award = err
        .lines()
        .find_map(|l| l.trim().strip_prefix("idem inspect "))
        .and_then(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "--award-id")?;
            words.next().map(str::to_owned)
        })
        .unwrap_or_else(|| panic!("no inspect line with --award-id in\n{err}"));
    let lines = idem_with(&["inspect", "--store", &store, "--award-id", &award], &[]);
    let json = idem_with(
        &["inspect", "--store", &store, "--award-id", &award, "--json"],
        &[],
    );
    assert!(json.status.success(), "{}", text(&json.stderr));
    let v: serde_json::Value = serde_json::from_str(text(&json.stdout).trim()).expect("one object");
    assert_eq!(v["processed"], true);
    let claims = v["claims"].as_array().expect("claims");
    assert_eq!(
        claims.len() as u64,
        report_value(&text(&lines.stdout), "claims")
    );
    assert_eq!(claims[0]["subject"], award.as_str());
    assert_eq!(claims[0]["award_id"], award.as_str());
    assert_eq!(claims[0]["key"].as_str().map(str::len), Some(64));
    assert!(claims[0]["events"]
        .as_array()
        .is_some_and(|e| !e.is_empty()));

    // Every claim older than the cutoff before either run: both count the same rows.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let purge = |extra: &[&str]| {
        let mut args = vec![
            "purge",
            "--store",
            &store,
            "--older-than",
            "1s",
            "--allow-below-floor",
            "--dry-run",
        ];
        args.extend_from_slice(extra);
        idem_with(&args, &[])
    };
    let lines = purge(&[]);
    let json = purge(&["--json"]);
    assert!(json.status.success(), "{}", text(&json.stderr));
    let v: serde_json::Value = serde_json::from_str(text(&json.stdout).trim()).expect("one object");
    assert_eq!(v["dry_run"], true);
    for name in ["dedup_records", "outbox_events", "batches"] {
        assert_eq!(
            v[name].as_u64(),
            Some(report_value(&text(&lines.stdout), name)),
            "{name}"
        );
    }
}
