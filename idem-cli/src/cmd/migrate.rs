//! `idem migrate`.

use crate::CliError;

/// Arguments of `idem migrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

pub(crate) async fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::usage(
        "idem migrate: not available in this build yet",
    ))
}
