//! One module per subcommand.

pub(crate) mod audit;
pub(crate) mod consume;
pub(crate) mod demo;
pub(crate) mod inspect;
pub(crate) mod key;
pub(crate) mod migrate;
pub(crate) mod publish;
pub(crate) mod purge;
pub(crate) mod relay;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::FutureExt as _;
use idem_broker::any::{AnyConsumer, AnyPublisher, BrokerKind, BrokerUrl};
use idem_broker::BrokerError;
use idem_engine::{ClaimStore, Handler, PublishError};
use idem_grant::{GrantDb, GrantHandler};
use idem_runtime::metrics::{Connected, Watched};
use idem_runtime::{Attempt, Backoff, GaveUp, ReconnectingPublisher};
#[cfg(feature = "postgres")]
use idem_store_postgres::{PgConfig, PgStore};
use idem_store_sqlite::{SqliteConfig, SqliteStore};
use tracing_subscriber::EnvFilter;

use crate::error::error_chain;
use crate::stores::{StoreSpec, StoreUrl, StoreVisitor};
use crate::CliError;

/// How logs are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log shipping.
    Json,
}

/// When to colour what goes to stderr (`--color`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Color {
    /// At a terminal, unless `NO_COLOR` is set (non-empty); `CLICOLOR_FORCE` (other than
    /// `0`) colours a pipe too.
    Auto,
    /// Always, whatever the environment says.
    Always,
    /// Never.
    Never,
}

impl Color {
    /// The same choice for clap's own messages (clap's `auto` reads the same variables).
    pub(crate) fn clap(self) -> clap::ColorChoice {
        match self {
            Self::Auto => clap::ColorChoice::Auto,
            Self::Always => clap::ColorChoice::Always,
            Self::Never => clap::ColorChoice::Never,
        }
    }

    /// Whether logs on stderr are coloured, `NO_COLOR` and `CLICOLOR_FORCE` read through
    /// `var`.
    pub(crate) fn ansi(
        self,
        var: impl Fn(&str) -> Option<std::ffi::OsString>,
        terminal: bool,
    ) -> bool {
        let set = |name: &str| var(name).is_some_and(|v| !v.is_empty());
        match self {
            Self::Always => true,
            Self::Never => false,
            Self::Auto if set("NO_COLOR") => false,
            Self::Auto
                if set("CLICOLOR_FORCE")
                    && var("CLICOLOR_FORCE").as_deref() != Some("0".as_ref()) =>
            {
                true
            }
            Self::Auto => terminal,
        }
    }
}

/// Logs go to stderr, filtered by `RUST_LOG` (default: warnings, and the audit trail off
/// unless asked for with `RUST_LOG=idem::audit=info`), coloured as `color` says.
///
/// With `quiet_injected_crashes` (the demo without `--verbose`), the gate's warning about
/// a handler that panicked with an injected crash is not written: the demo counts its
/// crashes in its report. A real panic still shows, by its panic message and its warning.
pub(crate) fn init_logging(format: LogFormat, color: Color, quiet_injected_crashes: bool) {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    // sqlx logs a Postgres URL parameter it does not know with its value, which may be a
    // secret (`?token=…`): never shown, whatever RUST_LOG asks for.
    let filter = match "sqlx_postgres::options::parse=off".parse() {
        Ok(quiet) => filter.add_directive(quiet),
        Err(_) => filter,
    };
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let ansi = color.ansi(|name| std::env::var_os(name), terminal);
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(|| Masked(std::io::stderr()));
    let layer = match format {
        LogFormat::Text => layer.boxed(),
        LogFormat::Json => layer.json().boxed(),
    };
    let crashes = InjectedCrashes(quiet_injected_crashes);
    let _ = tracing_subscriber::registry()
        .with(layer.with_filter(crashes).with_filter(filter))
        .try_init();
}

