//! Opening a store from `--store URL [--schema NAME] [--front-filter URL]`, once, for
//! every command: a visitor receives the concrete store type.

use std::future::Future;
use std::sync::Arc;

use idem_core::ident::Ident;
use idem_core::{ClaimStore, FilterStats, Filtered, Handler, OutcomeCountStore, StoreError};
use idem_grant::{GrantBook, GrantDb, GrantHandler};
use idem_store_postgres::{PgConfig, PgIdentitySession, PgStore};
use idem_store_redis::{IdentitySession, RedisConfig, RedisFilter, StoreIdentitySource};
use idem_store_sqlite::{SqliteConfig, SqliteIdentitySession, SqliteStore};

use crate::CliError;

/// A parsed `--store` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoreUrl {
    /// `sqlite://PATH`.
    Sqlite(String),
    /// `postgres://…` or `postgresql://…`.
    Postgres(String),
    /// `memory://`: the test kit's in-memory store (nothing durable; for trying things).
    Memory,
}

impl StoreUrl {
    pub(crate) fn parse(url: &str) -> Result<Self, CliError> {
        if let Some(path) = url.strip_prefix("sqlite://") {
            if path.is_empty() {
                return Err(CliError::usage("--store sqlite://PATH needs a file path"));
            }
            Ok(Self::Sqlite(path.to_owned()))
        } else if url == "memory://" {
            Ok(Self::Memory)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Self::Postgres(url.to_owned()))
        } else {
            Err(CliError::usage(format!(
                "unsupported --store URL {:?}: use sqlite://PATH, postgres://… or memory://",
                idem_core::redact_url(url)
            )))
        }
    }
}

/// Extras a visitor may use.
#[derive(Clone, Default)]
pub(crate) struct Extras {
    /// The front filter's counters, when one is in front of the store.
    pub(crate) filter_stats: Option<Arc<FilterStats>>,
    /// Where an outcome tally is flushed: the durable store (none for `memory://`).
    pub(crate) outcome_counts: Option<Arc<dyn OutcomeCountStore>>,
}

impl std::fmt::Debug for Extras {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extras")
            .field("filter_stats", &self.filter_stats)
            .field("outcome_counts", &self.outcome_counts.is_some())
            .finish()
    }
}

/// Receives the opened store with its concrete type.
pub(crate) trait StoreVisitor {
    type Output;

    fn visit<S>(
        self,
        store: S,
        db: Arc<dyn GrantDb>,
        extras: Extras,
    ) -> impl Future<Output = Result<Self::Output, CliError>> + Send
    where
        S: ClaimStore + Clone + 'static,
        GrantHandler: Handler<S::Tx>;
}

/// Where and how to open a store.
#[derive(Debug, Clone)]
pub(crate) struct StoreSpec {
    pub(crate) url: StoreUrl,
    pub(crate) schema: Option<String>,
    pub(crate) front_filter: Option<String>,
    pub(crate) max_connections: Option<u32>,
    /// The layout a Postgres store is migrated to when its tables do not exist yet
    /// (`idem migrate --layout`); an existing table keeps its own.
    pub(crate) pg_layout: Option<idem_store_postgres::PgLayout>,
    /// Months of partitions created before / after the current one (partitioned layout).
    pub(crate) pg_partition_window: Option<(u32, u32)>,
}

impl StoreSpec {
    pub(crate) fn new(
        url: &str,
        schema: Option<String>,
        front_filter: Option<String>,
    ) -> Result<Self, CliError> {
        let url = StoreUrl::parse(url)?;
        if let (StoreUrl::Sqlite(_) | StoreUrl::Memory, Some(_)) = (&url, &schema) {
            return Err(CliError::usage(
                "--schema applies to postgres:// stores only",
            ));
        }
        if let Some(s) = &schema {
            Ident::new(s)?;
        }
        if let Some(f) = &front_filter {
            if !f.starts_with("redis://") && !f.starts_with("rediss://") {
                return Err(CliError::usage("--front-filter takes a redis:// URL"));
            }
        }
        Ok(Self {
            url,
            schema,
            front_filter,
            max_connections: None,
            pg_layout: None,
            pg_partition_window: None,
        })
    }
}

