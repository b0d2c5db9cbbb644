//! `idem demo`.

use crate::CliError;

/// Arguments of `idem demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

pub(crate) async fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::usage(
        "idem demo: not available in this build yet",
    ))
}
