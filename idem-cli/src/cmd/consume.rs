//! `idem consume`: submissions from a broker into a store, exactly once in effect.
//!
//! Each delivery goes through the gate (claim → disbursement → commit → ack). With
//! `--exit-when-idle SECS` the command ends once no delivery arrived for SECS; Ctrl-C or
//! SIGTERM stops taking deliveries, finishes the ones in hand (acking only what
//! committed) and exits 0. The report on stdout is `name: value` lines.
//!
//! A broker or Postgres restart does not end the command: the delivery in hand fails
//! cleanly (rolled back, nacked, or its ack lost and the redelivery skipped), deliveries
//! wait a capped exponential backoff with jitter while the store keeps failing, and a
//! closed delivery stream is reconnected the same way. A broker or store that stays
//! unreachable for `--reconnect-timeout` (default 60 s) is a one-line error and exit 1.
//!
//! `--metrics-addr ADDR` serves deliveries by outcome, settle failures, stage latency
//! histograms, front-filter hits and the outbox backlog (measured at each scrape).
//! `--no-migrate` leaves the tables alone and only checks that they can be read, for a
//! least-privilege role that may not alter the schema.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use futures::future::Either;
use futures::StreamExt as _;
use idem_broker::any::{AnyConsumer, BrokerUrl};
use idem_broker::{until_idle, BrokerError};
use idem_core::{consumer, ClaimStore, ConsumerConfig, Gate, Handler, Outcome, OutcomeKind};
use idem_grant::{GrantDb, GrantHandler};

use crate::cmd::parse_secs;
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
    /// Give up (exit 1) when the broker or the store stays unreachable this long.
    #[arg(long, value_name = "SECS", value_parser = parse_secs, default_value = "60")]
    reconnect_timeout: Duration,
    /// Do not create or upgrade tables at start; only check that they exist and can be
    /// read (for a least-privilege role, after the schema's owner ran `idem migrate`).
    #[arg(long)]
    no_migrate: bool,
}

/// Capped exponential backoff with full jitter: attempt 1 waits up to 100 ms, doubling
/// up to 5 s.
pub(crate) fn backoff(attempt: u32) -> Duration {
    use rand::Rng as _;
    let cap = Duration::from_secs(5);
    let base = Duration::from_millis(100).saturating_mul(1u32 << attempt.saturating_sub(1).min(10));
    let top = base.min(cap);
    let ms = u64::try_from(top.as_millis()).unwrap_or(5000).max(1);
    Duration::from_millis(rand::thread_rng().gen_range(ms / 2..=ms))
}

/// A failed attempt: worth another try, or not.
pub(crate) enum Attempt {
    Retry(CliError),
    Final(CliError),
}

impl From<CliError> for Attempt {
    /// The caller's mistakes (exit 2) are final; failures are retried.
    fn from(e: CliError) -> Self {
        if e.exit_code() == 2 {
            Self::Final(e)
        } else {
            Self::Retry(e)
        }
    }
}

