//! `idem`: the command for people who run exactly-once consumers.
//!
//! Subcommands: `key`, `demo`, `migrate`, `consume`, `relay`, `publish`, `purge`,
//! `inspect`, `audit export`, and `completions SHELL` and `man [COMMAND]` for the shell
//! and the manual — see `idem --help` and docs/operations.md. With `--json`, a command's
//! results (`consume`, `relay`, `purge`, `inspect`, `audit report`) are one JSON object on
//! stdout instead of `name: value` lines. Bad
//! input gets an error and exit status 2 (a mistake in the arguments: clap's whole
//! message, naming what is wrong and the usage; any other: one line); a failed run
//! exits 1. Logs go to stderr, coloured at a terminal unless `NO_COLOR` is set or
//! `--color never` is given.
//!
//! # Features
//!
//! One cargo feature per broker and per store; a URL whose broker or store is not
//! compiled in is refused with exit 2, naming the feature that brings it
//! (``kafka:// needs the `kafka` feature (not in this build): cargo install idem-cli
//! --features kafka``).
//! SQLite (the demo's store, `sqlite://PATH`) and the in-memory store (`memory://`) are
//! always built.
//!
//! | feature | brings | default | crates it adds¹ | C library built from source |
//! |---|---|---|---|---|
//! | `postgres` | `postgres://` stores (sqlx) | yes | 15 | none |
//! | `redis` | `--front-filter redis://` through `fred` (Redis Streams' client too) | yes | 22 | none |
//! | `redis-rs` | the same front filter through the `redis` crate instead | no | 13 | none |
//! | `rabbitmq` | `amqp://` brokers (lapin) | yes | 10 | none |
//! | `nats` | `nats://` brokers (async-nats) | yes | 51 | none² |
//! | `redis-streams` | `redis://` brokers (fred) | yes | 21 | none |
//! | `tls` | `amqps://`, `rediss://`, Postgres `sslmode=require` and stricter (rustls) | yes | 32³ | none² |
//! | `sqs` | `sqs://` brokers (the AWS SDK, on rustls with ring) | no | 69 | none² |
//! | `kafka` | `kafka://` brokers (rdkafka) | no | 12 | librdkafka, with its configure script and make |
//!
//! ¹ Distinct crates of `cargo tree -e normal` over a build of SQLite alone
//! (`--no-default-features`: 178). The default set makes 300, every feature 356.
//! ² ring (rustls's provider) compiles a few C and assembly files, in seconds.
//! ³ Over the rest of the default set.
//!
//! The default set serves the demo and the brokers and stores with small clients:
//! SQLite, Postgres, the Redis front filter, RabbitMQ, NATS JetStream and Redis Streams,
//! with TLS, and one Redis client (fred) for both Redis jobs. SQS and Kafka are left
//! out: SQS brings the AWS SDK (69 crates, a fifth of every feature's tree); Kafka
//! compiles librdkafka from C with its configure script, the longest single step of a
//! cold build. Neither is needed by the demo. Build them in with `cargo install idem-cli
//! --features sqs,kafka` (or `--all-features`).
// The consume future (broker adapters under the supervised consumer) is deeper than
// the default layout query limit of 128.
#![recursion_limit = "256"]

mod cmd;
mod error;
mod horizon;
mod identity;
mod metrics;
mod out;
mod report;
mod sql_handler;
mod stores;

use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};

pub(crate) use error::CliError;

