//! Opening a store from `--store URL [--schema NAME] [--front-filter URL]`, once, for
//! every command: a visitor receives the concrete store type.

use std::future::Future;
use std::sync::Arc;

use idem_engine::ident::Ident;
use idem_engine::{ClaimStore, FilterStats, Handler, OutcomeCountStore};
#[cfg(any(feature = "redis", feature = "redis-rs"))]
use idem_engine::{Filtered, StoreError};
use idem_grant::{GrantBook, GrantDb, GrantHandler};
#[cfg(all(feature = "postgres", any(feature = "redis", feature = "redis-rs")))]
use idem_store_postgres::PgIdentitySession;
#[cfg(feature = "postgres")]
use idem_store_postgres::{PgConfig, PgStore};
#[cfg(any(feature = "redis", feature = "redis-rs"))]
use idem_store_redis::{IdentitySession, RedisConfig, RedisFilter, StoreIdentitySource};
#[cfg(any(feature = "redis", feature = "redis-rs"))]
use idem_store_sqlite::SqliteIdentitySession;
use idem_store_sqlite::{SqliteConfig, SqliteStore};

use crate::sql_handler::SqlTx;
use crate::CliError;

/// A parsed `--store` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoreUrl {
    /// `sqlite://PATH`.
    Sqlite(String),
    /// `postgres://…` or `postgresql://…`.
    #[cfg(feature = "postgres")]
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
            #[cfg(feature = "postgres")]
            return Ok(Self::Postgres(url.to_owned()));
            #[cfg(not(feature = "postgres"))]
            return Err(not_compiled("postgres://", "postgres"));
        } else {
            Err(CliError::usage(format!(
                "unsupported --store URL {:?}: use sqlite://PATH, postgres://… or memory://",
                idem_engine::redact_url(url)
            )))
        }
    }

    /// Whether this is a Postgres store (never, in a build without the `postgres`
    /// feature).
    pub(crate) fn is_postgres(&self) -> bool {
        #[cfg(feature = "postgres")]
        return matches!(self, Self::Postgres(_));
        #[cfg(not(feature = "postgres"))]
        return false;
    }
}

/// The error for a URL (`what`, e.g. `kafka://`) whose broker or store this build does
/// not have: it names the cargo `feature` that brings it.
pub(crate) fn not_compiled(what: &str, feature: &str) -> CliError {
    CliError::usage(format!(
        "{what} needs the `{feature}` feature (not in this build): \
         cargo install idem-cli --features {feature}"
    ))
}

/// Extras a visitor may use.
#[derive(Clone, Default)]
pub(crate) struct Extras {
    /// The front filter's counters, when one is in front of the store.
    pub(crate) filter_stats: Option<Arc<FilterStats>>,
    /// Where an outcome tally is flushed: the durable store (none for `memory://`).
    pub(crate) outcome_counts: Option<Arc<dyn OutcomeCountStore>>,
    /// Where a log broker's positions are kept when its URL asks (`?positions=store`):
    /// the durable store (Postgres, SQLite), `None` for `memory://`.
    pub(crate) positions: Option<Arc<dyn idem_engine::PositionStore>>,
}

impl std::fmt::Debug for Extras {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extras")
            .field("filter_stats", &self.filter_stats)
            .field("outcome_counts", &self.outcome_counts.is_some())
            .field("positions", &self.positions.is_some())
            .finish()
    }
}

/// Receives the opened store with its concrete type: its transactions take the grant
/// handler and the SQL handler alike.
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
        GrantHandler: Handler<S::Tx>,
        S::Tx: SqlTx;
}

/// Where and how to open a store.
#[derive(Debug, Clone)]
pub(crate) struct StoreSpec {
    pub(crate) url: StoreUrl,
    /// The Postgres schema (always `None` without the `postgres` feature).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) schema: Option<String>,
    pub(crate) front_filter: Option<String>,
    pub(crate) max_connections: Option<u32>,
    /// How long one statement of a claim transaction may run on the server (Postgres:
    /// `idem consume` sets its `--handler-timeout`, so that the server cancels a statement
    /// the handler's deadline gave up on).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) statement_timeout: Option<std::time::Duration>,
    /// Whether migrating also creates the grant pipeline's tables (`disbursements`):
    /// for the grant handler only; idem's own tables are always migrated.
    pub(crate) grant_tables: bool,
    /// The layout a Postgres store is migrated to when its tables do not exist yet
    /// (`idem migrate --layout`); an existing table keeps its own.
    #[cfg(feature = "postgres")]
    pub(crate) pg_layout: Option<idem_store_postgres::PgLayout>,
    /// `idem migrate --outbox cdc`: the schema's outbox is read by change data capture
    /// from now on (an existing schema keeps what it records otherwise).
    #[cfg(feature = "postgres")]
    pub(crate) pg_outbox: Option<idem_store_postgres::OutboxMode>,
    /// Months of partitions created before / after the current one (partitioned layout).
    #[cfg(feature = "postgres")]
    pub(crate) pg_partition_window: Option<(u32, u32)>,
}

impl StoreSpec {
    pub(crate) fn new(
        url: &str,
        schema: Option<String>,
        front_filter: Option<String>,
    ) -> Result<Self, CliError> {
        let url = StoreUrl::parse(url)?;
        if !url.is_postgres() && schema.is_some() {
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
            if cfg!(not(any(feature = "redis", feature = "redis-rs"))) {
                return Err(not_compiled("--front-filter redis://", "redis"));
            }
        }
        Ok(Self {
            url,
            schema,
            front_filter,
            max_connections: None,
            statement_timeout: None,
            grant_tables: false,
            #[cfg(feature = "postgres")]
            pg_layout: None,
            #[cfg(feature = "postgres")]
            pg_outbox: None,
            #[cfg(feature = "postgres")]
            pg_partition_window: None,
        })
    }
}

