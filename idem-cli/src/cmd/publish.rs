//! `idem publish`.

use crate::CliError;

/// Arguments of `idem publish`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

pub(crate) async fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::usage(
        "idem publish: not available in this build yet",
    ))
}