/// The secrets of the URLs this process was given (its arguments and the environment
/// variables that stand for them, and the AWS secret key and session token), which
/// [`Masked`] hides wherever a log line holds one.
static SECRETS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Reads the secrets [`Masked`] hides, once, before logging starts: every argument and
/// URL variable through [`idem_engine::redact::secrets_in`], and the AWS secrets as they
/// are. Secrets shorter than four characters are not masked (masking them would garble
/// every log line that holds those characters).
pub(crate) fn collect_secrets() {
    let mut found: Vec<String> = Vec::new();
    let args = std::env::args_os()
        .skip(1)
        .filter_map(|a| a.into_string().ok());
    let urls = [
        "IDEM_STORE",
        "DATABASE_URL",
        "IDEM_BROKER",
        "IDEM_FRONT_FILTER",
    ]
    .iter()
    .filter_map(|v| std::env::var(v).ok());
    for text in args.chain(urls) {
        found.extend(idem_engine::redact::secrets_in(&text));
    }
    for v in ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"] {
        found.extend(std::env::var(v).ok());
    }
    found.retain(|s| s.chars().count() >= 4);
    found.sort();
    found.dedup();
    // The longest first, so that a secret inside another is not half masked.
    found.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let _ = SECRETS.set(found);
}

/// A log writer that masks every secret of [`SECRETS`] in what it writes: drivers log
/// the URLs they were given at their debug levels (async-nats writes the server's
/// password or token when it connects), and no `RUST_LOG` may print one. Each event
/// comes in one write, so a secret is never split between two.
struct Masked<W>(W);

impl<W: std::io::Write> std::io::Write for Masked<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let secrets = SECRETS.get().map_or(&[][..], Vec::as_slice);
        let text = String::from_utf8_lossy(buf);
        if secrets.iter().any(|s| text.contains(s.as_str())) {
            let mut masked = text.into_owned();
            for s in secrets {
                masked = masked.replace(s.as_str(), idem_engine::redact::MASK);
            }
            self.0.write_all(masked.as_bytes())?;
        } else {
            self.0.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// How the gate's error text for a handler that panicked with a payload that is no
/// string ends (after its class): the testkit's injected crash (a panic in the grant
/// handler's own code carries its message).
const INJECTED_CRASH_ERROR: &str = "the handler panicked: a non-string panic payload";

/// Drops the gate's warnings caused by an injected crash, when on.
struct InjectedCrashes(bool);

impl<S> tracing_subscriber::layer::Filter<S> for InjectedCrashes {
    fn enabled(
        &self,
        _: &tracing::Metadata<'_>,
        _: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        true
    }

    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        _: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        if !self.0 || event.metadata().target() != "idem::gate" {
            return true;
        }
        let mut error = ErrorField(false);
        event.record(&mut error);
        !error.0
    }
}

/// Finds an `error` field that is the injected crash's.
struct ErrorField(bool);

impl tracing::field::Visit for ErrorField {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "error" && format!("{value:?}").ends_with(INJECTED_CRASH_ERROR) {
            self.0 = true;
        }
    }
}

/// Resolves when Ctrl-C or SIGTERM arrives.
#[allow(dead_code)] // used by consume and relay
pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// `--store` and `--schema` as `consume`, `migrate`, `purge` and `relay` take them
/// (flattened into their arguments, at the same place and with the same help; `migrate`
/// and `consume`, which create a missing schema, say so in theirs: [`SCHEMA_CREATED_HELP`]).
#[derive(Debug, clap::Args)]
pub(crate) struct StoreArgs {
    /// The store: sqlite://PATH or postgres://… (or IDEM_STORE, else DATABASE_URL: keeps
    /// a password out of the process list and the shell's history)
    #[arg(
        id = "store",
        long = "store",
        value_name = "STORE",
        env = "IDEM_STORE",
        hide_env_values = true
    )]
    pub(crate) url: String,
    /// The Postgres schema.
    #[arg(long)]
    pub(crate) schema: Option<String>,
}

/// The help of `--schema` where the command creates the schema.
pub(crate) const SCHEMA_CREATED_HELP: &str = "The Postgres schema (created if missing)";