/// What identifies a durable store to the front filter, whose marks are scoped to it.
#[cfg_attr(not(any(feature = "redis", feature = "redis-rs")), allow(dead_code))]
enum Identity {
    /// None: `memory://`, whose marks are scoped to this process alone.
    Process,
    Sqlite(SqliteStore),
    #[cfg(feature = "postgres")]
    Pg(PgStore),
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
            if migrate && spec.grant_tables {
                store.migrate_grants().await?;
            } else if migrate {
                store.migrate().await?;
            }
            let identity = Identity::Sqlite(store.clone());
            let (counts, positions) = durable(&store);
            with_filter(spec, store, identity, counts, positions, visitor).await
        }
        StoreUrl::Memory => {
            let store = idem_sim::MemoryStore::new();
            with_filter(spec, store, Identity::Process, None, None, visitor).await
        }
        #[cfg(feature = "postgres")]
        StoreUrl::Postgres(url) => {
            let schema = spec.schema.clone().unwrap_or_else(|| "public".to_owned());
            let mut config = PgConfig::new(schema).map_err(|e| CliError::usage(e.to_string()))?;
            if let Some(n) = spec.max_connections {
                config = config.with_max_connections(n);
            }
            if spec.statement_timeout.is_some() {
                config = config.with_statement_timeout(spec.statement_timeout);
            }
            if let Some(layout) = spec.pg_layout {
                config = config.with_layout(layout);
            }
            if let Some(outbox) = spec.pg_outbox {
                config = config.with_outbox(outbox);
            }
            if let Some((back, ahead)) = spec.pg_partition_window {
                config = config.with_partition_window(back, ahead);
            }
            let store = PgStore::connect(url, config).await?;
            if migrate && spec.grant_tables {
                store.migrate_grants().await?;
            } else if migrate {
                store.migrate().await?;
            }
            let identity = Identity::Pg(store.clone());
            let (counts, positions) = durable(&store);
            with_filter(spec, store, identity, counts, positions, visitor).await
        }
    }
}

/// What a durable store keeps beside its claims: the outcome tally and log positions.
#[allow(clippy::type_complexity)]
fn durable<S>(
    store: &S,
) -> (
    Option<Arc<dyn OutcomeCountStore>>,
    Option<Arc<dyn idem_engine::PositionStore>>,
)
where
    S: OutcomeCountStore + idem_engine::PositionStore + Clone + 'static,
{
    (Some(Arc::new(store.clone())), Some(Arc::new(store.clone())))
}

/// Puts the front filter (when asked for) in front of `store`: its marks are scoped to
/// the store's identity when the store has one (every durable store), else to this
/// process alone.
async fn with_filter<S, V>(
    spec: &StoreSpec,
    store: S,
    identity: Identity,
    outcome_counts: Option<Arc<dyn OutcomeCountStore>>,
    positions: Option<Arc<dyn idem_engine::PositionStore>>,
    visitor: V,
) -> Result<V::Output, CliError>
where
    S: ClaimStore + GrantDb + Clone + 'static,
    S::Tx: GrantBook + SqlTx,
    V: StoreVisitor,
{
    let db: Arc<dyn GrantDb> = Arc::new(store.clone());
    #[cfg(any(feature = "redis", feature = "redis-rs"))]
    if let Some(url) = &spec.front_filter {
        let config = RedisConfig::new(url.clone());
        let identity: Option<Arc<dyn StoreIdentitySource>> = match identity {
            Identity::Process => None,
            Identity::Sqlite(s) => Some(Arc::new(SqliteIdentity(s))),
            #[cfg(feature = "postgres")]
            Identity::Pg(s) => Some(Arc::new(PgIdentity(s))),
        };
        let filter = match identity {
            Some(identity) => RedisFilter::connect_for_store(config, identity).await,
            None => RedisFilter::connect(config).await,
        };
        let filter = filter.map_err(|e| {
            let message = format!(
                "front filter {}: {}",
                idem_engine::redact_url(url),
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
            positions,
        };
        return visitor.visit(filtered, db, extras).await;
    }
    // Without a Redis client, StoreSpec::new refuses a front filter.
    #[cfg(not(any(feature = "redis", feature = "redis-rs")))]
    let _ = (identity, &spec.front_filter);
    let extras = Extras {
        filter_stats: None,
        outcome_counts,
        positions,
    };
    visitor.visit(store, db, extras).await
}

/// The identity of a store for the front filter: `$source` wraps the store and begins
/// `$session`s, which wrap the store's own identity session. Both stores' sessions have
/// the same methods (and `idem-core`'s `StoreIdentity`): one piece serves both.
#[cfg(any(feature = "redis", feature = "redis-rs"))]
macro_rules! identity_source {
    ($source:ident($store:ty), $session:ident($inner:ty)) => {
        struct $source($store);
        struct $session($inner);

        #[idem_engine::async_trait]
        impl StoreIdentitySource for $source {
            async fn begin_session(&self) -> Result<Box<dyn IdentitySession>, StoreError> {
                Ok(Box::new($session(self.0.begin_identity_session().await?)))
            }
        }

        #[idem_engine::async_trait]
        impl IdentitySession for $session {
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
    };
}

// The identity of a Postgres store, for the front filter.
#[cfg(all(feature = "postgres", any(feature = "redis", feature = "redis-rs")))]
identity_source!(PgIdentity(PgStore), PgSession(PgIdentitySession));

// The identity of an SQLite store, for the front filter.
#[cfg(any(feature = "redis", feature = "redis-rs"))]
identity_source!(
    SqliteIdentity(SqliteStore),
    SqliteSession(SqliteIdentitySession)
);