/// Retries `connect` with [`backoff`] until it succeeds, fails for good, or `timeout` has
/// passed since the first try (then a one-line error, exit 1).
pub(crate) async fn with_retry<T, F, Fut>(
    what: &str,
    timeout: Duration,
    mut connect: F,
) -> Result<T, CliError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Attempt>>,
{
    let started = Instant::now();
    let mut attempt = 0u32;
    loop {
        match connect().await {
            Ok(v) => return Ok(v),
            Err(Attempt::Final(e)) => return Err(e),
            Err(Attempt::Retry(e)) => {
                attempt += 1;
                if started.elapsed() >= timeout {
                    return Err(CliError::failed(format!(
                        "{what}: still unreachable after {:.0} s (--reconnect-timeout): {e}",
                        started.elapsed().as_secs_f64()
                    )));
                }
                let wait = backoff(attempt).min(timeout.saturating_sub(started.elapsed()));
                tracing::warn!(target: "idem::consume", attempt, error = %e, "{what} unreachable; retrying in {wait:?}");
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// A broker error as the command reports it: the caller's mistake exits 2, a failure 1.
pub(crate) fn broker_error(context: &str, e: &BrokerError) -> CliError {
    let msg = format!("{context}: {}", error_chain(e));
    match e {
        BrokerError::InvalidUrl(_)
        | BrokerError::Unsupported { .. }
        | BrokerError::InvalidName { .. }
        | BrokerError::Config { .. } => CliError::usage(msg),
        _ => CliError::failed(msg),
    }
}

/// Counts by outcome, for the report and the metrics endpoint.
#[derive(Default)]
struct Counters {
    by_kind: [AtomicU64; 5],
    settle_failures: AtomicU64,
    first_last: Mutex<Option<(Instant, Instant)>>,
    /// Claim / handler / commit / ack latency histograms, fed by the gate.
    stages: Arc<crate::metrics::StageMetrics>,
    /// The store once it is open, for the outbox backlog.
    store: OnceLock<Opened>,
}

/// What the metrics read from the opened store: the outbox backlog, and the front
/// filter's counters when there is one.
struct Opened {
    db: Arc<dyn GrantDb>,
    filter: Option<Arc<idem_core::FilterStats>>,
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
        s.push_str(&self.stages.render());
        s
    }

    /// Everything the metrics endpoint serves: the counters and histograms, the front
    /// filter's counters, and the outbox backlog measured now.
    async fn render(&self) -> String {
        let mut s = self.prometheus();
        if let Some(Opened { db, filter }) = self.store.get() {
            if let Some(f) = filter {
                s.push_str(&crate::metrics::filter_text(f));
            }
            s.push_str(&crate::metrics::backlog_text(db.as_ref()).await);
        }
        s
    }
}

#[derive(Clone)]
struct Consume {
    visited: Arc<AtomicBool>,
    migrate: bool,
    reconnect_timeout: Duration,
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
        // Set once; a reconnect to the store keeps the first (same database).
        let _ = self.counters.store.set(Opened {
            db: Arc::clone(&db),
            filter: extras.filter_stats.clone(),
        });
        let prefetch = 2 * self.config.concurrency * self.config.batch_size;
        let timeout = self.reconnect_timeout;
        let broker = self.broker.clone();
        let source = self.source.clone();
        let connect = || {
            let (broker, source) = (broker.clone(), source.clone());
            async move {
                AnyConsumer::connect(&broker, &source, prefetch)
                    .await
                    .map_err(|e| {
                        Attempt::from(broker_error(&format!("{} {}", broker.kind(), broker), &e))
                    })
            }
        };
        let what = format!("{} {}", self.broker.kind(), self.broker);
        let mut deliveries = Some(with_retry(&what, timeout, connect).await?);
        eprintln!(
            "idem consume: {} {} → store; batch size {}, concurrency {}",
            self.broker.kind(),
            self.source,
            self.config.batch_size,
            self.config.concurrency
        );
        // One shutdown signal for every (re)connection.
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            crate::cmd::shutdown_signal().await;
            let _ = stop_tx.send(true);
        });
        let gate = Gate::new(store, db.grant_handler())
            .with_observer(Arc::clone(&self.counters.stages) as Arc<dyn idem_core::GateObserver>);
        // Store failures in a row, and when the streak began: each delivery waits a
        // backoff while the store is failing, and a streak longer than the reconnect
        // timeout ends the run.
        let streak = Arc::new(Streak::default());
        let mut total = idem_core::ConsumerStats::default();
        loop {
            let stream = match deliveries.take() {
                Some(d) => d,
                None => with_retry(&what, timeout, connect).await?,
            };
            // Set when the broker's stream itself ends (a closed connection), as opposed
            // to the idle timer or shutdown.
            let ended = Arc::new(AtomicBool::new(false));
            let ended_flag = Arc::clone(&ended);
            let stream = stream.chain(futures::stream::poll_fn(move |_| {
                ended_flag.store(true, Ordering::SeqCst);
                std::task::Poll::Ready(None)
            }));
            let throttle = Arc::clone(&streak);
            let stream = Box::pin(stream.then(move |item| {
                let throttle = Arc::clone(&throttle);
                async move {
                    if let Some(wait) = throttle.wait(timeout) {
                        tokio::time::sleep(wait?).await;
                    }
                    item.map_err(idem_core::BoxError::from)
                }
            }));
            let stream = match self.idle {
                Some(idle) => Either::Left(until_idle(stream, idle)),
                None => Either::Right(stream),
            };
            let counters = Arc::clone(&self.counters);
            let observed = Arc::clone(&streak);
            let mut stop = stop_rx.clone();
            let result = consumer::run(
                &gate,
                stream,
                self.config,
                async move {
                    let _ = stop.wait_for(|v| *v).await;
                },
                move |o| {
                    observed.record(o.kind());
                    counters.record(o);
                },
            )
            .await;
            let stopped = *stop_rx.borrow();
            match result {
                Ok(stats) => {
                    add(&mut total, &stats);
                    if stopped || !ended.load(Ordering::SeqCst) {
                        return Ok(total);
                    }
                    tracing::warn!(target: "idem::consume", "the broker closed the delivery stream; reconnecting");
                }
                Err(e) => {
                    if let Some(msg) = streak.gave_up() {
                        return Err(CliError::failed(format!(
                            "consuming {}: {msg}",
                            self.source
                        )));
                    }
                    if stopped {
                        return Ok(total);
                    }
                    tracing::warn!(target: "idem::consume", error = %error_chain(&e), "delivery stream failed; reconnecting");
                }
            }
            tokio::time::sleep(backoff(1)).await;
        }
    }
}