/// Exactly-once effect for at-least-once consumers.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, propagate_version = true)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = cmd::LogFormat::Text)]
    log_format: cmd::LogFormat,
    /// When to colour logs and errors: `auto` at a terminal unless NO_COLOR is set.
    #[arg(long, global = true, value_enum, value_name = "WHEN", default_value_t = cmd::Color::Auto)]
    color: cmd::Color,
    /// Print the results (consume, relay, purge, inspect, audit report) as one JSON
    /// object instead of `name: value` lines.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Derives a submission's idempotency key (payload from FILE or stdin).
    Key(cmd::key::Args),
    /// Runs the grant pipeline over a simulated at-least-once broker and checks exactly-once.
    Demo(cmd::demo::Args),
    /// Creates or updates the store's tables.
    Migrate(cmd::migrate::Args),
    /// Consumes submissions from a broker into a store.
    Consume(cmd::consume::Args),
    /// Publishes committed outbox events to a broker.
    Relay(cmd::relay::Args),
    /// Publishes each line of a file as one message, unvalidated.
    Publish(cmd::publish::Args),
    /// Deletes dedup records and published outbox rows older than a cutoff.
    Purge(cmd::purge::Args),
    /// Shows whether a key or award was processed, when, and its outbox events.
    Inspect(cmd::inspect::Args),
    /// Exports the audit trail (dedup records and their outbox events) as JSON lines.
    Audit(cmd::audit::Args),
    /// Prints a completion script for SHELL: `idem completions bash > /etc/bash_completion.d/idem`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Prints the manual page (roff) of idem, or of one of its commands: `idem man | man -l -`.
    Man {
        /// A command (`consume`, `purge`, …); none: idem's own page.
        command: Option<String>,
    },
}

/// The manual page of `command` (`None`: idem's own page), as roff.
fn man_page(command: Option<&str>) -> Result<Vec<u8>, CliError> {
    let mut idem = Cli::command();
    idem.build();
    let man = match command {
        None => clap_mangen::Man::new(idem),
        Some(name) => {
            let sub = idem.find_subcommand(name).cloned().ok_or_else(|| {
                CliError::usage(format!("man: no command {name:?} (see idem --help)"))
            })?;
            clap_mangen::Man::new(sub).title(format!("idem-{name}"))
        }
    };
    let mut roff = Vec::new();
    man.render(&mut roff)
        .map_err(|e| CliError::failed(format!("man: {e}")))?;
    Ok(roff)
}

/// Runs the commands that need no runtime (`completions`, `man`); `true` when `command`
/// was one of them.
fn offline(command: &Command) -> bool {
    use std::io::Write as _;
    match command {
        Command::Completions { shell } => {
            clap_complete::generate(*shell, &mut Cli::command(), "idem", &mut std::io::stdout());
            true
        }
        Command::Man { command } => {
            match man_page(command.as_deref()) {
                Ok(roff) => {
                    let _ = std::io::stdout().write_all(&roff);
                }
                Err(e) => {
                    eprintln!("idem: {e}");
                    std::process::exit(e.exit_code());
                }
            }
            true
        }
        _ => false,
    }
}

/// `DATABASE_URL` stands for `--store` where `IDEM_STORE` is unset (each command's
/// `--store` reads `IDEM_STORE`).
fn database_url_fallback() {
    if std::env::var_os("IDEM_STORE").is_none() {
        if let Some(url) = std::env::var_os("DATABASE_URL") {
            // Before any thread starts: nothing else reads the environment yet.
            std::env::set_var("IDEM_STORE", url);
        }
    }
}

/// The `--color` of the command line, read before it is parsed so that clap's own
/// errors follow it too (the last one given wins; an unknown value is left to clap).
fn color_from_args(args: &[std::ffi::OsString]) -> cmd::Color {
    let mut color = cmd::Color::Auto;
    let mut args = args.iter().skip(1).map(|a| a.to_string_lossy());
    while let Some(arg) = args.next() {
        if arg == "--" {
            break;
        }
        let value = match arg.strip_prefix("--color") {
            Some("") => args.next().map(std::borrow::Cow::into_owned),
            Some(v) => v.strip_prefix('=').map(str::to_owned),
            None => None,
        };
        if let Some(c) =
            value.and_then(|v| <cmd::Color as clap::ValueEnum>::from_str(&v, false).ok())
        {
            color = c;
        }
    }
    color
}