/// `--broker`'s help, one text for every command that takes a broker.
pub(crate) const BROKER_HELP: &str = "The broker URL: amqp:// (RabbitMQ), nats:// (NATS \
    JetStream), redis:// (Redis Streams), sqs:// (Amazon SQS) or kafka:// (Kafka). idem's \
    settings ride in its query, e.g. nats://127.0.0.1:4222?ack_wait=5s (each broker's \
    parameters: idem-broker docs).";

/// A positive duration (`--exit-when-idle`, `--reconnect-timeout`), in idem's one
/// duration grammar ([`parse_duration`]): seconds as a number (`3`, `0.5`) or a
/// friendly duration (`500ms`, `2m`, `1h 30m`).
pub(crate) fn parse_secs(s: &str) -> Result<Duration, String> {
    match parse_duration(s) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err(format!("{:?} is not a positive duration", s.trim())),
        Err(e) => Err(e.to_string()),
    }
}

/// Prints the stdout report of `consume` and `relay`: `name: value` lines for `counts`,
/// then `seconds` (since `started`), `busy_seconds` and `throughput_msgs_per_s` (`done`
/// over the busy time, 0 when there was none).
pub(crate) fn report(
    mut out: crate::out::Out,
    counts: &[(&str, u64)],
    started: Instant,
    busy: Duration,
    done: u64,
) {
    for (name, value) in counts {
        out.field(name, *value);
    }
    let busy = busy.as_secs_f64();
    let rate = if busy > 0.0 { done as f64 / busy } else { 0.0 };
    out.measure("seconds", started.elapsed().as_secs_f64(), 3);
    out.measure("busy_seconds", busy, 3);
    out.measure("throughput_msgs_per_s", rate, 0);
    out.finish();
}

/// A count of at least 1 (`--batch-size`, `--concurrency`).
pub(crate) fn at_least_one(s: &str) -> Result<usize, String> {
    positive(s)
}

/// [`at_least_one`] for a `u32` flag.
pub(crate) fn at_least_one_u32(s: &str) -> Result<u32, String> {
    positive(s)
}

fn positive<T: std::str::FromStr + PartialOrd + From<u8>>(s: &str) -> Result<T, String> {
    match s.parse::<T>() {
        Ok(n) if n >= T::from(1) => Ok(n),
        _ => Err(format!("{s:?}: must be at least 1")),
    }
}

/// A fixed duration (windows, margins, timers): idem's one grammar, shared with the
/// broker URL parameters (`30s`, `15m`, `12h`, `90d`, `2w`, or a bare number of seconds;
/// a year has no fixed length and is refused here).
pub(crate) use idem_engine::duration::parse_duration;

/// A retention floor or a purge age, as `idem purge` and `idem audit report` read it: `Ny`
/// is N calendar years (leap days included, as the servers count them), anything else an
/// exact duration.
pub(crate) fn parse_floor(s: &str) -> Result<idem_engine::retention::RetentionFloor, String> {
    idem_engine::duration::parse_age(s).map_err(|e| e.to_string())
}

/// A broker error as the command reports it: the caller's mistake exits 2, a failure 1.
/// A URL whose broker (or TLS) is not compiled in names the feature that brings it.
pub(crate) fn broker_error(context: &str, e: &BrokerError) -> CliError {
    if let BrokerError::Unsupported { scheme, .. } = e {
        let enabled = |kind: BrokerKind| kind.is_enabled();
        if let Some(feature) = missing_broker_feature(scheme, enabled, cfg!(feature = "tls")) {
            let refused = crate::stores::not_compiled(&format!("{scheme}://"), feature);
            return CliError::usage(format!("{context}: {refused}"));
        }
    }
    let msg = format!("{context}: {}", error_chain(e));
    match e {
        BrokerError::InvalidUrl(_)
        | BrokerError::InvalidParam { .. }
        | BrokerError::Unsupported { .. }
        | BrokerError::InvalidName { .. } => CliError::usage(msg),
        _ => CliError::failed(msg),
    }
}

