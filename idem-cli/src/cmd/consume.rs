//! `idem consume`: the gate (claim → the handler's writes → commit → ack) under `idem-runtime`'s
//! supervised consumer (reconnects with backoff, `--reconnect-timeout` then exit 1, a
//! configuration failure exit 2 with nothing acked, counts across reconnects). Ctrl-C or
//! SIGTERM finishes the deliveries in hand and exits 0; stdout gets `name: value` lines.
//! The handler is the grant pipeline (`--handler grant`, the default) or the team's own
//! statements (`--handler sql:FILE`, [`crate::sql_handler`], with `--identity`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_broker::any::BrokerUrl;
use idem_engine::{
    ClaimStore, ClaimTx as _, ConflictPolicy, ConsumerConfig, Gate, GateConfig, Handler,
};
use idem_grant::{GrantDb, GrantHandler, KeyDerivation};
use idem_runtime::supervise::{supervise, SourceCheck, SupervisorConfig};

use crate::cmd::{at_least_one, at_least_one_u32, broker_error, parse_secs};
use crate::identity::IdentitySpec;
use crate::sql_handler::{SqlHandler, SqlScript, SqlTx};
use crate::stores::{Extras, StoreSpec, StoreUrl, StoreVisitor};
use crate::CliError;

/// `--handler`: what a message does in the claim's transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HandlerArg {
    /// `grant`: a grant submission becomes a disbursement and its event.
    Grant,
    /// `sql:FILE`: the statements of FILE.
    Sql(PathBuf),
}

impl std::str::FromStr for HandlerArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "grant" => Ok(Self::Grant),
            _ => match s.strip_prefix("sql:") {
                Some("") => Err("sql: needs a file: --handler sql:FILE".into()),
                Some(path) => Ok(Self::Sql(PathBuf::from(path))),
                None => Err(format!("unknown handler {s:?}: use grant or sql:FILE")),
            },
        }
    }
}