/// Parses the command line; a mistake in it is printed whole, as clap words it (what is
/// wrong, the usage and where to find help), and exits 2.
fn parse(args: Vec<std::ffi::OsString>) -> Cli {
    let color = color_from_args(&args);
    let mut command = Cli::command().color(color.clap());
    let parsed = command
        .try_get_matches_from_mut(args)
        .and_then(|mut m| Cli::from_arg_matches_mut(&mut m));
    match parsed {
        Ok(cli) => cli,
        Err(e) => e.format(&mut command).exit(),
    }
}

fn main() {
    database_url_fallback();
    let cli = parse(std::env::args_os().collect());
    out::set_json(cli.json);
    if offline(&cli.command) {
        return;
    }
    let verbose = matches!(&cli.command, Command::Demo(a) if a.verbose());
    let demo = matches!(&cli.command, Command::Demo(_));
    cmd::collect_secrets();
    cmd::init_logging(cli.log_format, cli.color, demo && !verbose);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    // The command runs in a task of the runtime's, not in `block_on`'s own future: that
    // future is polled on this thread, which is no worker and does not poll the sockets,
    // so every answer from a server (four per message) would be a worker waking this
    // thread. On a worker, the thread that sees a socket ready polls the task itself.
    let command = runtime.spawn(async move {
        match cli.command {
            Command::Key(a) => cmd::key::run(a).await,
            Command::Demo(a) => cmd::demo::run(a).await,
            Command::Migrate(a) => cmd::migrate::run(a).await,
            Command::Consume(a) => cmd::consume::run(a).await,
            Command::Relay(a) => cmd::relay::run(a).await,
            Command::Publish(a) => cmd::publish::run(a).await,
            Command::Purge(a) => cmd::purge::run(a).await,
            Command::Inspect(a) => cmd::inspect::run(a).await,
            Command::Audit(a) => cmd::audit::run(a).await,
            Command::Completions { .. } | Command::Man { .. } => Ok(()),
        }
    });
    let result = match runtime.block_on(command) {
        Ok(result) => result,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => {
                eprintln!("idem: the command's task was cancelled: {e}");
                std::process::exit(1);
            }
        },
    };
    if let Err(e) = result {
        eprintln!("idem: {e}");
        std::process::exit(e.exit_code());
    }
}

#[cfg(test)]
#[path = "../tests/cli/common/doc_commands.rs"]
mod doc_commands;

#[cfg(test)]
mod tests {
    use clap::{CommandFactory as _, Parser as _};

    use super::{Cli, Command};

