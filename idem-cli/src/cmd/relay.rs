//! `idem relay`: committed outbox events to a broker, at least once, each with its
//! deterministic event id (so the next consumer dedups them).
//!
//! Every failed batch (store or broker down) is released and retried after a capped
//! exponential backoff with jitter, on a new broker connection; failures lasting longer
//! than `--reconnect-timeout` (default 60 s) are a one-line error and exit 1.
//!
//! `--metrics-addr ADDR` serves events published, batches retried, and the outbox
//! backlog with the age of its oldest unpublished event (measured at each scrape).
//! `--no-migrate` leaves the tables alone, for a role that may only read the outbox and
//! mark it published.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::FutureExt as _;

use idem_broker::any::{AnyPublisher, BrokerUrl};
use std::sync::Arc;

use idem_core::{OutboxEvent, OutboxSource, PublishError, Publisher, Relay, RelayStats};
use idem_grant::GrantDb;
use idem_store_postgres::{PgConfig, PgOutboxSource, PgStore};
use idem_store_sqlite::{SqliteConfig, SqliteOutboxSource, SqliteStore};
use tokio::sync::OnceCell;

use super::consume::{backoff, broker_error, with_retry, Attempt};
use crate::cmd::parse_secs;
use crate::error::error_chain;
use crate::metrics::RelayCounters;
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
    /// Give up (exit 1) when the broker or the store stays unreachable this long.
    #[arg(long, value_name = "SECS", value_parser = parse_secs, default_value = "60")]
    reconnect_timeout: Duration,
    /// Serve Prometheus metrics over HTTP at ADDR (e.g. 127.0.0.1:9899).
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Do not create or upgrade tables at start (for a least-privilege role, after the
    /// schema's owner ran `idem migrate`); the outbox must exist and be readable.
    #[arg(long)]
    no_migrate: bool,
}

/// The broker's publisher, connected on first use and again after any failure (a broker
/// restart closes the connection; the next batch gets a new one).
struct Reconnecting {
    url: BrokerUrl,
    destination: String,
    inner: tokio::sync::Mutex<Option<Arc<AnyPublisher>>>,
}

#[idem_core::async_trait]
impl Publisher for Reconnecting {
    async fn publish(&self, events: &[OutboxEvent]) -> Result<(), PublishError> {
        let publisher = {
            let mut slot = self.inner.lock().await;
            match slot.as_ref() {
                Some(p) => Arc::clone(p),
                None => {
                    let p = AnyPublisher::connect(&self.url, &self.destination)
                        .await
                        .map_err(|e| {
                            PublishError::new(
                                format!("connecting to {}: {}", self.url.kind(), error_chain(&e)),
                                true,
                                None,
                            )
                        })?;
                    let p = Arc::new(p);
                    *slot = Some(Arc::clone(&p));
                    p
                }
            }
        };
        let r = publisher.publish(events).await;
        if r.is_err() {
            // Reconnect before the next batch.
            *self.inner.lock().await = None;
        }
        r
    }
}

