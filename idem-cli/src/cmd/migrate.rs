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
    stores::open(&spec, true, Done).await?;
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
