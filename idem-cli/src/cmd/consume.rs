//! `idem consume`: submissions from a broker into a store, exactly once in effect.
//!
//! Each delivery goes through the gate (claim → disbursement → commit → ack), run by
//! `idem-runtime`'s supervised consumer: a closed delivery stream is reconnected with a
//! capped, jittered backoff, deliveries wait a growing backoff while the store keeps
//! failing, counts survive every reconnect, and a broker or store unreachable for
//! `--reconnect-timeout` (default 60 s) is a one-line error and exit 1; a configuration
//! failure (a missing table or privilege) stops at once with exit 2, nothing acked. With
//! `--exit-when-idle` the command ends once no delivery arrived for that long; Ctrl-C or
//! SIGTERM stops taking deliveries, finishes the ones in hand and exits 0. The report on
//! stdout is `name: value` lines. `--metrics-addr` and `--no-migrate`: see `--help`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use idem_broker::any::{AnyConsumer, BrokerUrl};
use idem_core::{ClaimStore, ConsumerConfig, Gate, Handler};
use idem_grant::{GrantDb, GrantHandler};
use idem_runtime::supervise::{supervise, SuperviseError, SupervisorConfig};
use idem_runtime::Backoff;

use crate::cmd::{attempt, broker_error, gave_up, parse_secs};
use crate::metrics::ConsumeMetrics;
use crate::stores::{Extras, StoreSpec, StoreVisitor};
use crate::CliError;

/// Arguments of `idem consume`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The broker: amqp://, nats://, redis:// (Redis Streams), sqs:// or kafka://…
    #[arg(long)]
    broker: String,
    /// The queue / stream to consume (created if missing).
    #[arg(long, value_name = "NAME")]
    source: String,
    /// The store: sqlite://PATH or postgres://…
    #[arg(long)]
    store: String,
    /// The Postgres schema (created if missing).
    #[arg(long)]
    schema: Option<String>,
    /// The most deliveries committed in one transaction.
    #[arg(long, default_value_t = 1, value_name = "N")]
    batch_size: usize,
    /// How many batches are processed at once.
    #[arg(long, default_value_t = 1, value_name = "N")]
    concurrency: usize,
    /// A Redis front filter (redis://…) before the durable store.
    #[arg(long, value_name = "URL")]
    front_filter: Option<String>,
    /// Stop once no delivery arrived for this long (`5`, `500ms`, `2m`).
    #[arg(long, value_name = "DURATION", value_parser = parse_secs)]
    exit_when_idle: Option<Duration>,
    /// Serve Prometheus metrics over HTTP at ADDR (e.g. 127.0.0.1:9898): deliveries by
    /// outcome, settle failures, stage latencies, front-filter hits, the outbox backlog.
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Give up (exit 1) when the broker or the store stays unreachable this long.
    #[arg(long, value_name = "DURATION", value_parser = parse_secs, default_value = "60")]
    reconnect_timeout: Duration,
    /// Do not create or upgrade tables at start; only check that they exist and can be
    /// read (for a least-privilege role, after the schema's owner ran `idem migrate`).
    #[arg(long)]
    no_migrate: bool,
}

#[derive(Clone)]
struct Consume {
    visited: Arc<AtomicBool>,
    migrate: bool,
    broker: BrokerUrl,
    source: String,
    config: SupervisorConfig,
    metrics: Arc<ConsumeMetrics>,
}

impl StoreVisitor for Consume {
    type Output = idem_runtime::supervise::Supervised;

    async fn visit<S>(
        self,
        store: S,
        db: Arc<dyn GrantDb>,
        extras: Extras,
    ) -> Result<Self::Output, CliError>
    where
        S: ClaimStore + Clone + 'static,
        GrantHandler: Handler<S::Tx>,
    {
        self.visited.store(true, Ordering::SeqCst);
        if !self.migrate {
            // Not migrated by us: fail now, naming the table, rather than nack every
            // delivery until the reconnect timeout.
            db.check_grants().await?;
        }
        self.metrics
            .opened(Arc::clone(&db), extras.filter_stats.clone());
        let c = self.config.consumer;
        let prefetch = 2 * c.concurrency * c.batch_size;
        let (broker, source) = (&self.broker, &self.source);
        let what = format!("{} {}", broker.kind(), broker);
        let (b, src, w) = (broker.clone(), source.clone(), what.clone());
        // Owned and boxed: the visitor's future must be `Send` for every lifetime.
        let mut connect = move || {
            let (b, src, w) = (b.clone(), src.clone(), w.clone());
            async move {
                let r = AnyConsumer::connect(&b, &src, prefetch).await;
                r.map_err(|e| attempt(broker_error(&w, &e)))
            }
            .boxed()
        };
        let timeout = self.config.reconnect_timeout;
        let first = idem_runtime::retry(&what, timeout, Backoff::default(), &mut connect)
            .await
            .map_err(|e| gave_up(&what, e))?;
        eprintln!(
            "idem consume: {} {} → store; batch size {}, concurrency {}",
            broker.kind(),
            source,
            c.batch_size,
            c.concurrency
        );
        let gate = Gate::new(store, db.grant_handler()).with_observer(self.metrics.stages());
        let shutdown = crate::cmd::shutdown_signal();
        let metrics = Arc::clone(&self.metrics);
        let observe = move |o: &idem_core::Outcome| metrics.record(o);
        supervise(&gate, Some(first), connect, self.config, shutdown, observe)
            .await
            .map_err(|e| match e {
                SuperviseError::Connect(e) => gave_up(&what, e),
                SuperviseError::Consumer(idem_core::Error::Store(e)) => e.into(),
                e => CliError::failed(format!("consuming {source}: {e} (--reconnect-timeout)")),
            })
    }
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    if args.batch_size == 0 || args.concurrency == 0 {
        return Err(CliError::usage(
            "--batch-size and --concurrency must be at least 1",
        ));
    }
    let broker = BrokerUrl::parse(&args.broker).map_err(|e| broker_error("--broker", &e))?;
    let spec = StoreSpec::new(&args.store, args.schema, args.front_filter)?;
    let metrics = Arc::new(ConsumeMetrics::default());
    if let Some(addr) = args.metrics_addr {
        crate::metrics::serve_consume(addr, Arc::clone(&metrics)).await?;
    }
    let started = Instant::now();
    let visited = Arc::new(AtomicBool::new(false));
    let timeout = args.reconnect_timeout;
    let config = SupervisorConfig::new(ConsumerConfig::new(args.concurrency, args.batch_size))
        .exit_when_idle(args.exit_when_idle)
        .reconnect_timeout(timeout);
    let migrate = !args.no_migrate;
    let visitor = Consume {
        visited: Arc::clone(&visited),
        migrate,
        broker,
        source: args.source,
        config,
        metrics,
    };
    let run = super::open_with_retry(&spec, migrate, visitor, &visited, timeout).await?;
    let (stats, busy) = (run.stats, run.busy.as_secs_f64());
    let throughput = if busy > 0.0 {
        stats.deliveries() as f64 / busy
    } else {
        0.0
    };
    println!("deliveries: {}", stats.deliveries());
    println!("processed: {}", stats.processed);
    println!("duplicates: {}", stats.duplicates);
    println!("deferred: {}", stats.deferred);
    println!("rejected: {}", stats.rejected);
    println!("failed: {}", stats.failed);
    println!("settle_failures: {}", stats.settle_failures);
    println!("seconds: {:.3}", started.elapsed().as_secs_f64());
    println!("busy_seconds: {busy:.3}");
    println!("throughput_msgs_per_s: {throughput:.0}");
    Ok(())
}
