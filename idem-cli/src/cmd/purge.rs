//! `idem purge`.

use crate::CliError;

/// Arguments of `idem purge`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

pub(crate) async fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::usage(
        "idem purge: not available in this build yet",
    ))
}
