//! `idem audit export`: the dedup records claimed in a window and their outbox events,
//! as JSON lines for a write-once archive; `idem audit report`: one self-contained HTML
//! page an auditor can read (see [`crate::report`]).
//!
//! Both read through the stores' own `export_audit` / `audit_stats` (Postgres and
//! SQLite alike, one record type: `idem_engine::record`); no SQL here.
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

#[cfg(feature = "postgres")]
use idem_engine::ident::Ident;
use idem_engine::record::{BusinessTable, ClaimRecord, Timestamp};
use idem_engine::retention::{RetentionFloor, DEFAULT_RETENTION_FLOOR};
#[cfg(feature = "postgres")]
use idem_store_postgres::{PgConfig, PgError, PgStore};
use idem_store_sqlite::{SqliteConfig, SqliteStore};
use serde::Serialize;

#[cfg(feature = "postgres")]
use crate::error::error_chain;
use crate::stores::StoreUrl;
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
    /// Writes one self-contained HTML page for an auditor: activity per day, the claims
    /// recounted against the business table, retention, a sample of keys.
    Report(ReportArgs),
}

/// `--store`, `--schema`, `--since`, `--until`.
#[derive(Debug, clap::Args)]
struct Window {
    /// The store: postgres://… or sqlite://PATH (or IDEM_STORE, else DATABASE_URL)
    #[arg(long, env = "IDEM_STORE", hide_env_values = true)]
    store: String,
    /// The Postgres schema.
    #[arg(long)]
    schema: Option<String>,
    /// Start of the window, inclusive (RFC 3339, e.g. 2026-07-01T00:00:00Z, or a date).
    #[arg(long, allow_hyphen_values = true)]
    since: String,
    /// End of the window, exclusive (RFC 3339 or a date).
    #[arg(long, allow_hyphen_values = true)]
    until: String,
}

/// Arguments of `idem audit export`.
#[derive(Debug, clap::Args)]
struct ExportArgs {
    #[command(flatten)]
    window: Window,
    /// Write to this file (created; an existing file is never overwritten) instead of
    /// stdout.
    #[arg(long)]
    output: Option<std::path::PathBuf>,
    /// Dedup records per query.
    #[arg(long, default_value_t = 1000)]
    page_size: usize,
}

/// Arguments of `idem audit report`.
#[derive(Debug, clap::Args)]
struct ReportArgs {
    #[command(flatten)]
    window: Window,
    /// The HTML file to write (created; an existing file is never overwritten).
    #[arg(long)]
    out: std::path::PathBuf,
    /// The retention floor the retention section measures against (default 3y).
    #[arg(long, value_parser = crate::cmd::parse_floor)]
    retention_floor: Option<RetentionFloor>,
    /// Dedup records shown with the command that re-derives their key.
    #[arg(long, default_value_t = 10)]
    sample: usize,
    /// The business table recounted against the claims (its rows carry
    /// idempotency_key, an amount and a subject).
    #[arg(long, default_value = "disbursements")]
    business_table: String,
    /// The business table's amount column.
    #[arg(long, default_value = "amount_cents")]
    amount_column: String,
    /// The business table's subject column.
    #[arg(long, default_value = "award_id")]
    subject_column: String,
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    match args.command {
        AuditCommand::Export(a) => export(a).await,
        AuditCommand::Report(a) => report(a).await,
    }
}

/// An opened SQL store.
enum Sql {
    #[cfg(feature = "postgres")]
    Pg(PgStore),
    Sqlite(SqliteStore),
}

impl Window {
    /// Both bounds are RFC 3339; a bare date (`2026-07-01`, its midnight UTC) only where
    /// `dates` says so (the report; an export's bounds stay exact timestamps).
    fn check(&self, dates: bool) -> Result<(), CliError> {
        for (name, value) in [("--since", &self.since), ("--until", &self.until)] {
            if Timestamp::parse_rfc3339(value).is_none() || (!dates && value.len() == 10) {
                return Err(CliError::usage(format!(
                    "{name} {value:?} is not an RFC 3339 timestamp (e.g. 2026-07-01T00:00:00Z)"
                )));
            }
        }
        Ok(())
    }