/// Opens the store, migrates it if `migrate`, and hands it to `visitor`.
pub(crate) async fn open<V: StoreVisitor>(
    spec: &StoreSpec,
    migrate: bool,
    visitor: V,
) -> Result<V::Output, CliError> {
    match &spec.url {
        StoreUrl::Sqlite(path) => {
            let mut config = SqliteConfig::default();
            if let Some(n) = spec.max_connections {
                config.max_connections = n;
            }
            let store = SqliteStore::connect(path, config).await?;
            if migrate {
                store.migrate_grants().await?;
            }
            let identity = Arc::new(SqliteIdentity(store.clone()));
            let counts: Arc<dyn OutcomeCountStore> = Arc::new(store.clone());
            with_filter(spec, store, Some(identity), Some(counts), visitor).await
        }
        StoreUrl::Memory => {
            with_filter(spec, idem_testkit::MemoryStore::new(), None, None, visitor).await
        }
        StoreUrl::Postgres(url) => {
            let schema = spec.schema.clone().unwrap_or_else(|| "public".to_owned());
            let mut config = PgConfig::new(schema).map_err(|e| CliError::usage(e.to_string()))?;
            if let Some(n) = spec.max_connections {
                config = config.with_max_connections(n);
            }
            if let Some(layout) = spec.pg_layout {
                config = config.with_layout(layout);
            }
            if let Some((back, ahead)) = spec.pg_partition_window {
                config = config.with_partition_window(back, ahead);
            }
            let store = PgStore::connect(url, config).await?;
            if migrate {
                store.migrate_grants().await?;
            }
            let identity = Arc::new(PgIdentity(store.clone()));
            let counts: Arc<dyn OutcomeCountStore> = Arc::new(store.clone());
            with_filter(spec, store, Some(identity), Some(counts), visitor).await
        }
    }
}

/// Puts the front filter (when asked for) in front of `store`: its marks are scoped to
/// the store's identity when the store has one (every durable store), else to this
/// process alone.
async fn with_filter<S, V>(
    spec: &StoreSpec,
    store: S,
    identity: Option<Arc<dyn StoreIdentitySource>>,
    outcome_counts: Option<Arc<dyn OutcomeCountStore>>,
    visitor: V,
) -> Result<V::Output, CliError>
where
    S: ClaimStore + GrantDb + Clone + 'static,
    S::Tx: GrantBook,
    V: StoreVisitor,
{
    let db: Arc<dyn GrantDb> = Arc::new(store.clone());
    match &spec.front_filter {
        None => {
            let extras = Extras {
                filter_stats: None,
                outcome_counts,
            };
            visitor.visit(store, db, extras).await
        }
        Some(url) => {
            let config = RedisConfig::new(url.clone());
            let filter = match identity {
                Some(identity) => RedisFilter::connect_for_store(config, identity).await,
                None => RedisFilter::connect(config).await,
            };
            let filter = filter.map_err(|e| {
                let message = format!(
                    "front filter {}: {}",
                    idem_core::redact_url(url),
                    crate::error::error_chain(&e)
                );
                match e {
                    StoreError::Config(_) => CliError::usage(message),
                    _ => CliError::failed(message),
                }
            })?;
            let filtered = Filtered::new(store, filter);
            let extras = Extras {
                filter_stats: Some(filtered.stats_handle()),
                outcome_counts,
            };
            visitor.visit(filtered, db, extras).await
        }
    }
}

/// The identity of a Postgres store, for the front filter.
struct PgIdentity(PgStore);
struct PgSession(PgIdentitySession);

#[idem_core::async_trait]
impl StoreIdentitySource for PgIdentity {
    async fn begin_session(&self) -> Result<Box<dyn IdentitySession>, StoreError> {
        Ok(Box::new(PgSession(self.0.begin_identity_session().await?)))
    }
}

#[idem_core::async_trait]
impl IdentitySession for PgSession {
    fn store_id(&self) -> &str {
        &self.0.identity().store_id
    }
    fn session(&self) -> i64 {
        self.0.identity().session
    }
    async fn rotate(&mut self) -> Result<(), StoreError> {
        self.0.rotate().await.map(|_| ())
    }
    async fn commit(self: Box<Self>) -> Result<(), StoreError> {
        self.0.commit().await
    }
}

/// The identity of an SQLite store, for the front filter.
struct SqliteIdentity(SqliteStore);
struct SqliteSession(SqliteIdentitySession);

#[idem_core::async_trait]
impl StoreIdentitySource for SqliteIdentity {
    async fn begin_session(&self) -> Result<Box<dyn IdentitySession>, StoreError> {
        Ok(Box::new(SqliteSession(
            self.0.begin_identity_session().await?,
        )))
    }
}

#[idem_core::async_trait]
impl IdentitySession for SqliteSession {
    fn store_id(&self) -> &str {
        &self.0.identity().store_id
    }
    fn session(&self) -> i64 {
        self.0.identity().session
    }
    async fn rotate(&mut self) -> Result<(), StoreError> {
        self.0.rotate().await.map(|_| ())
    }
    async fn commit(self: Box<Self>) -> Result<(), StoreError> {
        self.0.commit().await
    }
}
