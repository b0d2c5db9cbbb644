//! `idem migrate`: create or update the store's tables.

use std::sync::Arc;

use idem_engine::{ClaimStore, Handler};
use idem_grant::{GrantDb, GrantHandler};

use crate::stores::{self, Extras, StoreSpec, StoreVisitor};
use crate::CliError;

/// Arguments of `idem migrate`.
#[derive(Debug, clap::Args)]
#[command(mut_arg("schema", |a| a.help(super::SCHEMA_CREATED_HELP)))]
pub(crate) struct Args {
    #[command(flatten)]
    store: super::StoreArgs,
    /// Also make processed_messages append-only evidence (Postgres only): a trigger
    /// refuses UPDATE, DELETE and TRUNCATE except through `idem purge`.
    #[arg(long)]
    append_only: bool,
    /// Give the store a new random identity, so that no front-filter mark written before
    /// applies to it. Run it after restoring the store from a backup, failing over to a
    /// replica that may have missed commits, or copying it (docs/stores.md, "Front filter: store
    /// identity, restores and clones"), before any consumer starts on it.
    #[arg(long)]
    rotate_store_identity: bool,
    /// Also create the tables of this handler: `grant` (the grant pipeline's
    /// `disbursements`, which `idem consume` with the grant handler otherwise creates at
    /// its first migrating start). Without it only idem's own tables are made: a SQL
    /// handler's tables are the team's.
    #[arg(long, value_name = "HANDLER", value_parser = ["grant"])]
    handler: Option<String>,
    /// The layout of processed_messages (Postgres only), used when it does not exist yet:
    /// `plain` (the reference's table, shared with consumers in other languages),
    /// `partitioned` (by the submission month: old months are purged by dropping their
    /// partition) or `distributed` (keyed by the award id, ready for Citus: with the citus
    /// extension installed, processed_messages, disbursements and outbox are also
    /// distributed, colocated; on plain Postgres they stay local tables). docs/scale.md. An
    /// existing table keeps its layout; asking for another one over it is an error.
    #[cfg(feature = "postgres")]
    #[arg(long, value_parser = parse_layout)]
    layout: Option<idem_store_postgres::PgLayout>,
    /// Who reads the outbox (Postgres only): `relay` (`idem relay`, the default) or `cdc`, a
    /// change-data-capture connector such as Debezium's outbox event router: events are
    /// then written published at commit, queued for no relay, and the relay refuses the
    /// schema (docs/stores.md, "Change data capture"). An existing schema switches to
    /// `cdc` only while the relay's queue is empty, and never back; without the flag a
    /// schema keeps what it records.
    #[cfg(feature = "postgres")]
    #[arg(long, value_parser = parse_outbox)]
    outbox: Option<idem_store_postgres::OutboxMode>,
    /// Partitioned layout: months of partitions to create before the current one (for
    /// history about to be loaded; older months go to the default partition).
    #[cfg(feature = "postgres")]
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u32).range(0..=1200))]
    partition_months_back: u32,
    /// Partitioned layout: months of partitions to create after the current one.
    #[cfg(feature = "postgres")]
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=1200))]
    partition_months_ahead: u32,
}

#[cfg(feature = "postgres")]
fn parse_outbox(s: &str) -> Result<idem_store_postgres::OutboxMode, String> {
    s.parse()
        .map_err(|e: idem_store_postgres::PgError| e.to_string())
}

#[cfg(feature = "postgres")]
fn parse_layout(s: &str) -> Result<idem_store_postgres::PgLayout, String> {
    s.parse()
        .map_err(|e: idem_store_postgres::PgError| e.to_string())
}

struct Done;

impl StoreVisitor for Done {
    type Output = ();

