//! `idem consume`: submissions from a broker into a store, exactly once in effect.
//!
//! Each delivery goes through the gate (claim → disbursement → commit → ack). With
//! `--exit-when-idle SECS` the command ends once no delivery arrived for SECS; Ctrl-C or
//! SIGTERM stops taking deliveries, finishes the ones in hand (acking only what
//! committed) and exits 0. The report on stdout is `name: value` lines.

use std::io::{Read as _, Write as _};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::Either;
use idem_broker::any::{AnyConsumer, BrokerUrl};
use idem_broker::{until_idle, BrokerError};
use idem_core::{consumer, ClaimStore, ConsumerConfig, Gate, Handler, Outcome, OutcomeKind};
use idem_grant::{GrantDb, GrantHandler};

use crate::error::error_chain;
use crate::stores::{self, Extras, StoreSpec, StoreVisitor};
use crate::CliError;

/// Arguments of `idem consume`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The broker: amqp://…, nats://… or redis://… (Redis Streams).
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
    /// Stop once no delivery arrived for SECS seconds.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    exit_when_idle: Option<Duration>,
    /// Serve Prometheus metrics over HTTP at ADDR (e.g. 127.0.0.1:9898).
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
}

/// Seconds as a number (`3`, `0.5`) or a duration (`3s`, `2m`).
fn parse_secs(s: &str) -> Result<Duration, String> {
    if let Ok(secs) = s.parse::<f64>() {
        if secs.is_finite() && secs > 0.0 && secs < 1e9 {
            return Ok(Duration::from_secs_f64(secs));
        }
        return Err(format!("{s:?} is not a positive number of seconds"));
    }
    crate::cmd::parse_duration(s)
}

/// A broker error as the command reports it: the caller's mistake exits 2, a failure 1.
pub(crate) fn broker_error(context: &str, e: &BrokerError) -> CliError {
    let msg = format!("{context}: {}", error_chain(e));
    match e {
        BrokerError::InvalidUrl(_)
        | BrokerError::Unsupported { .. }
        | BrokerError::InvalidName { .. } => CliError::usage(msg),
        _ => CliError::failed(msg),
    }
}

/// Counts by outcome, for the report and the metrics endpoint.
#[derive(Debug, Default)]
struct Counters {
    by_kind: [AtomicU64; 5],
    settle_failures: AtomicU64,
    first_last: Mutex<Option<(Instant, Instant)>>,
}

const KINDS: [OutcomeKind; 5] = [
    OutcomeKind::Processed,
    OutcomeKind::Duplicate,
    OutcomeKind::Deferred,
    OutcomeKind::Rejected,
    OutcomeKind::Failed,
];

impl Counters {
    fn record(&self, o: &Outcome) {
        let i = KINDS.iter().position(|k| *k == o.kind()).unwrap_or(4);
        self.by_kind[i].fetch_add(1, Ordering::Relaxed);
        if let Some(e) = o.settle_error() {
            self.settle_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(target: "idem::consume", outcome = o.kind().as_str(), error = %e, "settling a delivery failed");
        }
        let now = Instant::now();
        let mut fl = self
            .first_last
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *fl = Some(match *fl {
            None => (now, now),
            Some((first, _)) => (first, now),
        });
    }

    fn get(&self, kind: OutcomeKind) -> u64 {
        let i = KINDS.iter().position(|k| *k == kind).unwrap_or(4);
        self.by_kind[i].load(Ordering::Relaxed)
    }

    fn total(&self) -> u64 {
        KINDS.iter().map(|k| self.get(*k)).sum()
    }

    fn prometheus(&self) -> String {
        let mut s = String::from(
            "# HELP idem_deliveries_total Deliveries settled, by outcome.\n# TYPE idem_deliveries_total counter\n",
        );
        for k in KINDS {
            s.push_str(&format!(
                "idem_deliveries_total{{outcome=\"{}\"}} {}\n",
                k.as_str(),
                self.get(k)
            ));
        }
        s.push_str("# HELP idem_settle_failures_total Acks, nacks or dead-letters that failed.\n# TYPE idem_settle_failures_total counter\n");
        s.push_str(&format!(
            "idem_settle_failures_total {}\n",
            self.settle_failures.load(Ordering::Relaxed)
        ));
        s
    }
}

