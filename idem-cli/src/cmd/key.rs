//! `idem key`.

use crate::CliError;

/// Arguments of `idem key`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

pub(crate) async fn run(_args: Args) -> Result<(), CliError> {
    Err(CliError::usage("idem key: not available in this build yet"))
}
