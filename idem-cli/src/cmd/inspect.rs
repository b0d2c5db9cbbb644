//! `idem inspect`.

use crate::CliError;

/// Arguments of `idem inspect`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

pub(crate) async fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::usage(
        "idem inspect: not available in this build yet",
    ))
}