/// Runs `relay` until shutdown, or until idle for `idle`. Every failure (store or broker
/// down) is retried with backoff; failures lasting longer than `timeout` end the run.
async fn drive<S: OutboxSource>(
    relay: Relay<S, Reconnecting>,
    idle: Option<Duration>,
    timeout: Duration,
    counters: &RelayCounters,
) -> Result<RelayStats, CliError> {
    let mut stats = RelayStats::default();
    let shutdown = crate::cmd::shutdown_signal();
    tokio::pin!(shutdown);
    let mut last_work = Instant::now();
    let mut failing_since: Option<Instant> = None;
    let mut failures = 0u32;
    loop {
        // Between batches only: the batch in hand is always finished.
        if (&mut shutdown).now_or_never().is_some() {
            return Ok(stats);
        }
        match relay.run_once().await {
            Ok(0) => {
                failing_since = None;
                failures = 0;
                let rest = match idle {
                    Some(idle) if last_work.elapsed() >= idle => return Ok(stats),
                    Some(idle) => idle.saturating_sub(last_work.elapsed()),
                    None => Duration::from_secs(3600),
                };
                tokio::select! {
                    () = &mut shutdown => return Ok(stats),
                    r = relay.source().wait() => {
                        if let Err(e) = r {
                            // The notification channel is gone (a store restart): poll.
                            tracing::warn!(target: "idem::relay", error = %error_chain(&e), "waiting for outbox events failed");
                            tokio::time::sleep(POLL).await;
                        }
                    }
                    () = tokio::time::sleep(rest) => {}
                }
            }
            Ok(n) => {
                failing_since = None;
                failures = 0;
                stats.published += n as u64;
                counters.published.fetch_add(n as u64, Ordering::Relaxed);
                counters.batches.fetch_add(1, Ordering::Relaxed);
                last_work = Instant::now();
            }
            Err(e) => {
                stats.failed_batches += 1;
                counters.retries.fetch_add(1, Ordering::Relaxed);
                failures = failures.saturating_add(1);
                let since = *failing_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= timeout {
                    return Err(CliError::failed(format!(
                        "relay: failing for {:.0} s (--reconnect-timeout): {}",
                        since.elapsed().as_secs_f64(),
                        error_chain(&e)
                    )));
                }
                let wait = backoff(failures);
                tracing::warn!(target: "idem::relay", error = %error_chain(&e), "relay batch failed; retrying in {wait:?}");
                tokio::select! {
                    () = &mut shutdown => return Ok(stats),
                    () = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

/// Migrates the store, or with `--no-migrate` checks that the relay can read its outbox
/// (a relay role may read nothing else).
async fn prepare(db: &dyn GrantDb, migrate: bool) -> Result<(), CliError> {
    if migrate {
        db.migrate_grants().await?;
    } else {
        db.outbox_backlog().await?;
    }
    Ok(())
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let broker = BrokerUrl::parse(&args.broker).map_err(|e| broker_error("--broker", &e))?;
    let spec = StoreSpec::new(&args.store, args.schema.clone(), None)?;
    let timeout = args.reconnect_timeout;
    let first = with_retry(
        &format!("{} {}", broker.kind(), broker),
        timeout,
        || async {
            AnyPublisher::connect(&broker, &args.destination)
                .await
                .map_err(|e| {
                    Attempt::from(broker_error(&format!("{} {}", broker.kind(), broker), &e))
                })
        },
    )
    .await?;
    let publisher = Reconnecting {
        url: broker.clone(),
        destination: args.destination.clone(),
        inner: tokio::sync::Mutex::new(Some(Arc::new(first))),
    };
    let counters = Arc::new(RelayCounters::default());
    // The store, once open, for the backlog gauges.
    let db: Arc<OnceCell<Arc<dyn GrantDb>>> = Arc::new(OnceCell::new());
    if let Some(addr) = args.metrics_addr {
        let (c, db) = (Arc::clone(&counters), Arc::clone(&db));
        let render: crate::metrics::Render = Arc::new(move || {
            let (c, db) = (Arc::clone(&c), Arc::clone(&db));
            Box::pin(async move {
                let mut s = c.render();
                if let Some(db) = db.get() {
                    s.push_str(&crate::metrics::backlog_text(db.as_ref()).await);
                }
                s
            })
        });
        crate::metrics::serve(addr, render).await?;
    }
    let migrate = !args.no_migrate;
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
            let store = with_retry("the store", timeout, || {
                let attempt = async {
                    let store = PgStore::connect(url, config.clone()).await?;
                    prepare(&store, migrate).await?;
                    Ok::<_, CliError>(store)
                };
                // One attempt may hang (a pool waiting to connect): cut off at the timeout.
                tokio::time::timeout(timeout, attempt).map(|r| match r {
                    Ok(r) => r.map_err(Attempt::from),
                    Err(_) => Err(Attempt::Retry(CliError::failed(
                        "connecting to the store timed out",
                    ))),
                })
            })
            .await?;
            let _ = db.set(Arc::new(store.clone()));
            let source = PgOutboxSource::new(store, POLL);
            drive(
                Relay::new(source, publisher, BATCH),
                args.exit_when_idle,
                timeout,
                &counters,
            )
            .await?
        }
        StoreUrl::Sqlite(path) => {
            let store = SqliteStore::open(path, SqliteConfig::default()).await?;
            prepare(&store, migrate).await?;
            let _ = db.set(Arc::new(store.clone()));
            let source = SqliteOutboxSource::new(store, POLL);
            drive(
                Relay::new(source, publisher, BATCH),
                args.exit_when_idle,
                timeout,
                &counters,
            )
            .await?
        }
    };
    println!("destination: {}", args.destination);
    println!("published: {}", stats.published);
    println!("failed_batches: {}", stats.failed_batches);
    println!("seconds: {:.3}", started.elapsed().as_secs_f64());
    Ok(())
}