/// The feature of this command that a broker URL with scheme `scheme` needs and this
/// build lacks: the broker's own (`enabled` says which brokers are compiled in), or
/// `tls` for a scheme that asks for TLS (`amqps`, `rediss`) when `tls` is false.
pub(crate) fn missing_broker_feature(
    scheme: &str,
    enabled: impl Fn(BrokerKind) -> bool,
    tls: bool,
) -> Option<&'static str> {
    let scheme = scheme.to_ascii_lowercase();
    match BrokerKind::from_scheme(&scheme) {
        Some(kind) if !enabled(kind) => Some(kind.feature()),
        Some(_) if !tls && (scheme == "amqps" || scheme == "rediss") => Some("tls"),
        _ => None,
    }
}

/// A failed attempt: the caller's mistakes (exit 2) are final; failures are retried.
pub(crate) fn attempt(e: CliError) -> Attempt<CliError> {
    if e.exit_code() == 2 {
        Attempt::Final(e)
    } else {
        Attempt::Retry(e)
    }
}

/// One try at connecting, bounded by `limit`: a server that accepts the connection and
/// never answers (a broker stuck on an alarm, a half-open socket) is a failed try, retried
/// and reported like a refused one, instead of a consumer that waits for ever without a word.
pub(crate) async fn bounded_try<T>(
    what: &str,
    limit: Duration,
    connect: impl std::future::Future<Output = Result<T, Attempt<CliError>>>,
) -> Result<T, Attempt<CliError>> {
    tokio::time::timeout(limit, connect)
        .await
        .unwrap_or_else(|_| {
            Err(Attempt::Retry(CliError::failed(format!(
                "{what}: no answer within {limit:?}"
            ))))
        })
}

/// What the command says when a retried connection gives up.
pub(crate) fn gave_up(what: &str, e: GaveUp<CliError>) -> CliError {
    match e {
        GaveUp::Final(e) => e,
        GaveUp::Deadline { after, last } => CliError::failed(format!(
            "{what}: still unreachable after {:.0} s (--reconnect-timeout): {last}",
            after.as_secs_f64()
        )),
    }
}

/// A durable store, opened.
pub(crate) enum Opened {
    #[cfg(feature = "postgres")]
    Pg(PgStore),
    Lite(SqliteStore),
}

impl Opened {
    /// Creates or updates idem's own tables (not a handler's).
    async fn migrate(&self) -> Result<(), idem_engine::StoreError> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Pg(s) => s.migrate().await,
            Self::Lite(s) => s.migrate().await,
        }
    }

    /// The store as the grant pipeline sees it.
    pub(crate) fn db(&self) -> Arc<dyn GrantDb> {
        match self {
            #[cfg(feature = "postgres")]
            Self::Pg(s) => Arc::new(s.clone()),
            Self::Lite(s) => Arc::new(s.clone()),
        }
    }
}

/// Opens the durable store of `spec` and migrates it (or, without `migrate`, checks that
/// its outbox can be read), retrying an unreachable Postgres for `timeout`.
pub(crate) async fn open_durable(
    spec: &StoreSpec,
    migrate: bool,
    timeout: Duration,
) -> Result<Opened, CliError> {
    let open = || async {
        let store = match &spec.url {
            StoreUrl::Memory => {
                return Err(Attempt::Final(CliError::usage(
                    "this command needs a durable store: sqlite://PATH or postgres://…",
                )))
            }
            #[cfg(feature = "postgres")]
            StoreUrl::Postgres(url) => {
                let schema = spec.schema.clone().unwrap_or_else(|| "public".to_owned());
                let config = PgConfig::new(schema).map_err(|e| CliError::usage(e.to_string()));
                let connect = PgStore::connect(url, config.map_err(Attempt::Final)?);
                // One attempt may hang (a pool waiting to connect): cut off at the timeout.
                match tokio::time::timeout(timeout, connect).await {
                    Ok(r) => Opened::Pg(r.map_err(|e| attempt(e.into()))?),
                    Err(_) => {
                        return Err(Attempt::Retry(CliError::failed(
                            "connecting to the store timed out",
                        )))
                    }
                }
            }
            StoreUrl::Sqlite(path) => Opened::Lite(
                SqliteStore::connect(path, SqliteConfig::default())
                    .await
                    .map_err(|e| Attempt::Final(e.into()))?,
            ),
        };
        let prepared = if migrate {
            store.migrate().await
        } else {
            store.db().outbox_backlog().await.map(drop)
        };
        prepared.map_err(|e| attempt(e.into()))?;
        Ok(store)
    };
    idem_runtime::retry("the store", timeout, Backoff::default(), open)
        .await
        .map_err(|e| gave_up("the store", e))
}