/// Arguments of `idem consume`.
#[derive(Debug, clap::Args)]
#[command(mut_arg("schema", |a| a.help(super::SCHEMA_CREATED_HELP)))]
pub(crate) struct Args {
    #[arg(long, value_name = "URL", env = "IDEM_BROKER", hide_env_values = true, help = super::BROKER_HELP)]
    broker: String,
    /// What each message does in the claim's transaction: `grant` (a grant submission
    /// becomes a `disbursements` row and a `disbursement.recorded` event) or `sql:FILE`
    /// (the statements of FILE, with the body as $1 - jsonb on Postgres, JSON text on
    /// SQLite -, the key as $2, the subject as $3 and the headers as a JSON object as $4;
    /// needs --identity).
    #[arg(long, value_name = "HANDLER", default_value = "grant")]
    handler: HandlerArg,
    /// What identifies a message, for --handler sql:FILE: one or two of a JSON pointer
    /// into the body (`/order_id`), `header:NAME` or `message-id`, separated by a comma.
    /// The first is the subject; the key is sha256(subject|second|sha256(body)), the
    /// second part being `-` when one is given.
    #[arg(long, value_name = "SOURCES")]
    identity: Option<IdentitySpec>,
    /// With --handler sql:FILE: each row the last statement returns (`RETURNING …`)
    /// becomes an outbox event of this type, its payload the row as a JSON object.
    #[arg(long, value_name = "NAME")]
    event_type: Option<String>,
    /// The queue / stream to consume (created if missing).
    #[arg(long, value_name = "NAME")]
    source: String,
    #[command(flatten)]
    store: super::StoreArgs,
    /// The most deliveries committed in one transaction. Only what is already waiting is
    /// batched (never waits to fill one), so at low load this adds no latency.
    #[arg(long, default_value_t = ConsumerConfig::DEFAULT_BATCH_SIZE, value_name = "N", value_parser = at_least_one)]
    batch_size: usize,
    /// How many batches are processed at once.
    #[arg(long, default_value_t = ConsumerConfig::DEFAULT_CONCURRENCY, value_name = "N", value_parser = at_least_one)]
    concurrency: usize,
    /// Dead-letter a delivery that failed N times for its own reason with the last error
    /// (`attempts_exhausted`): a handler error or panic, or a deadline, statement timeout
    /// or internal error that recurs on it while the store's own probe write commits and
    /// no other message fails the same way. A store that is down, locked, read-only or
    /// slow for everyone never counts.
    #[arg(long, default_value_t = 10, value_name = "N", value_parser = at_least_one_u32)]
    max_attempts: u32,
    /// Run every redelivery's handler, even of a message that ended its consumer each
    /// time it ran. By default a redelivery whose earlier runs never settled (an OOM kill,
    /// an abort) is recorded in the store before it runs (`idem_runs`), and dead-lettered
    /// unrun (`attempts_exhausted`) once it has run --max-attempts times; messages that
    /// only sat in the dying consumer's buffer are not charged. Applies on NATS, SQS,
    /// RabbitMQ and Kafka, whose counts hold runs only.
    #[arg(long)]
    no_rerun_check: bool,
    /// An attempt whose business writes (a batch's, for a batch) have not returned after
    /// this long fails (`5`, `500ms`, `2m`), and a Postgres store has the server cancel
    /// any statement of the attempt at the same bound (`statement_timeout`): a handler
    /// that never returns is dead-lettered after --max-attempts instead of holding its
    /// delivery, and leaves nothing running on the server.
    #[arg(long, value_name = "DURATION", value_parser = parse_secs, default_value = "30")]
    handler_timeout: Duration,
    /// What a conflicting resubmission leads to - the same award id and submission
    /// timestamp as one already claimed, but another payload (an amount changed, fields
    /// reordered, a space added): `dead-letter` rolls it back and dead-letters it with
    /// reason `conflict`, naming both keys; `process` disburses it again (the reference
    /// behaviour).
    #[arg(long, value_name = "POLICY", default_value_t = ConflictPolicy::DeadLetter)]
    on_conflict: ConflictPolicy,
    /// How keys are derived: `reference` hashes the body's bytes (byte-identical to the
    /// reference consumer: keep it for a table shared with it); `canonical-json` hashes its
    /// RFC 8785 canonical form, so a body resent with other spacing or field order is a
    /// duplicate, not a conflict.
    #[arg(long, value_name = "DERIVATION", default_value_t = KeyDerivation::Reference)]
    key_derivation: KeyDerivation,
    /// A Redis front filter (redis://…) before the durable store (or IDEM_FRONT_FILTER).
    #[arg(
        long,
        value_name = "URL",
        env = "IDEM_FRONT_FILTER",
        hide_env_values = true
    )]
    front_filter: Option<String>,
    /// Stop once no delivery arrived for this long (`5`, `500ms`, `2m`) and nothing is
    /// left: a delivery that failed or was deferred is waited for until it comes back and
    /// settles, and the broker is asked what the source still holds (messages another
    /// consumer holds, a killed one's until the broker hands them on, records behind the
    /// group's offset in partitions assigned elsewhere). What does not reach this consumer
    /// within twice the longest retry delay (two minutes) ends the run with exit 1,
    /// saying how much is left.
    #[arg(long, value_name = "DURATION", value_parser = parse_secs)]
    exit_when_idle: Option<Duration>,
    /// Serve Prometheus metrics over HTTP at ADDR (e.g. 127.0.0.1:9898).
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

/// The handler `idem consume` runs.
#[derive(Clone)]
enum Chosen {
    Grant(KeyDerivation),
    Sql(SqlHandler),
}

#[derive(Clone)]
struct Consume {
    handler: Chosen,
    migrate: bool,
    broker: BrokerUrl,
    source: String,
    config: SupervisorConfig,
    gate: GateConfig,
    handler_timeout: Duration,
    metrics: Arc<crate::metrics::ConsumeEndpoint>,
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
        S::Tx: SqlTx,
    {
        if !self.migrate {
            // Fail now, naming the table.
            match self.handler {
                Chosen::Grant(_) => db.check_grants().await?,
                Chosen::Sql(_) => db.outbox_backlog().await.map(drop)?,
            }
        }
        match self.handler.clone() {
            Chosen::Grant(derivation) => {
                let handler = db.grant_handler().with_key_derivation(derivation);
                self.serve(store, db, extras, handler).await
            }
            Chosen::Sql(handler) => {
                // A statement the server cannot parse or plan is a usage error now, not a
                // dead letter per message.
                let mut tx = store.begin().await?;
                let prepared = tx.prepare_script(handler.script()).await;
                let _ = tx.rollback().await;
                prepared.map_err(|e| CliError::usage(format!("--handler sql: {e}")))?;
                self.serve(store, db, extras, handler).await
            }
        }
    }
}