    /// `command` as a documented line runs it: no argument read from this process's
    /// environment (each line must say what it means), and the variables the line assigns
    /// (`IDEM_STORE=… idem …`, or `DATABASE_URL`, which `idem` reads when `IDEM_STORE` is
    /// unset) given to the arguments that read them.
    fn as_documented(command: clap::Command, env: &[(String, String)]) -> clap::Command {
        let value = |name: &str| {
            env.iter()
                .rev()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let store = value("IDEM_STORE").or_else(|| value("DATABASE_URL"));
        command
            .mut_args(|a| {
                let given = match a.get_env().and_then(|n| n.to_str()) {
                    Some("IDEM_STORE") => store.clone(),
                    Some(n) => value(n),
                    None => None,
                };
                let a = a.env(None);
                match given {
                    // As the variable would: the argument is given.
                    Some(v) => a
                        .required(false)
                        .default_value(&*Box::leak(v.into_boxed_str())),
                    None => a,
                }
            })
            .mut_subcommands(|s| as_documented(s, env))
    }

    /// Every `idem …` line of the docs parses with this parser, as `main` parses it.
    #[test]
    fn every_documented_idem_command_parses() {
        let mut failures = Vec::new();
        let documented = crate::doc_commands::documented_invocations();
        for (at, line, (args, env)) in &documented {
            let mut command = as_documented(Cli::command(), env);
            let argv = std::iter::once("idem".to_owned()).chain(args.iter().cloned());
            let parsed = command
                .try_get_matches_from_mut(argv)
                .and_then(|mut m| <Cli as clap::FromArgMatches>::from_arg_matches_mut(&mut m));
            if let Err(e) = parsed {
                failures.push(format!("{at}: `{line}` does not parse:\n{e}"));
            }
        }
        assert!(
            documented.len() > 20,
            "the docs show their commands: {}",
            documented.len()
        );
        assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    }

    /// The test above can fail: a line with an option no command has is refused.
    #[test]
    fn an_undocumented_option_does_not_parse() {
        let command = as_documented(Cli::command(), &[]);
        assert!(command
            .try_get_matches_from(["idem", "key", "--no-such-option"])
            .is_err());
    }

    #[test]
    fn an_award_id_or_timestamp_may_begin_with_a_hyphen() {
        let cli =
            Cli::try_parse_from(["idem", "key", "--award-id", "-4C-2026", "--timestamp", "-1"])
                .expect("award ids are data, not options");
        assert!(matches!(cli.command, Command::Key(_)));
    }

    #[test]
    fn help_lists_all_five_brokers() {
        for sub in ["consume", "relay", "publish"] {
            let mut cmd = Cli::command();
            let help = cmd
                .find_subcommand_mut(sub)
                .expect("subcommand")
                .render_long_help()
                .to_string();
            for name in [
                "amqp://",
                "nats://",
                "redis://",
                "sqs://",
                "kafka://",
                "RabbitMQ",
                "NATS JetStream",
                "Redis Streams",
                "Amazon SQS",
                "Kafka",
            ] {
                assert!(help.contains(name), "{sub} --help lacks {name}:\n{help}");
            }
        }
    }

    #[test]
    fn broker_mistakes_exit_2_and_failures_exit_1() {
        use idem_broker::BrokerError;
        let usage = crate::cmd::broker_error("x", &BrokerError::InvalidUrl("bad".into()));
        assert_eq!(usage.exit_code(), 2);
        let failed = crate::cmd::broker_error(
            "x",
            &BrokerError::Connect {
                broker: "nats",
                source: "refused".into(),
            },
        );
        assert_eq!(failed.exit_code(), 1);
    }

    #[test]
    fn a_url_whose_broker_is_not_built_in_names_its_feature() {
        use idem_broker::any::BrokerKind;
        let none = |_: BrokerKind| false;
        let all = |_: BrokerKind| true;
        use crate::cmd::missing_broker_feature as missing;
        for (scheme, feature) in [
            ("amqp", "rabbitmq"),
            ("amqps", "rabbitmq"),
            ("nats", "nats"),
            ("tls", "nats"),
            ("redis", "redis-streams"),
            ("rediss", "redis-streams"),
            ("sqs", "sqs"),
            ("kafka", "kafka"),
            ("KAFKA", "kafka"),
        ] {
            assert_eq!(missing(scheme, none, true), Some(feature), "{scheme}");
            assert_eq!(missing(scheme, all, true), None, "{scheme}");
        }
        // A TLS scheme on a build with its broker but without TLS names `tls`.
        assert_eq!(missing("amqps", all, false), Some("tls"));
        assert_eq!(missing("rediss", all, false), Some("tls"));
        assert_eq!(missing("amqp", all, false), None);
        assert_eq!(
            missing("tls", all, false),
            None,
            "NATS speaks TLS without it"
        );
        assert_eq!(
            missing("ftp", none, false),
            None,
            "an unknown scheme is no feature"
        );
        let only_kafka_off = |k: BrokerKind| k != BrokerKind::Kafka;
        assert_eq!(missing("kafka", only_kafka_off, true), Some("kafka"));
        assert_eq!(missing("sqs", only_kafka_off, true), None);

        let e = crate::cmd::broker_error(
            "--broker",
            &idem_broker::BrokerError::Unsupported {
                scheme: "kafka".into(),
                hint: "rebuild idem-broker with the \"kafka\" feature".into(),
            },
        );
        if cfg!(feature = "kafka") {
            assert!(!e.to_string().contains("cargo install"), "{e}");
        } else {
            assert_eq!(e.exit_code(), 2);
            assert_eq!(
                e.to_string(),
                "--broker: kafka:// needs the `kafka` feature (not in this build): \
                 cargo install idem-cli --features kafka"
            );
        }
    }

    #[test]
    fn a_store_url_not_built_in_names_its_feature() {
        let e = crate::stores::not_compiled("postgres://", "postgres");
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            e.to_string(),
            "postgres:// needs the `postgres` feature (not in this build): \
             cargo install idem-cli --features postgres"
        );
        let parsed = crate::stores::StoreUrl::parse("postgres://u@h/db");
        assert_eq!(parsed.is_ok(), cfg!(feature = "postgres"));
        if let Err(e) = parsed {
            assert!(e.to_string().contains("--features postgres"), "{e}");
        }
        let filter = crate::stores::StoreSpec::new(
            "sqlite:///tmp/x.db",
            None,
            Some("redis://127.0.0.1:6379".into()),
        );
        assert_eq!(
            filter.is_ok(),
            cfg!(any(feature = "redis", feature = "redis-rs"))
        );
        if let Err(e) = filter {
            assert!(e.to_string().contains("--features redis"), "{e}");
        }
    }