fn add(total: &mut idem_core::ConsumerStats, s: &idem_core::ConsumerStats) {
    total.processed += s.processed;
    total.duplicates += s.duplicates;
    total.deferred += s.deferred;
    total.rejected += s.rejected;
    total.failed += s.failed;
    total.settle_failures += s.settle_failures;
}

/// Consecutive failed deliveries (a store that is down), for backoff and the timeout.
#[derive(Debug, Default)]
struct Streak {
    failures: AtomicU64,
    since: Mutex<Option<Instant>>,
    gave_up: Mutex<Option<String>>,
}

impl Streak {
    fn record(&self, kind: OutcomeKind) {
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        if kind == OutcomeKind::Failed {
            self.failures.fetch_add(1, Ordering::SeqCst);
            since.get_or_insert_with(Instant::now);
        } else if kind != OutcomeKind::Deferred {
            self.failures.store(0, Ordering::SeqCst);
            *since = None;
        }
    }

    /// How long the next delivery waits (`None`: no failures), or an error once the
    /// failures have lasted longer than `timeout`.
    fn wait(&self, timeout: Duration) -> Option<Result<Duration, idem_core::BoxError>> {
        let n = self.failures.load(Ordering::SeqCst);
        if n == 0 {
            return None;
        }
        let since = *self.since.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(since) = since {
            if since.elapsed() >= timeout {
                let msg = format!(
                    "the store kept failing for {:.0} s ({n} deliveries in a row; --reconnect-timeout)",
                    since.elapsed().as_secs_f64()
                );
                *self.gave_up.lock().unwrap_or_else(PoisonError::into_inner) = Some(msg.clone());
                return Some(Err(msg.into()));
            }
        }
        Some(Ok(backoff(u32::try_from(n).unwrap_or(u32::MAX))))
    }

    fn gave_up(&self) -> Option<String> {
        self.gave_up
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
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
        let c = Arc::clone(&counters);
        let render: crate::metrics::Render = Arc::new(move || {
            let c = Arc::clone(&c);
            Box::pin(async move { c.render().await })
        });
        crate::metrics::serve(addr, render).await?;
    }
    let started = Instant::now();
    let visited = Arc::new(AtomicBool::new(false));
    let visitor = Consume {
        visited: Arc::clone(&visited),
        migrate: !args.no_migrate,
        reconnect_timeout: args.reconnect_timeout,
        broker,
        source: args.source,
        config: ConsumerConfig::new(args.concurrency, args.batch_size),
        idle: args.exit_when_idle,
        counters: Arc::clone(&counters),
    };
    // The store may be down at start (a restart): retried until the visitor is reached.
    // One attempt may hang (a pool waiting to connect); it is cut off at the deadline.
    let deadline = Instant::now() + args.reconnect_timeout;
    let stats = with_retry("the store", args.reconnect_timeout, || {
        let visitor = visitor.clone();
        let visited = Arc::clone(&visited);
        let spec = &spec;
        async move {
            let open = stores::open(spec, visitor.migrate, visitor);
            tokio::pin!(open);
            let r = loop {
                tokio::select! {
                    r = &mut open => break r,
                    () = tokio::time::sleep(Duration::from_millis(200)) => {
                        if !visited.load(Ordering::SeqCst) && Instant::now() >= deadline {
                            return Err(Attempt::Retry(CliError::failed("connecting to the store timed out")));
                        }
                    }
                }
            };
            match r {
                Err(e) if visited.load(Ordering::SeqCst) => Err(Attempt::Final(e)),
                Err(e) => Err(Attempt::from(e)),
                Ok(v) => Ok(v),
            }
        }
    })
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    let busy = counters
        .first_last
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .map(|(first, last)| last.duration_since(first).as_secs_f64())
        .unwrap_or(0.0);
    // Every connection's outcomes, also those of a stream that failed and was reconnected.
    let stats = idem_core::ConsumerStats {
        processed: counters.get(OutcomeKind::Processed),
        duplicates: counters.get(OutcomeKind::Duplicate),
        deferred: counters.get(OutcomeKind::Deferred),
        rejected: counters.get(OutcomeKind::Rejected),
        failed: counters.get(OutcomeKind::Failed),
        settle_failures: counters
            .settle_failures
            .load(Ordering::Relaxed)
            .max(stats.settle_failures),
    };
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
    fn backoff_grows_is_jittered_and_capped() {
        for _ in 0..100 {
            let first = backoff(1);
            assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
            let later = backoff(4);
            assert!(later >= Duration::from_millis(400) && later <= Duration::from_millis(800));
            let capped = backoff(u32::MAX);
            assert!(capped >= Duration::from_millis(2500) && capped <= Duration::from_secs(5));
        }
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