/// Opens the store of `spec` for `visitor`, retrying while it is unreachable (for
/// `timeout`; one attempt that hangs, a pool waiting to connect, is cut off at the
/// deadline). Once the visitor was reached (`visited`), its error is final.
pub(crate) async fn open_with_retry<V: StoreVisitor + Clone + Send>(
    spec: &StoreSpec,
    migrate: bool,
    visitor: V,
    timeout: Duration,
) -> Result<V::Output, CliError> {
    let visited = Arc::new(AtomicBool::new(false));
    let visitor = Marked {
        inner: visitor,
        visited: Arc::clone(&visited),
    };
    let visited = &*visited;
    let deadline = Instant::now() + timeout;
    let open = || async {
        let open = crate::stores::open(spec, migrate, visitor.clone());
        tokio::pin!(open);
        let r = loop {
            tokio::select! {
                r = &mut open => break r,
                () = tokio::time::sleep(Duration::from_millis(200)) => {
                    if !visited.load(Ordering::SeqCst) && Instant::now() >= deadline {
                        let e = CliError::failed("connecting to the store timed out");
                        return Err(Attempt::Retry(e));
                    }
                }
            }
        };
        r.map_err(|e| {
            if visited.load(Ordering::SeqCst) {
                Attempt::Final(e)
            } else {
                attempt(e)
            }
        })
    };
    idem_runtime::retry("the store", timeout, Backoff::default(), open)
        .await
        .map_err(|e| gave_up("the store", e))
}

/// A visitor that records that the store was opened and reached it.
#[derive(Clone)]
struct Marked<V> {
    inner: V,
    visited: Arc<AtomicBool>,
}

impl<V: StoreVisitor + Send> StoreVisitor for Marked<V> {
    type Output = V::Output;

    async fn visit<S>(
        self,
        store: S,
        db: Arc<dyn GrantDb>,
        extras: crate::stores::Extras,
    ) -> Result<Self::Output, CliError>
    where
        S: ClaimStore + Clone + 'static,
        GrantHandler: Handler<S::Tx>,
        S::Tx: crate::sql_handler::SqlTx,
    {
        self.visited.store(true, Ordering::SeqCst);
        self.inner.visit(store, db, extras).await
    }
}

/// The broker connection of `idem consume`: connected now (retried for the reconnect
/// timeout, then announced on stderr), and the function that connects to `source` anew for
/// each reconnect (owned and boxed, so the consumer's future is `Send` for every lifetime).
/// Each connection prefetches two batches per worker.
pub(crate) async fn connect_consumer(
    broker: &BrokerUrl,
    source: &str,
    config: &idem_runtime::supervise::SupervisorConfig,
    connected: &Connected,
    positions: Option<Arc<dyn idem_engine::PositionStore>>,
) -> Result<
    (
        Watched<AnyConsumer>,
        impl FnMut() -> BoxFuture<'static, Result<Watched<AnyConsumer>, Attempt<CliError>>> + Send,
    ),
    CliError,