    #[test]
    fn color_follows_the_flag_then_no_color_then_clicolor_force() {
        use crate::cmd::Color;
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| std::ffi::OsString::from(v))
            }
        };
        let ansi = |c: Color, pairs, terminal| c.ansi(env(pairs), terminal);
        assert!(ansi(Color::Auto, &[], true));
        assert!(!ansi(Color::Auto, &[], false));
        assert!(!ansi(Color::Auto, &[("NO_COLOR", "1")], true));
        // An empty NO_COLOR does not count (no-color.org).
        assert!(ansi(Color::Auto, &[("NO_COLOR", "")], true));
        assert!(ansi(Color::Auto, &[("CLICOLOR_FORCE", "1")], false));
        assert!(!ansi(Color::Auto, &[("CLICOLOR_FORCE", "0")], false));
        assert!(!ansi(
            Color::Auto,
            &[("CLICOLOR_FORCE", "1"), ("NO_COLOR", "1")],
            true
        ));
        assert!(ansi(Color::Always, &[("NO_COLOR", "1")], false));
        assert!(!ansi(Color::Never, &[("CLICOLOR_FORCE", "1")], true));
    }

    #[test]
    fn the_color_flag_is_read_before_parsing() {
        use crate::cmd::Color;
        let read = |args: &[&str]| {
            let args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
            super::color_from_args(&args)
        };
        assert_eq!(read(&["idem", "demo"]), Color::Auto);
        assert_eq!(read(&["idem", "--color", "never", "demo"]), Color::Never);
        assert_eq!(read(&["idem", "demo", "--color=always"]), Color::Always);
        assert_eq!(read(&["idem", "--color", "bogus", "demo"]), Color::Auto);
        assert_eq!(
            read(&["idem", "key", "--", "--color", "never"]),
            Color::Auto
        );
    }

    #[test]
    fn durations_take_seconds_or_friendly_units_and_a_year_means_one_thing() {
        use std::time::Duration;
        let p = crate::cmd::parse_secs;
        assert_eq!(p("3"), Ok(Duration::from_secs(3)));
        assert_eq!(p("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(p("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(p("1m 30s"), Ok(Duration::from_secs(90)));
        assert!(p("0").is_err() && p("-1").is_err() && p("soon").is_err() && p("0s").is_err());
        let d = crate::cmd::parse_duration;
        assert!(
            d("3y").is_err(),
            "a timer has no calendar to count a year on"
        );
        // A purge age and a retention floor count the same calendar years.
        let floor = crate::cmd::parse_floor("3y").unwrap();
        assert_eq!(floor, idem_engine::retention::RetentionFloor::Years(3));
        assert_eq!(d("90d"), Ok(Duration::from_secs(90 * 86_400)));
        assert_eq!(d("1h 30m"), Ok(Duration::from_secs(5400)));
        assert!(d("3 fortnights").is_err());
    }
}
