//! `idem inspect`: was this subject (award) or key processed, when, under which key, and which
//! outbox events did it cause; with `--broker URL --source NAME`, the redelivery horizon
//! a purge would respect. Never shows payloads.

use std::time::Duration;

#[cfg(feature = "postgres")]
use idem_engine::ident::Ident;
use idem_engine::record::ClaimRecord;
use idem_engine::IdempotencyKey;
#[cfg(feature = "postgres")]
use idem_store_postgres::{PgConfig, PgStore};
use idem_store_sqlite::{SqliteConfig, SqliteStore};

use crate::cmd::parse_duration;
use crate::stores::StoreUrl;
use crate::CliError;

/// Arguments of `idem inspect`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("what").required(true).multiple(true).args(["key", "subject", "source"])))]
pub(crate) struct Args {
    /// The store: sqlite://PATH or postgres://… (not needed for the horizon alone; or
    /// IDEM_STORE, else DATABASE_URL)
    #[arg(
        long,
        required_unless_present = "source",
        env = "IDEM_STORE",
        hide_env_values = true
    )]
    store: Option<String>,
    /// The Postgres schema.
    #[arg(long)]
    schema: Option<String>,
    /// An idempotency key (64 hex).
    #[arg(long, value_name = "HEX")]
    key: Option<String>,
    /// A subject (an award id for grants, the first --identity part otherwise): every
    /// claim made for it. `--award-id` is the same flag.
    #[arg(
        long,
        visible_alias = "award-id",
        value_name = "ID",
        allow_hyphen_values = true
    )]
    subject: Option<String>,
    /// A broker holding a source that feeds the store (with --source): shows the source's
    /// redelivery horizon, which `idem purge --broker … --source …` respects (default
    /// with --source: IDEM_BROKER).
    #[arg(long, value_name = "URL")]
    broker: Vec<String>,
    /// A source (queue, stream, topic) on --broker; repeat for several.
    #[arg(long, value_name = "NAME")]
    source: Vec<String>,
    /// Added to the longest redelivery horizon (as `idem purge` does).
    #[arg(long, value_parser = parse_duration, default_value = "1d")]
    horizon_margin: Duration,
}

/// The store that may keep a Kafka source's positions (`?positions=store`): `--store`,
/// when one is given.
async fn position_store(
    args: &Args,
) -> Result<Option<std::sync::Arc<dyn idem_engine::PositionStore>>, CliError> {
    match args.store.as_deref().map(StoreUrl::parse).transpose()? {
        #[cfg(feature = "postgres")]
        Some(StoreUrl::Postgres(url)) => {
            let schema = args.schema.clone().unwrap_or_else(|| "public".to_owned());
            let config = PgConfig::new(schema).map_err(|e| CliError::usage(e.to_string()))?;
            Ok(Some(std::sync::Arc::new(
                PgStore::connect(&url, config).await?,
            )))
        }
        Some(StoreUrl::Sqlite(path)) => {
            let mut config = SqliteConfig::default();
            config.create_if_missing = false;
            Ok(Some(std::sync::Arc::new(
                SqliteStore::connect(&path, config).await?,
            )))
        }
        _ => Ok(None),
    }
}

