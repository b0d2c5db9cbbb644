//! `idem relay`: committed outbox events to a broker, at least once, each with its
//! deterministic event id (so the next consumer dedups them).

use std::time::{Duration, Instant};

use futures::FutureExt as _;

use idem_broker::any::{AnyPublisher, BrokerUrl};
use idem_core::{OutboxSource, Relay, RelayStats};
use idem_grant::GrantDb;
use idem_store_postgres::{PgConfig, PgOutboxSource, PgStore};
use idem_store_sqlite::{SqliteConfig, SqliteOutboxSource, SqliteStore};

use super::consume::broker_error;
use crate::error::error_chain;
use crate::stores::{StoreSpec, StoreUrl};
use crate::CliError;

/// Events per transaction.
const BATCH: usize = 100;
/// How often an idle SQLite relay looks for new events (Postgres is notified).
const POLL: Duration = Duration::from_millis(200);

/// Arguments of `idem relay`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The store: sqlite://PATH or postgres://…
    #[arg(long)]
    store: String,
    /// The Postgres schema.
    #[arg(long)]
    schema: Option<String>,
    /// The broker: amqp://…, nats://… or redis://… (Redis Streams).
    #[arg(long)]
    broker: String,
    /// The queue / stream to publish to (created if missing).
    #[arg(long, value_name = "NAME")]
    destination: String,
    /// Stop once no event was waiting for SECS seconds.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    exit_when_idle: Option<Duration>,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    if let Ok(secs) = s.parse::<f64>() {
        if secs.is_finite() && secs > 0.0 && secs < 1e9 {
            return Ok(Duration::from_secs_f64(secs));
        }
        return Err(format!("{s:?} is not a positive number of seconds"));
    }
    crate::cmd::parse_duration(s)
}

/// Runs `relay` until shutdown, or until idle for `idle`.
async fn drive<S: OutboxSource>(
    relay: Relay<S, AnyPublisher>,
    idle: Option<Duration>,
) -> Result<RelayStats, CliError> {
    let fail = |e: idem_core::Error| CliError::failed(format!("relay: {}", error_chain(&e)));
    let Some(idle) = idle else {
        return relay.run(crate::cmd::shutdown_signal()).await.map_err(fail);
    };
    let mut stats = RelayStats::default();
    let shutdown = crate::cmd::shutdown_signal();
    tokio::pin!(shutdown);
    let mut last_work = Instant::now();
    loop {
        // Between batches only: the batch in hand is always finished.
        if (&mut shutdown).now_or_never().is_some() {
            return Ok(stats);
        }
        match relay.run_once().await {
            Ok(0) => {
                if last_work.elapsed() >= idle {
                    return Ok(stats);
                }
                let rest = idle.saturating_sub(last_work.elapsed());
                tokio::select! {
                    () = &mut shutdown => return Ok(stats),
                    r = relay.source().wait() => r.map_err(|e| fail(e.into()))?,
                    () = tokio::time::sleep(rest) => {}
                }
            }
            Ok(n) => {
                stats.published += n as u64;
                last_work = Instant::now();
            }
            Err(e) if e.is_retryable() => {
                stats.failed_batches += 1;
                tracing::warn!(target: "idem::relay", error = %e, "relay batch failed; will retry");
                tokio::time::sleep(POLL).await;
            }
            Err(e) => return Err(fail(e)),
        }
    }
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let broker = BrokerUrl::parse(&args.broker).map_err(|e| broker_error("--broker", &e))?;
    let spec = StoreSpec::new(&args.store, args.schema.clone(), None)?;
    let publisher = AnyPublisher::connect(&broker, &args.destination)
        .await
        .map_err(|e| broker_error(&format!("{} {}", broker.kind(), broker), &e))?;
    let started = Instant::now();
    let stats = match &spec.url {
        StoreUrl::Memory => {
            return Err(CliError::usage(
                "idem relay needs a durable store: sqlite://PATH or postgres://…",
            ))
        }
        StoreUrl::Postgres(url) => {
            let schema = args.schema.unwrap_or_else(|| "public".to_owned());
            let config = PgConfig::new(schema).map_err(|e| CliError::usage(e.to_string()))?;
            let store = PgStore::connect(url, config).await?;
            store.migrate_grants().await?;
            let source = PgOutboxSource::new(store, POLL);
            drive(Relay::new(source, publisher, BATCH), args.exit_when_idle).await?
        }
        StoreUrl::Sqlite(path) => {
            let store = SqliteStore::open(path, SqliteConfig::default()).await?;
            store.migrate_grants().await?;
            let source = SqliteOutboxSource::new(store, POLL);
            drive(Relay::new(source, publisher, BATCH), args.exit_when_idle).await?
        }
    };
    println!("destination: {}", args.destination);
    println!("published: {}", stats.published);
    println!("failed_batches: {}", stats.failed_batches);
    println!("seconds: {:.3}", started.elapsed().as_secs_f64());
    Ok(())
}