    /// Opens the store (an existing one: nothing is created).
    async fn open(&self, command: &str) -> Result<Sql, CliError> {
        match StoreUrl::parse(&self.store)? {
            #[cfg(feature = "postgres")]
            StoreUrl::Postgres(url) => {
                let schema = self.schema.clone().unwrap_or_else(|| "public".to_owned());
                Ident::new(&schema)?;
                let config = PgConfig::new(schema)
                    .map_err(|e| CliError::usage(e.to_string()))?
                    .with_max_connections(2);
                Ok(Sql::Pg(PgStore::connect(&url, config).await?))
            }
            StoreUrl::Sqlite(path) => {
                if self.schema.is_some() {
                    return Err(CliError::usage(
                        "--schema applies to postgres:// stores only",
                    ));
                }
                if !std::path::Path::new(&path).exists() {
                    return Err(CliError::usage(format!(
                        "--store sqlite://{path}: no such file"
                    )));
                }
                let mut config = SqliteConfig::default();
                config.create_if_missing = false;
                Ok(Sql::Sqlite(SqliteStore::connect(&path, config).await?))
            }
            StoreUrl::Memory => Err(CliError::usage(format!(
                "idem audit {command}: use a postgres:// or sqlite:// store"
            ))),
        }
    }

    #[cfg(feature = "postgres")]
    fn pg_error(&self, what: &str, e: PgError) -> CliError {
        match e {
            PgError::InvalidTimestamp { .. } => CliError::usage(e.to_string()),
            other => CliError::failed(format!(
                "{what} {}: {}",
                idem_engine::redact_url(&self.store),
                error_chain(&other)
            )),
        }
    }
}

/// Creates `path` for writing; an existing file is never overwritten.
fn create(flag: &str, path: &std::path::Path) -> Result<std::fs::File, CliError> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| CliError::usage(format!("{flag} {}: {e}", path.display())))
}

/// Flushes nothing more: syncs `path` to disk, durable before we say so.
fn sync(path: &std::path::Path) -> Result<(), CliError> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| CliError::failed(format!("syncing {}: {e}", path.display())))
}

async fn export(args: ExportArgs) -> Result<(), CliError> {
    let w = &args.window;
    w.check(false)?;
    if args.page_size == 0 {
        return Err(CliError::usage("--page-size must be at least 1"));
    }
    let store = w.open("export").await?;
    let mut out: Box<dyn Write + Send> = match &args.output {
        None => Box::new(std::io::BufWriter::new(std::io::stdout())),
        Some(path) => Box::new(std::io::BufWriter::new(create("--output", path)?)),
    };
    // A spinner on stderr at a terminal (nothing elsewhere): claims exported so far.
    let progress = indicatif::ProgressBar::new_spinner().with_style(
        indicatif::ProgressStyle::with_template("{spinner} {pos} claims exported  {per_sec}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    let summary = {
        let mut write = |r: &ClaimRecord| {
            serde_json::to_writer(&mut out, &AuditLine::new(r))?;
            progress.inc(1);
            out.write_all(b"\n")
        };
        match &store {
            #[cfg(feature = "postgres")]
            Sql::Pg(s) => s
                .export_audit(&w.since, &w.until, args.page_size, &mut write)
                .await
                .map_err(|e| w.pg_error("audit export from", e))?,
            Sql::Sqlite(s) => {
                s.export_audit(&w.since, &w.until, args.page_size, &mut write)
                    .await?
            }
        }
    };
    progress.finish_and_clear();
    out.flush()
        .map_err(|e| CliError::failed(format!("writing the audit export: {e}")))?;
    drop(out);
    if let Some(path) = &args.output {
        sync(path)?;
    }
    eprintln!(
        "exported: {} claims, {} events",
        summary.claims, summary.events
    );
    Ok(())
}

async fn report(args: ReportArgs) -> Result<(), CliError> {
    let w = &args.window;
    w.check(true)?;
    let business = BusinessTable::new(
        &args.business_table,
        &args.amount_column,
        &args.subject_column,
    )?;
    // The cutoff `idem purge` would refuse to go past: the same floor, the same years.
    let floor = args.retention_floor.unwrap_or(DEFAULT_RETENTION_FLOOR);
    let now = Timestamp::now();
    let cutoff = floor.cutoff(now);
    let store = w.open("report").await?;
    // The bounds as UTC instants (a bare date is its midnight UTC, as the page says),
    // whatever the server's time zone.
    let utc = |v: &str| Timestamp::parse_rfc3339(v).map_or_else(|| v.to_owned(), |t| t.to_string());
    let (since, until) = (utc(&w.since), utc(&w.until));
    let (stats, kind) = match &store {
        #[cfg(feature = "postgres")]
        Sql::Pg(s) => (
            s.audit_stats(&since, &until, &business, cutoff, args.sample)
                .await
                .map_err(|e| w.pg_error("audit report from", e))?,
            "PostgreSQL",
        ),
        Sql::Sqlite(s) => (
            s.audit_stats(&since, &until, &business, cutoff, args.sample)
                .await?,
            "SQLite",
        ),
    };
    let page = crate::report::render(&crate::report::Report {
        store: idem_engine::redact_url(&w.store).into_owned(),
        schema: w.schema.clone(),
        store_kind: kind,
        since: Timestamp::parse_rfc3339(&w.since).unwrap_or(now),
        until: Timestamp::parse_rfc3339(&w.until).unwrap_or(now),
        generated: now,
        floor,
        business: &business,
        stats: &stats,
    });
    let mut file = create("--out", &args.out)?;
    file.write_all(page.as_bytes())
        .map_err(|e| CliError::failed(format!("writing {}: {e}", args.out.display())))?;
    drop(file);
    sync(&args.out)?;
    let rec = &stats.reconciliation;
    let mut out = crate::out::Out::new();
    out.field("report", args.out.display().to_string());
    out.field("claims", rec.claims);
    out.field("business_rows", rec.rows);
    out.field("amount_total", rec.amount_total.to_string());
    out.field("totals", if rec.agrees() { "agree" } else { "DISAGREE" });
    out.finish();
    Ok(())
}

/// One line of format `idem-audit/1`: a dedup record, its fields in this order.
#[derive(Serialize)]
pub(crate) struct AuditLine<'a> {
    format: &'static str,
    idempotency_key: &'a str,
    award_id: Option<&'a str>,
    #[serde(serialize_with = "rfc3339")]
    claimed_at: Option<Timestamp>,
    events: Vec<EventLine<'a>>,
}

