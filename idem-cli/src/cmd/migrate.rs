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
    stores::open(&spec, true, Done).await?;
    println!("migrated: {}", stores::redact(&args.store));
    Ok(())
}
