//! `idem consume`.

use crate::CliError;

/// Arguments of `idem consume`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

pub(crate) async fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::usage(
        "idem consume: not available in this build yet",
    ))
}
