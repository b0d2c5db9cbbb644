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
//! name. Postgres keeps microseconds; SQLite milliseconds (written `.123000Z`).

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
    /// The store: postgres://… or sqlite://PATH
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
    if let StoreUrl::Memory = &spec.url {
        return Err(CliError::usage(
            "idem audit export: use a postgres:// or sqlite:// store",
        ));
    }
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
    let (claims, events) = match &spec.url {
        StoreUrl::Sqlite(path) => {
            export_sqlite(path, &args.since, &args.until, args.page_size, |c| {
                out.write_all(audit_line(c).as_bytes())?;
                out.write_all(b"\n")
            })
            .await?
        }
        StoreUrl::Postgres(url) => {
            let schema = spec.schema.clone().unwrap_or_else(|| "public".to_owned());
            let config = PgConfig::new(schema)
                .map_err(|e| CliError::usage(e.to_string()))?
                .with_max_connections(2);
            let store = PgStore::connect(url, config).await?;
            let summary = store
                .export_audit(&args.since, &args.until, args.page_size, |r| {
                    out.write_all(audit_line(&AuditClaim::from(r)).as_bytes())?;
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
            (summary.claims, summary.events)
        }
        StoreUrl::Memory => {
            return Err(CliError::usage(
                "idem audit export: use a postgres:// or sqlite:// store",
            ))
        }
    };
    out.flush()
        .map_err(|e| CliError::failed(format!("writing the audit export: {e}")))?;
    drop(out);
    if let Some(path) = &args.output {
        // Durable before we say so.
        std::fs::File::open(path)
            .and_then(|f| f.sync_all())
            .map_err(|e| CliError::failed(format!("syncing {}: {e}", path.display())))?;
    }
    eprintln!("exported: {claims} claims, {events} events");
    Ok(())
}

/// One outbox event of an export line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AuditEvent {
    pub(crate) event_id: Option<String>,
    pub(crate) event_type: String,
    pub(crate) created_at: Option<String>,
    pub(crate) published_at: Option<String>,
}

/// One dedup record with its events, whatever the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AuditClaim {
    pub(crate) key: String,
    pub(crate) award_id: Option<String>,
    pub(crate) claimed_at: Option<String>,
    pub(crate) events: Vec<AuditEvent>,
}

impl From<&ClaimRecord> for AuditClaim {
    fn from(r: &ClaimRecord) -> Self {
        Self {
            key: r.key.clone(),
            award_id: r.award_id.clone(),
            claimed_at: r.claimed_at.map(|t| t.to_string()),
            events: r
                .events
                .iter()
                .map(|e| AuditEvent {
                    event_id: e.event_id.clone(),
                    event_type: e.event_type.clone(),
                    created_at: e.created_at.map(|t| t.to_string()),
                    published_at: e.published_at.map(|t| t.to_string()),
                })
                .collect(),
        }
    }
}

/// One line of format `idem-audit/1` (without the newline).
pub(crate) fn audit_line(r: &AuditClaim) -> String {
    fn s(v: &str) -> String {
        serde_json::Value::from(v).to_string()
    }
    fn opt(v: Option<&str>) -> String {
        v.map_or_else(|| "null".to_owned(), s)
    }
    let events: Vec<String> = r
        .events
        .iter()
        .map(|e| {
            format!(
                "{{\"event_id\":{},\"event_type\":{},\"created_at\":{},\"published_at\":{}}}",
                opt(e.event_id.as_deref()),
                s(&e.event_type),
                opt(e.created_at.as_deref()),
                opt(e.published_at.as_deref()),
            )
        })
        .collect();
    format!(
        "{{\"format\":{},\"idempotency_key\":{},\"award_id\":{},\"claimed_at\":{},\"events\":[{}]}}",
        s(FORMAT),
        s(&r.key),
        opt(r.award_id.as_deref()),
        opt(r.claimed_at.as_deref()),
        events.join(",")
    )
}

/// SQLite's `…SS.sssZ` as the format's `…SS.ssssssZ`; anything else as stored.
fn sqlite_ts(v: Option<String>) -> Option<String> {
    v.map(|t| {
        let b = t.as_bytes();
        if b.len() == 24 && b[19] == b'.' && b[23] == b'Z' {
            format!("{}000Z", &t[..23])
        } else {
            t
        }
    })
}

