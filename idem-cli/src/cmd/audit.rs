//! `idem audit export`: the dedup records claimed in a window and their outbox events,
//! as JSON lines for a write-once archive.
//!
//! # Format `idem-audit/1` (stable)
//! One JSON object per line, one line per dedup record, in `claimed_at` order (ties by
//! key), with keys in this order:
//!
//! ```text
//! {"format":"idem-audit/1","idempotency_key":"<64 hex>","award_id":"A-1"|null,
//!  "claimed_at":"2026-07-01T09:00:00.000000Z",
//!  "events":[{"event_id":"<64 hex>"|null,"event_type":"disbursement.recorded",
//!             "created_at":"…"|null,"published_at":"…"|null}]}
//! ```
//!
//! Timestamps are RFC 3339 UTC with microseconds. Payloads are never exported. New
//! fields may be added at the end of an object; a change of meaning gets a new format
//! name.

use std::io::Write;

use idem_store_postgres::{ClaimRecord, PgConfig, PgError, PgStore};

use crate::stores::{self, StoreSpec, StoreUrl};
use crate::CliError;

/// The format name written in every line.
pub(crate) const FORMAT: &str = "idem-audit/1";

/// Arguments of `idem audit`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    command: AuditCommand,
}

#[derive(Debug, clap::Subcommand)]
enum AuditCommand {
    /// Writes the dedup records claimed in [--since, --until) and their outbox events as
    /// JSON lines (format idem-audit/1).
    Export(ExportArgs),
}

/// Arguments of `idem audit export`.
#[derive(Debug, clap::Args)]
struct ExportArgs {
    /// The store: postgres://…
    #[arg(long)]
    store: String,
    /// The Postgres schema.
    #[arg(long)]
    schema: Option<String>,
    /// Start of the window, inclusive (RFC 3339, e.g. 2026-07-01T00:00:00Z).
    #[arg(long)]
    since: String,
    /// End of the window, exclusive (RFC 3339).
    #[arg(long)]
    until: String,
    /// Write to this file (created; an existing file is never overwritten) instead of
    /// stdout.
    #[arg(long)]
    output: Option<std::path::PathBuf>,
    /// Dedup records per query.
    #[arg(long, default_value_t = 1000)]
    page_size: usize,
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    match args.command {
        AuditCommand::Export(a) => export(a).await,
    }
}

async fn export(args: ExportArgs) -> Result<(), CliError> {
    let spec = StoreSpec::new(&args.store, args.schema.clone(), None)?;
    let StoreUrl::Postgres(url) = &spec.url else {
        return Err(CliError::usage(
            "idem audit export: only postgres:// stores are supported",
        ));
    };
    for (name, value) in [("--since", &args.since), ("--until", &args.until)] {
        if !is_rfc3339(value) {
            return Err(CliError::usage(format!(
                "{name} {value:?} is not an RFC 3339 timestamp (e.g. 2026-07-01T00:00:00Z)"
            )));
        }
    }
    if args.page_size == 0 {
        return Err(CliError::usage("--page-size must be at least 1"));
    }
    let mut out: Box<dyn Write + Send> = match &args.output {
        None => Box::new(std::io::BufWriter::new(std::io::stdout())),
        Some(path) => {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)
                .map_err(|e| CliError::usage(format!("--output {}: {e}", path.display())))?;
            Box::new(std::io::BufWriter::new(file))
        }
    };
    let schema = spec.schema.clone().unwrap_or_else(|| "public".to_owned());
    let config = PgConfig::new(schema)
        .map_err(|e| CliError::usage(e.to_string()))?
        .with_max_connections(2);
    let store = PgStore::connect(url, config).await?;
    let summary = store
        .export_audit(&args.since, &args.until, args.page_size, |r| {
            out.write_all(audit_line(r).as_bytes())?;
            out.write_all(b"\n")
        })
        .await
        .map_err(|e| match e {
            PgError::InvalidTimestamp { .. } => CliError::usage(e.to_string()),
            other => CliError::failed(format!(
                "audit export from {}: {}",
                stores::redact(&args.store),
                crate::error::error_chain(&other)
            )),
        })?;
    out.flush()
        .map_err(|e| CliError::failed(format!("writing the audit export: {e}")))?;
    drop(out);
    if let Some(path) = &args.output {
        // Durable before we say so.
        std::fs::File::open(path)
            .and_then(|f| f.sync_all())
            .map_err(|e| CliError::failed(format!("syncing {}: {e}", path.display())))?;
    }
    eprintln!(
        "exported: {} claims, {} events",
        summary.claims, summary.events
    );
    Ok(())
}