> {
    let what = format!("{} {}", broker.kind(), broker);
    let (size, n) = (config.consumer.batch_size, config.consumer.concurrency);
    let prefetch = 2 * n * size;
    let hello = format!(
        "idem consume: {} {source} → store; batch size {size}, concurrency {n}",
        broker.kind()
    );
    let (broker, source) = (broker.clone(), source.to_owned());
    let connected = connected.clone();
    // Each stream reports through `connected` (`/readyz`): set while it delivers.
    let timeout = config.reconnect_timeout;
    let mut connect = move || {
        let (b, s, c) = (broker.clone(), source.clone(), connected.clone());
        let positions = positions.clone();
        async move {
            let what = format!("{} {}", b.kind(), b);
            bounded_try(&what, timeout, async {
                let r = AnyConsumer::connect_with(&b, &s, prefetch, positions).await;
                r.map(|stream| c.watch(stream))
                    .map_err(|e| attempt(broker_error(&what, &e)))
            })
            .await
        }
        .boxed()
    };
    let first = idem_runtime::retry(&what, timeout, Backoff::default(), &mut connect)
        .await
        .map_err(|e| gave_up(&what, e))?;
    eprintln!("{hello}");
    Ok((first, connect))
}

/// The relay's publisher to `destination`: connected now (retried for `timeout`), and
/// again after any failed publish.
pub(crate) async fn connect_publisher(
    broker: BrokerUrl,
    destination: &str,
    timeout: Duration,
) -> Result<ReconnectingPublisher<AnyPublisher>, CliError> {
    let what = format!("{} {}", broker.kind(), broker);
    let (b, d, w) = (&broker, destination, &what);
    let first = idem_runtime::retry(&what, timeout, Backoff::default(), move || async move {
        bounded_try(w, timeout, async {
            let p = AnyPublisher::connect(b, d).await;
            p.map_err(|e| attempt(broker_error(w, &e)))
        })
        .await
    })
    .await
    .map_err(|e| gave_up(&what, e))?;
    let dest = destination.to_owned();
    Ok(ReconnectingPublisher::new(Some(first), move || {
        let (url, dest) = (broker.clone(), dest.clone());
        async move {
            AnyPublisher::connect(&url, &dest).await.map_err(|e| {
                let msg = format!("connecting to {}: {}", url.kind(), error_chain(&e));
                PublishError::new(msg, true, None)
            })
        }
        .boxed()
    }))
}

/// How `idem consume` reports the supervised consumer's end: a configuration error exits
/// 2, the rest 1.
pub(crate) fn supervise_error(
    what: &str,
    source: &str,
    e: idem_runtime::supervise::SuperviseError<CliError>,
) -> CliError {
    use idem_runtime::supervise::SuperviseError;
    match e {
        SuperviseError::Connect(e) => gave_up(what, e),
        SuperviseError::Consumer(idem_engine::Error::Store(e)) => e.into(),
        SuperviseError::Consumer(idem_engine::Error::Ack(e))
            if e.class() == idem_engine::ErrorClass::Config =>
        {
            CliError::usage(format!("consuming {source}: {}", e.message))
        }
        e @ (SuperviseError::NotDrained { .. } | SuperviseError::SourceNotDrained { .. }) => {
            CliError::failed(format!("consuming {source}: {e} (--exit-when-idle)"))
        }
        e => CliError::failed(format!("consuming {source}: {e} (--reconnect-timeout)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_runtime::supervise::SuperviseError;

    /// A settlement the broker's setup refuses (a dead letter refused for good) ends
    /// `idem consume` as a configuration error does: exit 2, the broker's words kept.
    #[test]
    fn a_settlement_refused_for_good_exits_2_and_others_exit_1() {
        let refused = idem_engine::AckError::config("kafka: raise max.message.bytes", None);
        let e = supervise_error(
            "the broker",
            "kafka://k/orders",
            SuperviseError::Consumer(idem_engine::Error::Ack(refused)),
        );
        assert_eq!(e.exit_code(), 2, "{e}");
        assert!(e.to_string().contains("raise max.message.bytes"), "{e}");
        let other = idem_engine::AckError::new("closed", false, None);
        let e = supervise_error(
            "the broker",
            "kafka://k/orders",
            SuperviseError::Consumer(idem_engine::Error::Ack(other)),
        );
        assert_eq!(e.exit_code(), 1, "{e}");
    }
}
