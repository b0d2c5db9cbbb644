//! `idem purge`: delete dedup records and published outbox rows older than a cutoff, in
//! bounded batches (on the partitioned layout: drop whole monthly partitions), never below
//! the retention floor unless told to. Postgres and SQLite stores alike.

use std::time::Duration;

#[cfg(feature = "postgres")]
use idem_engine::retention::PurgeReport;
use idem_engine::retention::{
    PurgeOptions, PurgeProgress, RetentionFloor, DEFAULT_RETENTION_FLOOR,
};
#[cfg(feature = "postgres")]
use idem_store_postgres::{PgConfig, PgStore};
use idem_store_sqlite::{SqliteConfig, SqliteStore};

/// A purge age in idem's one grammar: `Ny` is N calendar years back from now (leap days
/// included, as a retention floor counts them), anything else an exact duration.
fn parse_age(s: &str) -> Result<Duration, String> {
    let age = parse_floor(s)?;
    let now = idem_engine::record::Timestamp::now();
    let micros = now.unix_micros() - age.cutoff(now).unix_micros();
    Ok(Duration::from_micros(u64::try_from(micros).unwrap_or(0)))
}

use crate::cmd::{parse_duration, parse_floor};
use crate::stores::StoreUrl;
use crate::CliError;

/// Arguments of `idem purge`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    store: super::StoreArgs,
    /// Delete what is older than this (30d, 3y, 1200d, …; a year is a calendar year, as
    /// in --retention-floor).
    #[arg(long, value_parser = parse_age)]
    older_than: Duration,
    /// Only count what would be deleted.
    #[arg(long)]
    dry_run: bool,
    /// The retention floor: a purge of anything younger is refused (default 3y, per
    /// 2 CFR §200.334; `Ny` is N calendar years, `interval 'N years'`).
    #[arg(long, value_parser = parse_floor)]
    retention_floor: Option<RetentionFloor>,
    /// Purge below the retention floor anyway.
    #[arg(long)]
    allow_below_floor: bool,
    /// Rows deleted per transaction.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    batch_size: u64,
    /// A broker holding a source that feeds this store (with --source): the purge is
    /// refused inside that source's redelivery horizon plus --horizon-margin, whatever
    /// --allow-below-floor says. One broker for every --source, or one per source
    /// (default with --source: IDEM_BROKER).
    #[arg(long, value_name = "URL")]
    broker: Vec<String>,
    /// A source (queue, stream, topic) on --broker whose redelivery horizon bounds the
    /// cutoff; repeat for several.
    #[arg(long, value_name = "NAME")]
    source: Vec<String>,
    /// Added to the longest redelivery horizon.
    #[arg(long, value_parser = parse_duration, default_value = "1d")]
    horizon_margin: Duration,
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let store = StoreUrl::parse(&args.store.url)?;
    if matches!(store, StoreUrl::Memory) {
        return Err(CliError::usage("idem purge needs a durable store"));
    }
    if args.store.schema.is_some() && !store.is_postgres() {
        return Err(CliError::usage(
            "--schema applies to postgres:// stores only",
        ));
    }
    let opened = match store {
        #[cfg(feature = "postgres")]
        StoreUrl::Postgres(url) => {
            let schema = args
                .store
                .schema
                .clone()
                .unwrap_or_else(|| "public".to_owned());
            let config = PgConfig::new(schema).map_err(|e| CliError::usage(e.to_string()))?;
            Opened::Pg(PgStore::connect(&url, config).await?)
        }
        StoreUrl::Sqlite(path) => {
            let mut config = SqliteConfig::default();
            config.create_if_missing = false;
            Opened::Sqlite(SqliteStore::connect(&path, config).await?)
        }
        StoreUrl::Memory => unreachable!("refused above"),
    };
    let positions: &dyn idem_engine::PositionStore = match &opened {
        #[cfg(feature = "postgres")]
        Opened::Pg(s) => s,
        Opened::Sqlite(s) => s,
    };
    // The brokers' redelivery horizons first: no cutoff inside them, whatever the floor.
    let sources = crate::horizon::pairs(&args.broker, &args.source)?;
    let horizons = crate::horizon::read(&sources, Some(positions)).await?;
    for h in &horizons {
        eprintln!("purge: redelivery horizon of {h}");
    }
    crate::horizon::check(args.older_than, &horizons, args.horizon_margin)?;
    let options = PurgeOptions::new(args.older_than)
        .with_floor(args.retention_floor.unwrap_or(DEFAULT_RETENTION_FLOOR))
        .allow_below_floor(args.allow_below_floor)
        .with_batch_size(usize::try_from(args.batch_size).unwrap_or(1000))
        .dry_run(args.dry_run);
    let progress = |p: &PurgeProgress| {
        eprintln!(
            "purge: {} {} rows so far (+{})",
            p.table.table_name(),
            p.rows_so_far,
            p.batch_rows
        );
    };
    let mut out = crate::out::Out::new();
    let report = match opened {
        #[cfg(feature = "postgres")]
        Opened::Pg(store) => {
            let report = store.purge(&options, progress).await?;
            out.field("cutoff", report.cutoff.to_string());
            out.field("dry_run", report.dry_run);
            out.field("layout", store.layout().to_string());
            if store.layout() == idem_store_postgres::PgLayout::Partitioned {
                partitions(&mut out, &report);
            }
            report
        }
        Opened::Sqlite(store) => {
            let report = store.purge(&options, progress).await?;
            out.field("cutoff", report.cutoff.to_string());
            out.field("dry_run", report.dry_run);
            report
        }
    };
    out.field("dedup_records", report.dedup_records);
    out.field("outbox_events", report.outbox_events);
    out.field("batches", report.batches);
    out.finish();
    Ok(())
}

/// The store a purge runs on, opened before the horizons are read (they may need its
/// stored positions).
enum Opened {
    #[cfg(feature = "postgres")]
    Pg(PgStore),
    Sqlite(SqliteStore),
}

/// The partitions a purge of the partitioned layout dropped or kept.
#[cfg(feature = "postgres")]
fn partitions(out: &mut crate::out::Out, report: &PurgeReport) {
    let verb = if report.dry_run {
        "would be dropped"
    } else {
        "dropped"
    };
    for name in &report.partitions_dropped {
        eprintln!("purge: partition {name} {verb}");
    }
    for name in &report.partitions_kept {
        eprintln!("purge: partition {name} kept: it holds claims made after the cutoff");
    }
    out.field("partitions_dropped", report.partitions_dropped.len());
    out.field("partitions_kept", report.partitions_kept.len());
    out.field("partition_rows_estimate", report.partition_rows_estimate);
    out.json_only(
        "partition_names_dropped",
        serde_json::json!(report.partitions_dropped),
    );
    out.json_only(
        "partition_names_kept",
        serde_json::json!(report.partitions_kept),
    );
}
