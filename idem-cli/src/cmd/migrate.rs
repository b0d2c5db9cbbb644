//! `idem migrate`: create or update the store's tables.

use std::sync::Arc;

use idem_core::{ClaimStore, Handler};
use idem_grant::{GrantDb, GrantHandler};

use crate::stores::{self, Extras, StoreSpec, StoreVisitor};
use crate::CliError;

/// Arguments of `idem migrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The store: sqlite://PATH or postgres://… (or IDEM_STORE, else DATABASE_URL: keeps
    /// a password out of the process list and the shell's history)
    #[arg(long, env = "IDEM_STORE", hide_env_values = true)]
    store: String,
    /// The Postgres schema (created if missing).
    #[arg(long)]
    schema: Option<String>,
    /// Also make processed_messages append-only evidence (Postgres only): a trigger
    /// refuses UPDATE, DELETE and TRUNCATE except through `idem purge`.
    #[arg(long)]
    append_only: bool,
    /// Give the store a new random identity, so that no front-filter mark written before
    /// applies to it. Run it after restoring the store from a backup, failing over to a
    /// replica that may have missed commits, or copying it (README, "Front filter: store
    /// identity, restores and clones"), before any consumer starts on it.
    #[arg(long)]
    rotate_store_identity: bool,
    /// The layout of processed_messages (Postgres only), used when it does not exist yet:
    /// `plain` (the reference's table, shared with consumers in other languages),
    /// `partitioned` (by the submission month: old months are purged by dropping their
    /// partition) or `distributed` (keyed by the award id, ready for Citus: with the citus
    /// extension installed, processed_messages, disbursements and outbox are also
    /// distributed, colocated; on plain Postgres they stay local tables). docs/scale.md. An
    /// existing table keeps its layout; asking for another one over it is an error.
    #[arg(long, value_parser = parse_layout)]
    layout: Option<idem_store_postgres::PgLayout>,
    /// Partitioned layout: months of partitions to create before the current one (for
    /// history about to be loaded; older months go to the default partition).
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u32).range(0..=1200))]
    partition_months_back: u32,
    /// Partitioned layout: months of partitions to create after the current one.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=1200))]
    partition_months_ahead: u32,
}

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
    {
        Ok(())
    }
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let mut spec = StoreSpec::new(&args.store, args.schema, None)?;
    if let Some(layout) = args.layout {
        if !matches!(spec.url, stores::StoreUrl::Postgres(_)) {
            return Err(CliError::usage(
                "--layout applies to postgres:// stores only",
            ));
        }
        spec.pg_layout = Some(layout);
    }
    if matches!(spec.url, stores::StoreUrl::Postgres(_)) {
        spec.pg_partition_window = Some((args.partition_months_back, args.partition_months_ahead));
    }
    let pg_url = match (&spec.url, args.append_only) {
        (stores::StoreUrl::Postgres(url), true) => Some(url.clone()),
        (_, true) => {
            return Err(CliError::usage(
                "--append-only applies to postgres:// stores only",
            ))
        }
        (_, false) => None,
    };
    let url = spec.url.clone();
    stores::open(&spec, true, Done).await?;
    if args.rotate_store_identity {
        let id = match &url {
            stores::StoreUrl::Postgres(url) => {
                let schema = spec.schema.clone().unwrap_or_else(|| "public".to_owned());
                let config = idem_store_postgres::PgConfig::new(schema)
                    .map_err(|e| CliError::usage(e.to_string()))?
                    .with_max_connections(1);
                let store = idem_store_postgres::PgStore::connect(url, config).await?;
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
    if let Some(url) = pg_url {
        let schema = spec.schema.clone().unwrap_or_else(|| "public".to_owned());
        let config = idem_store_postgres::PgConfig::new(schema)
            .map_err(|e| CliError::usage(e.to_string()))?
            .with_max_connections(1);
        let store = idem_store_postgres::PgStore::connect(&url, config).await?;
        store.migrate_append_only().await?;
        println!("append-only: processed_messages");
    }
    if let stores::StoreUrl::Postgres(url) = &url {
        let schema = spec.schema.clone().unwrap_or_else(|| "public".to_owned());
        let config = idem_store_postgres::PgConfig::new(schema)
            .map_err(|e| CliError::usage(e.to_string()))?
            .with_max_connections(1);
        let store = idem_store_postgres::PgStore::connect(url, config).await?;
        println!("layout: {}", store.layout());
        if store.layout() == idem_store_postgres::PgLayout::Distributed {
            // What the migration did with the tables (PgStore::migrate's Citus step).
            let citus = if store.citus_installed().await? {
                "distributed (processed_messages, disbursements, outbox by award id, colocated)"
            } else {
                "not installed (the tables stay local)"
            };
            println!("citus: {citus}");
        }
        if store.layout() == idem_store_postgres::PgLayout::Partitioned {
            let months = store.partitions().await?;
            if let (Some(first), Some(last)) = (months.first(), months.last()) {
                println!("partitions: {} ({first} .. {last}) + default", months.len());
            }
        }
    }
    println!("migrated: {}", idem_core::redact_url(&args.store));
    Ok(())
}