async fn records(
    args: &Args,
    store: &str,
    key: Option<&IdempotencyKey>,
) -> Result<Vec<ClaimRecord>, CliError> {
    Ok(match StoreUrl::parse(store)? {
        #[cfg(feature = "postgres")]
        StoreUrl::Postgres(url) => {
            let schema = args.schema.clone().unwrap_or_else(|| "public".to_owned());
            Ident::new(&schema)?;
            let store = PgStore::connect(
                &url,
                PgConfig::new(schema).map_err(|e| CliError::usage(e.to_string()))?,
            )
            .await?;
            match (key, &args.subject) {
                (Some(k), _) => store.inspect_key(k).await?.into_iter().collect(),
                (None, Some(a)) => store.inspect_subject(a).await?,
                (None, None) => Vec::new(),
            }
        }
        StoreUrl::Sqlite(path) => {
            if args.schema.is_some() {
                return Err(CliError::usage(
                    "--schema applies to postgres:// stores only",
                ));
            }
            let mut config = SqliteConfig::default();
            config.create_if_missing = false;
            let store = SqliteStore::connect(&path, config).await?;
            match (key, &args.subject) {
                (Some(k), _) => store.inspect_key(k).await?.into_iter().collect(),
                (None, Some(a)) => store.inspect_subject(a).await?,
                (None, None) => Vec::new(),
            }
        }
        StoreUrl::Memory => return Err(CliError::usage("idem inspect needs a durable store")),
    })
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let key = match &args.key {
        Some(k) => Some(
            k.parse::<IdempotencyKey>()
                .map_err(|e| CliError::usage(format!("--key: {e}")))?,
        ),
        None => None,
    };
    let sources = crate::horizon::pairs(&args.broker, &args.source)?;
    let mut out = crate::out::Out::new();
    if key.is_some() || args.subject.is_some() {
        let Some(store) = &args.store else {
            return Err(CliError::usage("--key and --subject need --store"));
        };
        let shown = records(&args, store, key.as_ref()).await?;
        claims(&mut out, &shown);
    }
    if !sources.is_empty() {
        let positions = position_store(&args).await?;
        let horizons = crate::horizon::read(&sources, positions.as_deref()).await?;
        if !out.is_json() && (key.is_some() || args.subject.is_some()) {
            println!();
        }
        let mut longest = Some(Duration::ZERO);
        let mut shown = Vec::with_capacity(horizons.len());
        for h in &horizons {
            if !out.is_json() {
                println!("redelivery_horizon: {h}");
            }
            shown.push(serde_json::Value::from(h.to_string()));
            longest = match (longest, h.horizon()) {
                (Some(l), Some(d)) => Some(l.max(d)),
                _ => None,
            };
        }
        out.json_only("redelivery_horizons", serde_json::Value::Array(shown));
        match longest {
            Some(d) => out.field(
                "purge_older_than_at_least",
                format!(
                    "{} (the longest horizon {} plus a margin of {})",
                    idem_broker::horizon::human(d.saturating_add(args.horizon_margin)),
                    idem_broker::horizon::human(d),
                    idem_broker::horizon::human(args.horizon_margin)
                ),
            ),
            None => out.field(
                "purge_older_than_at_least",
                "never (a source's horizon is unbounded)",
            ),
        }
    }
    out.finish();
    Ok(())
}

/// The claims found, as lines (a blank line before each) or as the object's `claims`.
fn claims(out: &mut crate::out::Out, shown: &[ClaimRecord]) {
    if out.is_json() {
        out.field("processed", !shown.is_empty());
        let claims: Vec<serde_json::Value> = shown
            .iter()
            .map(|s| {
                let events: Vec<serde_json::Value> = s
                    .events
                    .iter()
                    .map(|e| {
                        serde_json::json!({
                            "event_id": e.event_id,
                            "event_type": e.event_type,
                            "created_at": e.created_at.map(|t| t.to_string()),
                            "published_at": e.published_at.map(|t| t.to_string()),
                        })
                    })
                    .collect();
                serde_json::json!({
                    "key": s.key.to_string(),
                    "subject": s.award_id,
                    // The same value under the grant pipeline's own name (the reference
                    // design's column).
                    "award_id": s.award_id,
                    "claimed_at": s.claimed_at.map(|t| t.to_string()),
                    "events": events,
                })
            })
            .collect();
        out.json_only("claims", serde_json::Value::Array(claims));
        return;
    }
    println!("processed: {}", if shown.is_empty() { "no" } else { "yes" });
    println!("claims: {}", shown.len());
    for s in shown {
        println!();
        println!("key: {}", s.key);
        println!("subject: {}", s.award_id.as_deref().unwrap_or("-"));
        println!(
            "claimed_at: {}",
            s.claimed_at
                .map_or_else(|| "-".to_owned(), |t| t.to_string())
        );
        println!("events: {}", s.events.len());
        for e in &s.events {
            println!(
                "event: {} {} created={} published={}",
                e.event_id.as_deref().unwrap_or("-"),
                e.event_type,
                e.created_at
                    .map_or_else(|| "-".to_owned(), |t| t.to_string()),
                e.published_at
                    .map_or_else(|| "not yet".to_owned(), |t| t.to_string())
            );
        }
    }
}
