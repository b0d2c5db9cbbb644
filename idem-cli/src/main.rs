//! `idem`: the command for people who run exactly-once consumers.
//!
//! Subcommands: `key`, `demo`, `migrate`, `consume`, `relay`, `publish`, `purge`,
//! `inspect`, `audit export` — see `idem --help` and DESIGN.md's command contract. Bad
//! input gets a one-line error and exit status 2; a failed run exits 1.
// The consume future (broker adapters under the supervised consumer) is deeper than
// the default layout query limit of 128.
#![recursion_limit = "256"]

mod cmd;
mod error;
mod horizon;
mod metrics;
mod report;
mod stores;

use clap::{Parser, Subcommand};

pub(crate) use error::CliError;

/// Exactly-once effect for at-least-once consumers.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, propagate_version = true)]
struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = cmd::LogFormat::Text)]
    log_format: cmd::LogFormat,
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

fn main() {
    database_url_fallback();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() => {
            // One line, as for every other bad input: clap's first line names the problem.
            let text = e.to_string();
            let line = text.lines().next().unwrap_or("invalid arguments");
            eprintln!(
                "idem: {} (see idem --help)",
                line.trim_start_matches("error: ")
            );
            std::process::exit(2);
        }
        Err(e) => e.exit(),
    };
    cmd::init_logging(cli.log_format);
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
    let result = runtime.block_on(async move {
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
        }
    });
    if let Err(e) = result {
        eprintln!("idem: {e}");
        std::process::exit(e.exit_code());
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory as _, Parser as _};

    use super::{Cli, Command};

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
    fn durations_take_seconds_or_humantime() {
        use std::time::Duration;
        let p = crate::cmd::parse_secs;
        assert_eq!(p("3"), Ok(Duration::from_secs(3)));
        assert_eq!(p("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(p("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(p("1m 30s"), Ok(Duration::from_secs(90)));
        assert!(p("0").is_err() && p("-1").is_err() && p("soon").is_err() && p("0s").is_err());
        let d = crate::cmd::parse_duration;
        assert_eq!(d("3y"), Ok(Duration::from_secs(3 * 365 * 86_400)));
        assert_eq!(d("90d"), Ok(Duration::from_secs(90 * 86_400)));
        assert_eq!(d("1h 30m"), Ok(Duration::from_secs(5400)));
        assert!(d("3 fortnights").is_err());
    }
}
