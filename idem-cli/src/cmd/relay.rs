//! `idem relay`.

use crate::CliError;

/// Arguments of `idem relay`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

pub(crate) async fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::usage(
        "idem relay: not available in this build yet",
    ))
}