/// One line of format `idem-audit/1` (without the newline).
pub(crate) fn audit_line(r: &ClaimRecord) -> String {
    fn s(v: &str) -> String {
        serde_json::Value::from(v).to_string()
    }
    fn opt(v: Option<String>) -> String {
        v.map_or_else(|| "null".to_owned(), |v| s(&v))
    }
    let events: Vec<String> = r
        .events
        .iter()
        .map(|e| {
            format!(
                "{{\"event_id\":{},\"event_type\":{},\"created_at\":{},\"published_at\":{}}}",
                opt(e.event_id.clone()),
                s(&e.event_type),
                opt(e.created_at.map(|t| t.to_string())),
                opt(e.published_at.map(|t| t.to_string())),
            )
        })
        .collect();
    format!(
        "{{\"format\":{},\"idempotency_key\":{},\"award_id\":{},\"claimed_at\":{},\"events\":[{}]}}",
        s(FORMAT),
        s(&r.key),
        opt(r.award_id.clone()),
        opt(r.claimed_at.map(|t| t.to_string())),
        events.join(",")
    )
}

/// `YYYY-MM-DD(T|t| )HH:MM:SS[.frac](Z|z|±HH:MM)`, with plausible field ranges (the
/// server checks the calendar).
fn is_rfc3339(v: &str) -> bool {
    let b = v.as_bytes();
    let digits =
        |r: std::ops::Range<usize>| b.get(r).is_some_and(|s| s.iter().all(u8::is_ascii_digit));
    if b.len() < 20
        || !digits(0..4)
        || b[4] != b'-'
        || !digits(5..7)
        || b[7] != b'-'
        || !digits(8..10)
        || !matches!(b[10], b'T' | b't' | b' ')
        || !digits(11..13)
        || b[13] != b':'
        || !digits(14..16)
        || b[16] != b':'
        || !digits(17..19)
    {
        return false;
    }
    let num = |r: std::ops::Range<usize>| v[r].parse::<u32>().unwrap_or(99);
    if !(1..=12).contains(&num(5..7))
        || !(1..=31).contains(&num(8..10))
        || num(11..13) > 23
        || num(14..16) > 59
        || num(17..19) > 60
    {
        return false;
    }
    let mut i = 19;
    if b[i] == b'.' {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start {
            return false;
        }
    }
    match &b[i..] {
        [b'Z' | b'z'] => true,
        [b'+' | b'-', h1, h2, b':', m1, m2] => [h1, h2, m1, m2].iter().all(|c| c.is_ascii_digit()),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::is_rfc3339;

    #[test]
    fn rfc3339_is_checked() {
        for ok in [
            "2026-07-01T09:00:00Z",
            "2026-07-01T09:00:00.123456Z",
            "2026-07-01t09:00:00+02:00",
            "2026-07-01 09:00:00-05:30",
        ] {
            assert!(is_rfc3339(ok), "{ok}");
        }
        for bad in [
            "",
            "yesterday",
            "2026-07-01",
            "2026-13-01T09:00:00Z",
            "2026-07-01T09:00:00",
            "2026-07-01T09:00:00.Z",
            "2026-07-01T25:00:00Z",
            "2026-07-01T09:00:00+0200",
        ] {
            assert!(!is_rfc3339(bad), "{bad}");
        }
    }
}