impl Consume {
    /// Runs the gate with `handler` under the supervised consumer.
    async fn serve<S, H>(
        self,
        store: S,
        db: Arc<dyn GrantDb>,
        extras: Extras,
        handler: H,
    ) -> Result<idem_runtime::supervise::Supervised, CliError>
    where
        S: ClaimStore + Clone + 'static,
        H: Handler<S::Tx> + 'static,
    {
        self.metrics.opened(db, extras.filter_stats);
        let (broker, source) = (&self.broker, &self.source);
        let (first, connect) = super::connect_consumer(
            broker,
            source,
            &self.config,
            &self.metrics.broker,
            extras.positions.clone(),
        )
        .await?;
        let handler = idem_runtime::Deadline::new(handler, self.handler_timeout);
        // The metrics, and the outcome tally when the store can keep one.
        let (observer, flusher) = idem_runtime::tally::with_outcome_tally(
            self.metrics.metrics.stages(),
            extras.outcome_counts,
        );
        let gate = Gate::with_config(store, handler, self.gate).with_observer(observer);
        let (m, shutdown) = (Arc::clone(&self.metrics), crate::cmd::shutdown_signal());
        let observe = move |o: &idem_engine::Outcome| m.metrics.record(o);
        let run = supervise(&gate, Some(first), connect, self.config, shutdown, observe).await;
        if let Some(f) = flusher {
            f.finish().await;
        }
        let what = format!("{} {broker}", broker.kind());
        run.map_err(|e| super::supervise_error(&what, source, e))
    }
}

/// The handler the arguments choose, checked before anything is opened.
fn chosen(args: &Args, store: &StoreUrl) -> Result<Chosen, CliError> {
    match &args.handler {
        HandlerArg::Grant => {
            if args.identity.is_some() || args.event_type.is_some() {
                return Err(CliError::usage(
                    "--identity and --event-type go with --handler sql:FILE; the grant \
                     handler's identity is the award id and the submission timestamp",
                ));
            }
            Ok(Chosen::Grant(args.key_derivation))
        }
        HandlerArg::Sql(path) => {
            if matches!(store, StoreUrl::Memory) {
                return Err(CliError::usage(
                    "--handler sql: needs a postgres:// or sqlite:// store (memory:// has no SQL)",
                ));
            }
            let Some(identity) = args.identity.clone() else {
                return Err(CliError::usage(
                    "--handler sql:FILE needs --identity: what identifies a message \
                     (a JSON pointer such as /order_id, header:NAME or message-id)",
                ));
            };
            let text = std::fs::read_to_string(path).map_err(|e| {
                CliError::usage(format!("cannot read --handler sql:{}: {e}", path.display()))
            })?;
            let script =
                SqlScript::parse(&path.display().to_string(), &text, args.event_type.clone())
                    .map_err(|e| CliError::usage(format!("--handler sql: {e}")))?;
            Ok(Chosen::Sql(SqlHandler::new(
                script,
                identity,
                args.key_derivation,
            )))
        }
    }
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let broker = BrokerUrl::parse(&args.broker).map_err(|e| broker_error("--broker", &e))?;
    let mut spec = StoreSpec::new(
        &args.store.url,
        args.store.schema.clone(),
        args.front_filter.clone(),
    )?;
    let handler = chosen(&args, &spec.url)?;
    // The grant pipeline's table comes with the grant handler.
    spec.grant_tables = matches!(handler, Chosen::Grant(_));
    // The server cancels a statement the handler's deadline gave up on.
    spec.statement_timeout = Some(
        args.handler_timeout
            .max(std::time::Duration::from_millis(1)),
    );
    let metrics = Arc::new(crate::metrics::ConsumeEndpoint::default());
    if let Some(addr) = args.metrics_addr {
        metrics.serve(addr).await?;
    }
    let (started, timeout) = (Instant::now(), args.reconnect_timeout);
    // A drain ends only when the source holds nothing more for it.
    let source_check = args.exit_when_idle.map(|_| {
        let (url, name) = (broker.clone(), args.source.clone());
        SourceCheck::new(move || {
            let (url, name) = (url.clone(), name.clone());
            async move {
                idem_broker::any::pending_count(&url, &name)
                    .await
                    .map_err(Into::into)
            }
        })
    });
    let config = SupervisorConfig::new(ConsumerConfig::new(args.concurrency, args.batch_size))
        .exit_when_idle(args.exit_when_idle)
        .source_check(source_check)
        .reconnect_timeout(timeout);
    let migrate = !args.no_migrate;
    let visitor = Consume {
        handler,
        migrate,
        broker,
        source: args.source,
        config,
        handler_timeout: args.handler_timeout,
        gate: GateConfig::default()
            .with_max_attempts(args.max_attempts)
            .with_check_attempts_before_handler(!args.no_rerun_check)
            .with_on_conflict(args.on_conflict),
        metrics,
    };
    let run = super::open_with_retry(&spec, migrate, visitor, timeout).await?;
    let done = run.stats.deliveries();
    let out = crate::out::Out::new();
    super::report(out, &run.stats.counts(), started, run.busy, done);
    Ok(())
}