/// Serves `counters` at `addr` on a plain thread (one tiny response per connection).
fn serve_metrics(addr: std::net::SocketAddr, counters: Arc<Counters>) -> Result<(), CliError> {
    let listener = std::net::TcpListener::bind(addr)
        .map_err(|e| CliError::usage(format!("--metrics-addr {addr}: {e}")))?;
    std::thread::Builder::new()
        .name("idem-metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
                let mut buf = [0u8; 1024];
                let _ = stream.read(&mut buf);
                let body = counters.prometheus();
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        })
        .map_err(|e| CliError::failed(format!("cannot start the metrics thread: {e}")))?;
    Ok(())
}

struct Consume {
    broker: BrokerUrl,
    source: String,
    config: ConsumerConfig,
    idle: Option<Duration>,
    counters: Arc<Counters>,
}

impl StoreVisitor for Consume {
    type Output = idem_core::ConsumerStats;

    async fn visit<S>(
        self,
        store: S,
        db: Arc<dyn GrantDb>,
        _extras: Extras,
    ) -> Result<Self::Output, CliError>
    where
        S: ClaimStore + Clone + 'static,
        GrantHandler: Handler<S::Tx>,
    {
        let prefetch = 2 * self.config.concurrency * self.config.batch_size;
        let deliveries = AnyConsumer::connect(&self.broker, &self.source, prefetch)
            .await
            .map_err(|e| broker_error(&format!("{} {}", self.broker.kind(), self.broker), &e))?;
        eprintln!(
            "idem consume: {} {} → store; batch size {}, concurrency {}",
            self.broker.kind(),
            self.source,
            self.config.batch_size,
            self.config.concurrency
        );
        let deliveries = match self.idle {
            Some(idle) => Either::Left(until_idle(deliveries, idle)),
            None => Either::Right(deliveries),
        };
        let gate = Gate::new(store, db.grant_handler());
        let counters = Arc::clone(&self.counters);
        consumer::run(
            &gate,
            deliveries,
            self.config,
            crate::cmd::shutdown_signal(),
            move |o| counters.record(o),
        )
        .await
        .map_err(|e| CliError::failed(format!("consuming {}: {}", self.source, error_chain(&e))))
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
    let counters = Arc::new(Counters::default());
    if let Some(addr) = args.metrics_addr {
        serve_metrics(addr, Arc::clone(&counters))?;
    }
    let started = Instant::now();
    let visitor = Consume {
        broker,
        source: args.source,
        config: ConsumerConfig::new(args.concurrency, args.batch_size),
        idle: args.exit_when_idle,
        counters: Arc::clone(&counters),
    };
    let stats = stores::open(&spec, true, visitor).await?;
    let seconds = started.elapsed().as_secs_f64();
    let busy = counters
        .first_last
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .map(|(first, last)| last.duration_since(first).as_secs_f64())
        .unwrap_or(0.0);
    let deliveries = stats.deliveries();
    let throughput = if busy > 0.0 {
        deliveries as f64 / busy
    } else {
        0.0
    };
    debug_assert_eq!(deliveries, counters.total());
    println!("deliveries: {deliveries}");
    println!("processed: {}", stats.processed);
    println!("duplicates: {}", stats.duplicates);
    println!("deferred: {}", stats.deferred);
    println!("rejected: {}", stats.rejected);
    println!("failed: {}", stats.failed);
    println!("settle_failures: {}", stats.settle_failures);
    println!("seconds: {seconds:.3}");
    println!("busy_seconds: {busy:.3}");
    println!("throughput_msgs_per_s: {throughput:.0}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_takes_seconds_or_durations() {
        assert_eq!(parse_secs("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_secs("0.5"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_secs("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_secs("0").is_err());
        assert!(parse_secs("-1").is_err());
        assert!(parse_secs("soon").is_err());
    }

    #[test]
    fn broker_mistakes_exit_2_and_failures_exit_1() {
        let usage = broker_error("x", &BrokerError::InvalidUrl("bad".into()));
        assert_eq!(usage.exit_code(), 2);
        let failed = broker_error(
            "x",
            &BrokerError::Connect {
                broker: "nats",
                source: "refused".into(),
            },
        );
        assert_eq!(failed.exit_code(), 1);
    }

    #[test]
    fn metrics_text_counts_outcomes() {
        let c = Counters::default();
        c.by_kind[0].fetch_add(3, Ordering::Relaxed);
        let text = c.prometheus();
        assert!(
            text.contains("idem_deliveries_total{outcome=\"processed\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("idem_deliveries_total{outcome=\"duplicate\"} 0"),
            "{text}"
        );
    }
}
