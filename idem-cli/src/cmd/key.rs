//! `idem key`: derive a message's idempotency key, from its subject and timestamp (a grant
//! submission's award id and submission timestamp) or from `--identity` as
//! `idem consume --handler sql:FILE` does.

use std::io::Read as _;
use std::path::PathBuf;

use idem_engine::IdempotencyKey;

use crate::identity::IdentitySpec;
use crate::CliError;

/// Arguments of `idem key`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The subject: a grant's award id (it may begin with `-`: ids are data, not
    /// options). `--award-id` is the same flag.
    #[arg(
        long,
        visible_alias = "award-id",
        value_name = "ID",
        allow_hyphen_values = true,
        required_unless_present = "identity",
        conflicts_with = "identity"
    )]
    subject: Option<String>,
    /// The submission timestamp, exactly as submitted (it may begin with `-`).
    #[arg(
        long,
        allow_hyphen_values = true,
        required_unless_present = "identity",
        conflicts_with = "identity"
    )]
    timestamp: Option<String>,
    /// Derive the key as `idem consume --handler sql:FILE --identity SOURCES` does, from
    /// the payload (JSON pointers) and the --header values.
    #[arg(long, value_name = "SOURCES")]
    identity: Option<IdentitySpec>,
    /// A header of the message, for --identity header:NAME or message-id (repeat for
    /// several).
    #[arg(long, value_name = "NAME=VALUE", requires = "identity")]
    header: Vec<String>,
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
    let key = match (&args.identity, &args.subject, &args.timestamp) {
        (Some(identity), _, _) => {
            let headers = args
                .header
                .iter()
                .map(|h| {
                    h.split_once('=')
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .ok_or_else(|| CliError::usage(format!("--header {h:?}: use NAME=VALUE")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let body: Option<serde_json::Value> = serde_json::from_slice(&payload).ok();
            identity
                .identify(&payload, body.as_ref(), &headers)
                .map_err(|e| CliError::usage(e.to_string()))?
                .key
        }
        (None, Some(subject), Some(timestamp)) => {
            IdempotencyKey::derive(subject, timestamp, &payload)
                .map_err(|e| CliError::usage(e.to_string()))?
        }
        _ => {
            return Err(CliError::usage(
                "give --subject and --timestamp, or --identity",
            ))
        }
    };
    println!("{key}");
    Ok(())
}