    async fn visit<S>(
        self,
        _store: S,
        _db: Arc<dyn GrantDb>,
        _extras: Extras,
    ) -> Result<(), CliError>
    where
        S: ClaimStore + Clone + 'static,
        GrantHandler: Handler<S::Tx>,
        S::Tx: crate::sql_handler::SqlTx,
    {
        Ok(())
    }
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let mut spec = StoreSpec::new(&args.store.url, args.store.schema, None)?;
    spec.grant_tables = args.handler.is_some();
    #[cfg(feature = "postgres")]
    {
        if let Some(layout) = args.layout {
            if !spec.url.is_postgres() {
                return Err(CliError::usage(
                    "--layout applies to postgres:// stores only",
                ));
            }
            spec.pg_layout = Some(layout);
        }
        if let Some(outbox) = args.outbox {
            if !spec.url.is_postgres() {
                return Err(CliError::usage(
                    "--outbox applies to postgres:// stores only",
                ));
            }
            spec.pg_outbox = Some(outbox);
        }
        if spec.url.is_postgres() {
            spec.pg_partition_window =
                Some((args.partition_months_back, args.partition_months_ahead));
        }
    }
    if args.append_only && !spec.url.is_postgres() {
        return Err(CliError::usage(
            "--append-only applies to postgres:// stores only",
        ));
    }
    let url = spec.url.clone();
    stores::open(&spec, true, Done).await?;
    if args.rotate_store_identity {
        let id = match &url {
            #[cfg(feature = "postgres")]
            stores::StoreUrl::Postgres(url) => {
                let store = postgres::connect(&spec, url).await?;
                store.rotate_store_identity().await?.store_id
            }
            stores::StoreUrl::Sqlite(path) => {
                let store = idem_store_sqlite::SqliteStore::connect(
                    path,
                    idem_store_sqlite::SqliteConfig::default(),
                )
                .await?;
                store.rotate_store_identity().await?.store_id
            }
            stores::StoreUrl::Memory => {
                return Err(CliError::usage(
                    "--rotate-store-identity applies to sqlite:// and postgres:// stores",
                ))
            }
        };
        println!("store identity: {id} (rotated)");
    }
    #[cfg(feature = "postgres")]
    if let stores::StoreUrl::Postgres(url) = &url {
        postgres::after(&spec, url, args.append_only).await?;
    }
    println!("migrated: {}", idem_engine::redact_url(&args.store.url));
    Ok(())
}

/// The Postgres-only steps.
#[cfg(feature = "postgres")]
mod postgres {
    use idem_store_postgres::{OutboxMode, PgConfig, PgLayout, PgStore};

    use crate::stores::StoreSpec;
    use crate::CliError;

    /// One connection to the store of `spec` at `url`.
    pub(super) async fn connect(spec: &StoreSpec, url: &str) -> Result<PgStore, CliError> {
        let schema = spec.schema.clone().unwrap_or_else(|| "public".to_owned());
        let config = PgConfig::new(schema)
            .map_err(|e| CliError::usage(e.to_string()))?
            .with_max_connections(1);
        Ok(PgStore::connect(url, config).await?)
    }

    /// `--append-only`, then what the migration made of the tables.
    pub(super) async fn after(
        spec: &StoreSpec,
        url: &str,
        append_only: bool,
    ) -> Result<(), CliError> {
        if append_only {
            let store = connect(spec, url).await?;
            store.migrate_append_only().await?;
            println!("append-only: processed_messages");
        }
        let store = connect(spec, url).await?;
        println!("layout: {}", store.layout());
        if store.outbox_mode() == OutboxMode::ChangeDataCapture {
            if spec.pg_outbox == Some(OutboxMode::Relay) {
                return Err(CliError::usage(
                    "--outbox relay: the outbox of this schema is read by change data \
                     capture, which is for good (its events are written published, and a \
                     relay would never see them): give the relay a new schema",
                ));
            }
            println!("outbox: read by change data capture (no relay)");
        }
        if store.layout() == PgLayout::Distributed {
            // What the migration did with the tables (PgStore::migrate's Citus step).
            let citus = if store.citus_installed().await? {
                "distributed (processed_messages, disbursements, outbox by award id, colocated)"
            } else {
                "not installed (the tables stay local)"
            };
            println!("citus: {citus}");
        }
        if store.layout() == PgLayout::Partitioned {
            let months = store.partitions().await?;
            if let (Some(first), Some(last)) = (months.first(), months.last()) {
                println!("partitions: {} ({first} .. {last}) + default", months.len());
            }
        }
        Ok(())
    }
}
