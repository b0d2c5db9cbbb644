//! `idem relay`: committed outbox events to a broker, at least once, each with its
//! deterministic event id (so the next consumer dedups them). A thin call of
//! [`idem_engine::Relay::run`] with `idem-runtime`'s timer and reconnecting publisher: every
//! failed batch (store or broker down) is released and retried after a capped, jittered
//! backoff on a new broker connection; failures lasting longer than `--reconnect-timeout`
//! (default 60 s) are a one-line error and exit 1. An event the broker refuses for good 5
//! times is moved aside (`failed_at` in the outbox) instead of blocking the rest.
//!
//! `--metrics-addr ADDR` serves events published, batches retried, events moved aside,
//! and the outbox backlog with the age of its oldest unpublished event (measured at each
//! scrape). `--no-migrate` leaves the tables alone, for a role that may only read the
//! outbox and mark it published.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_broker::any::BrokerUrl;
use idem_engine::{OutboxSource, Relay, RelayStats};
#[cfg(feature = "postgres")]
use idem_store_postgres::PgOutboxSource;
use idem_store_sqlite::SqliteOutboxSource;

use crate::cmd::{broker_error, parse_secs, Opened};
use crate::error::error_chain;
use crate::stores::StoreSpec;
use crate::CliError;
use idem_runtime::metrics::RelayMetrics;

/// How often an idle SQLite relay looks for new events (Postgres is notified).
const POLL: Duration = Duration::from_millis(200);

/// Arguments of `idem relay`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    store: super::StoreArgs,
    #[arg(long, value_name = "URL", env = "IDEM_BROKER", hide_env_values = true, help = super::BROKER_HELP)]
    broker: String,
    /// The queue / stream to publish to (created if missing).
    #[arg(long, value_name = "NAME")]
    destination: String,
    /// Stop once no event was waiting for this long (`5`, `500ms`, `2m`).
    #[arg(long, value_name = "DURATION", value_parser = parse_secs)]
    exit_when_idle: Option<Duration>,
    /// Give up (exit 1) when the broker or the store stays unreachable this long.
    #[arg(long, value_name = "DURATION", value_parser = parse_secs, default_value = "60")]
    reconnect_timeout: Duration,
    /// Events per batch (one transaction, one pipelined publish).
    #[arg(long, value_name = "N", default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: u32,
    /// Batches in flight at once (each leased, published and marked on its own; per
    /// subject, order is kept whatever the number).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    in_flight: u32,
    /// Serve Prometheus metrics over HTTP at ADDR (e.g. 127.0.0.1:9899).
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Do not create or upgrade tables at start (for a least-privilege role, after the
    /// schema's owner ran `idem migrate`); the outbox must exist and be readable.
    #[arg(long)]
    no_migrate: bool,
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let broker = BrokerUrl::parse(&args.broker).map_err(|e| broker_error("--broker", &e))?;
    let spec = StoreSpec::new(&args.store.url, args.store.schema.clone(), None)?;
    let timeout = args.reconnect_timeout;
    let publisher = super::connect_publisher(broker, &args.destination, timeout).await?;
    let counters = Arc::new(RelayMetrics::default());
    let store = super::open_durable(&spec, !args.no_migrate, timeout).await?;
    if let Some(addr) = args.metrics_addr {
        crate::metrics::serve_relay(addr, &counters, store.db()).await?;
    }
    let options = idem_runtime::relay_options()
        .batch_size(args.batch_size as usize)
        .exit_when_idle(args.exit_when_idle)
        .give_up_after(Some(timeout))
        .in_flight(args.in_flight as usize)
        .observer(Arc::clone(&counters) as Arc<dyn idem_engine::RelayObserver>);
    let shutdown = crate::cmd::shutdown_signal();
    let started = Instant::now();
    let stats = match store {
        #[cfg(feature = "postgres")]
        Opened::Pg(pg) => {
            let source = PgOutboxSource::new(pg, POLL);
            drive(
                Relay::with_options(source, publisher, options),
                shutdown,
                timeout,
            )
            .await?
        }
        Opened::Lite(lite) => {
            let source = SqliteOutboxSource::new(lite, POLL);
            drive(
                Relay::with_options(source, publisher, options),
                shutdown,
                timeout,
            )
            .await?
        }
    };
    let mut out = crate::out::Out::new();
    out.field("destination", args.destination.as_str());
    // From the start to the last batch marked: the time there was work.
    let last = counters.last_published();
    let busy = last.map_or(Duration::ZERO, |l| l.duration_since(started));
    super::report(
        out,
        &[
            ("published", stats.published),
            ("failed_batches", stats.failed_batches),
            ("moved_aside", stats.moved_aside),
        ],
        started,
        busy,
        stats.published,
    );
    Ok(())
}

/// Runs the relay; an error after `--reconnect-timeout` of failures is exit 1, a store
/// configuration error exit 2.
async fn drive<S: OutboxSource, P: idem_engine::Publisher>(
    relay: Relay<S, P>,
    shutdown: impl std::future::Future<Output = ()>,
    timeout: Duration,
) -> Result<RelayStats, CliError> {
    relay.run(shutdown).await.map_err(|e| match e {
        idem_engine::Error::Store(e @ idem_engine::StoreError::Config(_)) => e.into(),
        e => CliError::failed(format!(
            "relay: failing for {:.0} s (--reconnect-timeout): {}",
            timeout.as_secs_f64(),
            error_chain(&e)
        )),
    })
}