/// The SQLite export: the same window, order, paging and lines as Postgres'.
async fn export_sqlite(
    path: &str,
    since: &str,
    until: &str,
    page_size: usize,
    mut sink: impl FnMut(&AuditClaim) -> std::io::Result<()>,
) -> Result<(u64, u64), CliError> {
    use idem_store_sqlite::sqlx::{self, Row};
    if !std::path::Path::new(path).exists() {
        return Err(CliError::usage(format!(
            "--store sqlite://{path}: no such file"
        )));
    }
    let store = idem_store_sqlite::SqliteStore::open(path, Default::default()).await?;
    let failed =
        |e: sqlx::Error| CliError::failed(format!("audit export from sqlite://{path}: {e}"));
    // Claims are stored as UTC `YYYY-MM-DDTHH:MM:SS.sssZ` text: normalise the bounds the
    // same way, then compare text.
    let fmt = "%Y-%m-%dT%H:%M:%fZ";
    let row = sqlx::query("SELECT strftime(?1, ?2), strftime(?1, ?3)")
        .bind(fmt)
        .bind(since)
        .bind(until)
        .fetch_one(store.pool())
        .await
        .map_err(failed)?;
    let (Some(lo), Some(hi)) = (
        row.try_get::<Option<String>, _>(0).map_err(failed)?,
        row.try_get::<Option<String>, _>(1).map_err(failed)?,
    ) else {
        return Err(CliError::usage(format!(
            "invalid timestamp in --since {since:?} / --until {until:?}"
        )));
    };
    let limit = i64::try_from(page_size).unwrap_or(i64::MAX);
    let (mut claims, mut events) = (0u64, 0u64);
    let mut cursor = (String::new(), String::new());
    loop {
        let rows = sqlx::query(
            "SELECT idempotency_key, award_id, claimed_at FROM processed_messages \
             WHERE claimed_at >= ?1 AND claimed_at < ?2 AND (claimed_at, idempotency_key) > (?3, ?4) \
             ORDER BY claimed_at, idempotency_key LIMIT ?5",
        )
        .bind(&lo)
        .bind(&hi)
        .bind(&cursor.0)
        .bind(&cursor.1)
        .bind(limit)
        .fetch_all(store.pool())
        .await
        .map_err(failed)?;
        let full = rows.len() >= page_size;
        let mut page = Vec::with_capacity(rows.len());
        for row in rows {
            let claimed_at: Option<String> = row.try_get(2).map_err(failed)?;
            cursor = (
                claimed_at.clone().unwrap_or_default(),
                row.try_get(0).map_err(failed)?,
            );
            page.push(AuditClaim {
                key: cursor.1.clone(),
                award_id: row.try_get(1).map_err(failed)?,
                claimed_at: sqlite_ts(claimed_at),
                events: Vec::new(),
            });
        }
        if page.is_empty() {
            break;
        }
        let keys: Vec<&str> = page.iter().map(|c| c.key.as_str()).collect();
        let keys = serde_json::to_string(&keys).unwrap_or_else(|_| "[]".to_owned());
        let rows = sqlx::query(
            "SELECT event_id, event_type, idempotency_key, created_at, published_at FROM outbox \
             WHERE idempotency_key IN (SELECT value FROM json_each(?1)) ORDER BY id",
        )
        .bind(keys)
        .fetch_all(store.pool())
        .await
        .map_err(failed)?;
        let index: std::collections::HashMap<String, usize> = page
            .iter()
            .enumerate()
            .map(|(i, c)| (c.key.clone(), i))
            .collect();
        for row in rows {
            let key: String = row.try_get(2).map_err(failed)?;
            if let Some(c) = index.get(&key).map(|&i| &mut page[i]) {
                c.events.push(AuditEvent {
                    event_id: row.try_get(0).map_err(failed)?,
                    event_type: row.try_get(1).map_err(failed)?,
                    created_at: sqlite_ts(row.try_get(3).map_err(failed)?),
                    published_at: sqlite_ts(row.try_get(4).map_err(failed)?),
                });
            }
        }
        for c in &page {
            sink(c).map_err(|e| CliError::failed(format!("writing the audit export: {e}")))?;
            claims += 1;
            events += c.events.len() as u64;
        }
        if !full {
            break;
        }
    }
    Ok((claims, events))
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
