//! `idem migrate`: create or update the store's tables.

use std::sync::Arc;

use idem_core::{ClaimStore, Handler};
use idem_grant::{GrantDb, GrantHandler};

use crate::stores::{self, Extras, StoreSpec, StoreVisitor};
use crate::CliError;

/// Arguments of `idem migrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The store: sqlite://PATH or postgres://…
    #[arg(long)]
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
    let spec = StoreSpec::new(&args.store, args.schema, None)?;
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
                let store = idem_store_sqlite::SqliteStore::open(
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
    println!("migrated: {}", stores::redact(&args.store));
    Ok(())
}
