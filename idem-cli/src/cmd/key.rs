//! `idem key`: derive a submission's idempotency key.

use std::io::Read as _;
use std::path::PathBuf;

use idem_core::IdempotencyKey;

use crate::CliError;

/// Arguments of `idem key`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The award (business) id (it may begin with `-`: ids are data, not options).
    #[arg(long, allow_hyphen_values = true)]
    award_id: String,
    /// The submission timestamp, exactly as submitted (it may begin with `-`).
    #[arg(long, allow_hyphen_values = true)]
    timestamp: String,
    /// The raw payload; read from stdin when absent.
    #[arg(long, value_name = "FILE")]
    payload: Option<PathBuf>,
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let payload = match &args.payload {
        Some(path) => std::fs::read(path).map_err(|e| {
            CliError::usage(format!("cannot read --payload {}: {e}", path.display()))
        })?,
        None => {
            let mut buf = Vec::new();
            std::io::stdin()
                .read_to_end(&mut buf)
                .map_err(|e| CliError::usage(format!("cannot read the payload from stdin: {e}")))?;
            buf
        }
    };
    let key = IdempotencyKey::derive(&args.award_id, &args.timestamp, &payload)
        .map_err(|e| CliError::usage(e.to_string()))?;
    println!("{key}");
    Ok(())
}
