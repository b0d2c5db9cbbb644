//! `idem inspect`: was this award or key processed, when, under which key, and which
//! outbox events did it cause. Never shows payloads.

use idem_core::IdempotencyKey;
use idem_store_postgres::{ClaimRecord, PgConfig, PgStore};
use idem_store_sqlite::{SqliteConfig, SqliteStore};

use crate::stores::{self, StoreUrl};
use crate::CliError;

/// Arguments of `idem inspect`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["key", "award_id"])))]
pub(crate) struct Args {
    /// The store: sqlite://PATH or postgres://…
    #[arg(long)]
    store: String,
    /// The Postgres schema.
    #[arg(long)]
    schema: Option<String>,
    /// An idempotency key (64 hex).
    #[arg(long, value_name = "HEX")]
    key: Option<String>,
    /// An award id: every claim made for it.
    #[arg(long)]
    award_id: Option<String>,
}

/// One claim as printed, whatever the store.
struct Shown {
    key: String,
    award_id: Option<String>,
    claimed_at: Option<String>,
    events: Vec<(String, String, Option<String>, Option<String>)>,
}

fn from_pg(r: ClaimRecord) -> Shown {
    Shown {
        key: r.key,
        award_id: r.award_id,
        claimed_at: r.claimed_at.map(|t| t.to_string()),
        events: r
            .events
            .into_iter()
            .map(|e| {
                (
                    e.event_id.unwrap_or_else(|| "-".into()),
                    e.event_type,
                    e.created_at.map(|t| t.to_string()),
                    e.published_at.map(|t| t.to_string()),
                )
            })
            .collect(),
    }
}

async fn sqlite_shown(
    store: &SqliteStore,
    key: &IdempotencyKey,
) -> Result<Option<Shown>, CliError> {
    let Some(c) = store.claim_of(key).await? else {
        return Ok(None);
    };
    let events = store
        .outbox_of(key)
        .await?
        .into_iter()
        .map(|e| (e.event_id, e.event_type, Some(e.created_at), e.published_at))
        .collect();
    Ok(Some(Shown {
        key: c.idempotency_key,
        award_id: c.award_id,
        claimed_at: Some(c.claimed_at),
        events,
    }))
}

pub(crate) async fn run(args: Args) -> Result<(), CliError> {
    let key = match &args.key {
        Some(k) => Some(
            k.parse::<IdempotencyKey>()
                .map_err(|e| CliError::usage(format!("--key: {e}")))?,
        ),
        None => None,
    };
    let shown: Vec<Shown> = match StoreUrl::parse(&args.store)? {
        StoreUrl::Postgres(url) => {
            let schema = args.schema.clone().unwrap_or_else(|| "public".to_owned());
            stores::validate_identifier(&schema)?;
            let store = PgStore::connect(
                &url,
                PgConfig::new(schema).map_err(|e| CliError::usage(e.to_string()))?,
            )
            .await?;
            let pg =
                |e: idem_store_postgres::PgError| CliError::failed(crate::error::error_chain(&e));
            match (&key, &args.award_id) {
                (Some(k), _) => store
                    .inspect_key(k)
                    .await
                    .map_err(pg)?
                    .into_iter()
                    .map(from_pg)
                    .collect(),
                (None, Some(a)) => store
                    .inspect_subject(a)
                    .await
                    .map_err(pg)?
                    .into_iter()
                    .map(from_pg)
                    .collect(),
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
            let store = SqliteStore::open(&path, config).await?;
            let keys: Vec<IdempotencyKey> = match (&key, &args.award_id) {
                (Some(k), _) => vec![*k],
                (None, Some(a)) => store
                    .claims_of_subject(a)
                    .await?
                    .into_iter()
                    .filter_map(|c| c.idempotency_key.parse().ok())
                    .collect(),
                (None, None) => Vec::new(),
            };
            let mut out = Vec::new();
            for k in &keys {
                if let Some(s) = sqlite_shown(&store, k).await? {
                    out.push(s);
                }
            }
            out
        }
        StoreUrl::Memory => return Err(CliError::usage("idem inspect needs a durable store")),
    };
    println!("processed: {}", if shown.is_empty() { "no" } else { "yes" });
    println!("claims: {}", shown.len());
    for s in &shown {
        println!();
        println!("key: {}", s.key);
        println!("award_id: {}", s.award_id.as_deref().unwrap_or("-"));
        println!("claimed_at: {}", s.claimed_at.as_deref().unwrap_or("-"));
        println!("events: {}", s.events.len());
        for (id, ty, created, published) in &s.events {
            println!(
                "event: {id} {ty} created={} published={}",
                created.as_deref().unwrap_or("-"),
                published.as_deref().unwrap_or("not yet")
            );
        }
    }
    Ok(())
}