/// One outbox event of an [`AuditLine`] (never its payload).
#[derive(Serialize)]
struct EventLine<'a> {
    event_id: Option<&'a str>,
    event_type: &'a str,
    #[serde(serialize_with = "rfc3339")]
    created_at: Option<Timestamp>,
    #[serde(serialize_with = "rfc3339")]
    published_at: Option<Timestamp>,
}

/// A timestamp as its RFC 3339 text, or `null`.
fn rfc3339<S: serde::Serializer>(t: &Option<Timestamp>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.collect_str(t),
        None => s.serialize_none(),
    }
}

impl<'a> AuditLine<'a> {
    /// The line of `r`.
    pub(crate) fn new(r: &'a ClaimRecord) -> Self {
        Self {
            format: FORMAT,
            idempotency_key: &r.key,
            award_id: r.award_id.as_deref(),
            claimed_at: r.claimed_at,
            events: r
                .events
                .iter()
                .map(|e| EventLine {
                    event_id: e.event_id.as_deref(),
                    event_type: &e.event_type,
                    created_at: e.created_at,
                    published_at: e.published_at,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_engine::record::OutboxRecord;

    fn line(r: &ClaimRecord) -> String {
        serde_json::to_string(&AuditLine::new(r)).unwrap()
    }

    #[test]
    fn an_audit_line_has_its_fields_in_order_with_nulls_and_escapes() {
        let t = |s| Timestamp::parse_rfc3339(s);
        let mut r = ClaimRecord::new(
            "ab".repeat(32),
            Some("A-\"1\"\\\n".to_owned()),
            t("2026-07-01T09:00:00.5Z"),
        );
        r.events.push(OutboxRecord::new(
            1,
            Some("cd".repeat(32)),
            "disbursement.recorded".to_owned(),
            Some("A".to_owned()),
            t("2026-07-01T09:00:00Z"),
            None,
        ));
        r.events
            .push(OutboxRecord::new(2, None, "x".to_owned(), None, None, None));
        let key = "ab".repeat(32);
        let event = "cd".repeat(32);
        assert_eq!(
            line(&r),
            format!(
                r#"{{"format":"idem-audit/1","idempotency_key":"{key}","award_id":"A-\"1\"\\\n","claimed_at":"2026-07-01T09:00:00.500000Z","events":[{{"event_id":"{event}","event_type":"disbursement.recorded","created_at":"2026-07-01T09:00:00.000000Z","published_at":null}},{{"event_id":null,"event_type":"x","created_at":null,"published_at":null}}]}}"#
            )
        );
        let bare = ClaimRecord::new(key.clone(), None, None);
        assert_eq!(
            line(&bare),
            format!(
                r#"{{"format":"idem-audit/1","idempotency_key":"{key}","award_id":null,"claimed_at":null,"events":[]}}"#
            )
        );
    }
}
