//! [`PgStore`] and its transaction [`PgTx`]: the claim, the business writes and the
//! outbox rows in one Postgres transaction.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::ident::Ident;
use idem_core::sql::SqlText;
use idem_core::{sql, Capabilities, ClaimStore, IdempotencyKey, RunNote, StoreError};
use sqlx::postgres::PgTransactionManager;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};
use sqlx_core::transaction::TransactionManager;

use crate::config::{quote, PgConfig};
use crate::error::map_sqlx;
use crate::sql::statement;

mod shared;
#[cfg(test)]
mod tls_policy_tests;
mod tx;

use shared::Shared;
use tx::no_answer;
pub use tx::PgTx;

#[cfg(doc)]
use crate::config::PgLayout;
#[cfg(doc)]
use idem_core::{ClaimMeta, ClaimOutcome, ClaimTx};

/// The SQLSTATE the append-only trigger raises.
pub const APPEND_ONLY_SQLSTATE: &str = "IDEM1";

/// The Postgres claim store: a [`PgPool`] and a validated schema. Clones share the pool.
///
/// # Contract
/// - A claim is `INSERT INTO processed_messages … ON CONFLICT (idempotency_key) DO
///   NOTHING` in the caller's transaction (on the partitioned layout, [`PgLayout`], the
///   row also gets the month of [`ClaimMeta::submission_timestamp`] and the target is
///   `(idempotency_key, submission_month)`; on the distributed layout the target is
///   `(award_id, idempotency_key)`, the award id being [`ClaimMeta::subject`]): a
///   concurrent claim of the same key waits on
///   the unique index until the first transaction commits (`Duplicate`) or rolls back
///   (`Claimed`), or answers `InProgress` after [`PgConfig::lock_timeout`].
/// - Conflicts: [`migrate`](PgStore::migrate) adds a nullable `submission_timestamp`
///   column and a unique index on `(award_id, submission_timestamp)`, where a row
///   without a timestamp conflicts with none (`migrations/0006_claim_identity.sql`; on
///   the partitioned layout the index also holds `submission_month`, a function of the
///   timestamp). A claim then records
///   [`ClaimMeta::identity`] and its conflict target is any unique index: a new key of an
///   identity already claimed inserts nothing, and a second statement finds the row that
///   refused it — the key's (`Duplicate`) or the identity's ([`ClaimOutcome::Conflict`]).
///   A concurrent claim of the same identity waits on that index like one of the same
///   key. [`Capabilities::detects_conflicts`] says whether the column is there.
/// - Without that migration it uses only the reference columns `idempotency_key,
///   award_id, claimed_at` of `processed_messages`, so a table created by another program
///   works unchanged (it needs a primary key or unique index on `idempotency_key`), without
///   conflict detection. After the migration the reference program still works: it never
///   fills the new column, and its rows are never in conflict.
/// - [`ClaimTx::claim_batch`] is one round trip.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_core::{ident::Ident, sql, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
/// use idem_store_postgres::{sql::statement, PgConfig, PgStore};
///
/// let store = PgStore::connect("postgres://postgres@127.0.0.1/test", PgConfig::new("grants")?).await?;
/// store.migrate().await?;
/// let key = IdempotencyKey::derive("A-2026-014", "2026-07-01T09:00:00Z", b"{}")?;
/// let mut tx = store.begin().await?;
/// if tx.claim(&key, &ClaimMeta::new("A-2026-014")).await? == ClaimOutcome::Claimed {
///     let table = Ident::new("disbursements")?;
///     let insert = sql!("INSERT INTO {schema}.{table} (award_id, amount_cents, idempotency_key) \
///                        VALUES ($1, $2, $3)", schema = store.schema_ident(), table);
///     sqlx::query(statement(insert)).bind("A-2026-014").bind(125_000_i64).bind(key.to_hex())
///         .execute(tx.conn()).await?;
///     tx.commit().await?;
/// } else {
///     tx.rollback().await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    shared: Arc<Shared>,
}

/// The connection options of `url`, its TLS settings read as libpq reads them where
/// sqlx reads them otherwise, and a password refused over a connection whose server is
/// not verified:
///
/// - `sslmode=require` with an `sslrootcert` verifies the server's certificate chain, as
///   `verify-ca` does (libpq's rule; sqlx verified nothing, so a certificate from any CA
///   was accepted);
/// - a password (in the URL, `?password=`, or `PGPASSWORD`) is sent to a host that is not
///   loopback (`127.0.0.0/8`, `::1`, `localhost`, a Unix socket) only over `verify-ca` or
///   `verify-full`: with `prefer` (the default) anyone on the path can refuse TLS and ask
///   for the password in clear, and with an unverified `require` present a certificate
///   of their own. `accept_unverified=true` in the URL sends it anyway.
pub(crate) fn connect_options(url: &str) -> Result<PgConnectOptions, StoreError> {
    use sqlx::postgres::PgSslMode;
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut kept = Vec::new();
    let (mut root, mut accept, mut password) = (false, false, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "accept_unverified" => {
                accept = match v {
                    "true" => true,
                    "false" => false,
                    _ => {
                        return Err(StoreError::Config(format!(
                            "accept_unverified={v}: must be true or false"
                        )))
                    }
                };
                continue;
            }
            "sslrootcert" => root = !v.is_empty(),
            "password" => password = !v.is_empty(),
            _ => {}
        }
        kept.push(pair);
    }
    let url = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    let mut options = PgConnectOptions::from_str(&url).map_err(|e| map_sqlx(e, "parse URL"))?;
    root |= std::env::var_os("PGSSLROOTCERT").is_some_and(|r| !r.is_empty());
    if matches!(options.get_ssl_mode(), PgSslMode::Require) && root {
        options = options.ssl_mode(PgSslMode::VerifyCa);
    }
    let authority = base.split_once("://").map_or("", |(_, rest)| {
        rest.split(['/', '?']).next().unwrap_or_default()
    });
    password |= authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
        || std::env::var_os("PGPASSWORD").is_some_and(|p| !p.is_empty());
    let host = options
        .get_host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let loopback = options.get_socket().is_some()
        || host.starts_with('/')
        || host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    let verified = matches!(
        options.get_ssl_mode(),
        PgSslMode::VerifyCa | PgSslMode::VerifyFull
    );
    if password && !loopback && !verified && !accept {
        return Err(StoreError::Config(format!(
            "refusing to send a password to {host} over a connection whose server is not \
             verified (sslmode={}): use sslmode=verify-full (or verify-ca) with sslrootcert, \
             or add accept_unverified=true to the URL to send it anyway",
            match options.get_ssl_mode() {
                PgSslMode::Disable => "disable",
                PgSslMode::Allow => "allow",
                PgSslMode::Prefer => "prefer",
                PgSslMode::Require => "require",
                PgSslMode::VerifyCa => "verify-ca",
                PgSslMode::VerifyFull => "verify-full",
            }
        )));
    }
    Ok(options)
}

/// One connection, alone, before the pool: a server that refuses it (none listening, a
/// wrong password, no such database) answers at once, and its reason is the error. A pool
/// retries a refused connection until `acquire_timeout` and then says only that it timed
/// out, so an unreachable server took 30 s to be reported, without its cause.
async fn first_connection(options: &PgConnectOptions, limit: Duration) -> Result<(), StoreError> {
    use sqlx::Connection as _;
    match tokio::time::timeout(limit, PgConnection::connect_with(options)).await {
        Ok(Ok(connection)) => {
            // Its work is done; a failed goodbye changes nothing.
            let _ = connection.close().await;
            Ok(())
        }
        Ok(Err(e)) => Err(map_sqlx(e, "connect to Postgres")),
        Err(_) => Err(StoreError::Unavailable {
            message: format!(
                "connect to Postgres: no answer within {} ms (acquire_timeout)",
                limit.as_millis()
            ),
            source: None,
        }),
    }
}

impl PgStore {
    /// Connects a pool of at most [`PgConfig::max_connections`] to `url`.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid URL or schema, [`StoreError::Unavailable`]
    /// when the server cannot be reached.
    ///
    /// The claim statements follow the layout of the `processed_messages` found in the
    /// schema ([`PgLayout`]), or [`PgConfig::layout`] when there is none yet.
    pub async fn connect(url: &str, config: PgConfig) -> Result<Self, StoreError> {
        config.validate()?;
        // sqlx names ring in the TLS configuration it builds (its
        // `tls-rustls-ring-native-roots`): nothing is installed process-wide.
        let options = connect_options(url)?;
        first_connection(&options, config.acquire_timeout).await?;
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections)
            .acquire_timeout(config.acquire_timeout)
            // A ping per acquire would add a round trip to every claim transaction; a
            // broken connection surfaces as an Unavailable error on first use instead.
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .map_err(|e| map_sqlx(e, "connect to Postgres"))?;
        let layout = crate::partition::detect_layout(&pool, &config.schema)
            .await?
            .unwrap_or(config.layout);
        let identity = has_column(
            &pool,
            &config.schema,
            "processed_messages",
            "submission_timestamp",
        )
        .await?;
        let traceparent = has_column(&pool, &config.schema, "outbox", "traceparent").await?;
        let cdc = has_column(&pool, &config.schema, "idem_outbox_cdc", "singleton").await?;
        Ok(Self {
            pool,
            shared: Arc::new(Shared::new(config, layout, identity, traceparent, cdc)?),
        })
    }

    /// Wraps an existing pool. Its claims are written for [`PgConfig::layout`] and for
    /// migrated tables (with the identity column of `migrations/0006_claim_identity.sql`
    /// and the outbox's `traceparent` of `migrations/0007_outbox_traceparent.sql`):
    /// nothing is read from the database here; use [`connect`](PgStore::connect) to
    /// follow the table's layout and columns.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid schema.
    pub fn from_pool(pool: PgPool, config: PgConfig) -> Result<Self, StoreError> {
        Ok(Self {
            pool,
            shared: {
                let layout = config.layout;
                let cdc = config.outbox == crate::OutboxMode::ChangeDataCapture;
                Arc::new(Shared::new(config, layout, true, true, cdc)?)
            },
        })
    }

    /// Who reads the outbox: what the schema recorded at connect (or
    /// [`migrate`](PgStore::migrate) since), or [`PgConfig::outbox`] for a store made by
    /// [`from_pool`](PgStore::from_pool).
    pub fn outbox_mode(&self) -> crate::OutboxMode {
        if self.shared.is_cdc() {
            crate::OutboxMode::ChangeDataCapture
        } else {
            crate::OutboxMode::Relay
        }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Begins a transaction on the pool and runs `setup` in it first (a `set_config` of
    /// the transaction, an advisory lock): the store's migrations, purges and flushes start
    /// so, and so can a tool's own DDL. An error is mapped as the store's own
    /// ([`map_sqlx`]), with `begin` or `what` as what was being
    /// done.
    ///
    /// # Errors
    /// [`StoreError`] from the database (the transaction is rolled back).
    pub async fn begin_with(
        &self,
        setup: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
        begin: &str,
        what: &str,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
        let mut tx = self.pool.begin().await.map_err(|e| map_sqlx(e, begin))?;
        setup
            .execute(&mut *tx)
            .await
            .map_err(|e| map_sqlx(e, what))?;
        Ok(tx)
    }

    /// Begins a transaction that holds the advisory lock `lock` (`pg_advisory_xact_lock`
    /// of its `hashtext`), as a migration does so that concurrent ones cannot deadlock:
    /// an error says `begin {what}` or `lock for {what}`.
    ///
    /// # Errors
    /// As [`begin_with`](PgStore::begin_with).
    pub async fn begin_locked(
        &self,
        lock: String,
        what: &str,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
        self.begin_with(
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))").bind(lock),
            &format!("begin {what}"),
            &format!("lock for {what}"),
        )
        .await
    }

    /// The configuration.
    pub fn config(&self) -> &PgConfig {
        &self.shared.config
    }

    /// The schema name (unquoted).
    pub fn schema(&self) -> &str {
        &self.shared.config.schema
    }

    /// The schema as a validated identifier, for [`sql!`](idem_core::sql!) text (see
    /// [`crate::sql`]).
    pub fn schema_ident(&self) -> &Ident {
        &self.shared.schema
    }

    /// The quoted, schema-qualified name of `name`, for example `"grants"."disbursements"`.
    /// `name` is quoted as given (any `"` doubled), so it cannot break out of the
    /// identifier.
    pub fn table(&self, name: &str) -> String {
        format!("{}.{}", self.shared.schema.quoted(), quote(name))
    }

    /// `"schema"."name"` for one of the store's own tables, as SQL text.
    pub(crate) fn sql_table(&self, name: &'static str) -> SqlText {
        self.shared.table(name)
    }

    /// The NOTIFY channel of this schema's outbox.
    pub fn channel(&self) -> &str {
        &self.shared.channel
    }

    #[allow(dead_code)]
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

#[async_trait]
impl ClaimStore for PgStore {
    type Tx = PgTx;

    /// A connection kept warm by the last transaction that ended cleanly (`src/warm.rs`:
    /// without the round trip sqlx spends testing a connection given back to its pool),
    /// else one from the pool; then `BEGIN; SET LOCAL lock_timeout`.
    async fn begin(&self) -> Result<PgTx, StoreError> {
        let begin = || Some(self.shared.begin.clone());
        let tx = |conn| PgTx {
            conn: Some(conn),
            pool: self.pool.clone(),
            shared: self.shared.clone(),
            aborted: false,
            claimed: false,
            lent: false,
            stuck: false,
        };
        let bound = self.shared.config.reply_bound();
        if let Some(mut conn) = self.shared.warm.take() {
            // A failure means it broke while it was parked (a server restart): it is
            // dropped, and a pooled connection is tried instead.
            match tokio::time::timeout(bound, PgTransactionManager::begin(&mut conn, begin())).await
            {
                Ok(Ok(())) => return Ok(tx(conn)),
                Ok(Err(_)) => {}
                Err(_) => drop(conn.detach()),
            }
        }
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| map_sqlx(e, "begin"))?;
        match tokio::time::timeout(bound, PgTransactionManager::begin(&mut conn, begin())).await {
            Ok(begun) => begun.map_err(|e| map_sqlx(e, "begin"))?,
            Err(_) => {
                drop(conn.detach());
                return Err(map_sqlx(no_answer(bound), "begin"));
            }
        }
        Ok(tx(conn))
    }

    /// A new connection (not a pooled one, so it also proves that the server takes new
    /// connections, as after a failover) that commits a transaction holding a transaction
    /// id and an `UPDATE` of `idem_runs` that matches no row: the commit writes and flushes
    /// its WAL record, and writes nothing else. A standby refuses it, and so does a
    /// database made read-only (`default_transaction_read_only`, SQLSTATE 25006); an
    /// operator's lock on `idem_runs`, a stalled WAL disk or a synchronous standby that
    /// does not answer holds it, and [`PgConfig::probe_timeout`] bounds it all. A schema
    /// without `idem_runs` (not migrated since it came) commits the transaction id alone.
    async fn probe(&self) -> Result<(), StoreError> {
        use sqlx::{Connection as _, Executor as _};
        let options = self.pool.connect_options();
        let limit = self.shared.config.probe_timeout;
        let runs = self.sql_table("idem_runs");
        let write = crate::sql::statement(sql!(
            "SELECT txid_current(); UPDATE {runs} SET runs = runs WHERE false",
            runs
        ));
        let run = async {
            let mut conn = PgConnection::connect_with(&options)
                .await
                .map_err(|e| map_sqlx(e, "probe: connect"))?;
            let mut done = conn
                .execute(sqlx::raw_sql(write))
                .await
                .map_err(|e| map_sqlx(e, "probe: commit a write"));
            if matches!(done, Err(StoreError::Config(_))) {
                done = conn
                    .execute(sqlx::raw_sql("SELECT txid_current()"))
                    .await
                    .map_err(|e| map_sqlx(e, "probe: commit a transaction id"));
            }
            let _ = conn.close().await;
            done.map(|_| ())
        };
        match tokio::time::timeout(limit, run).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Unavailable {
                message: format!("probe: no commit within {} ms", limit.as_millis()),
                source: None,
            }),
        }
    }

    /// Conflicts are detected once `processed_messages` has the identity column
    /// (`migrate`); on a reference table that was never migrated they are not.
    fn capabilities(&self) -> Capabilities {
        Capabilities::TRANSACTIONAL.with_conflict_detection(self.shared.has_identity())
    }

    /// One autocommitted statement on a pooled connection (`idem_runs`,
    /// `migrations/0012_runs.sql`): committed, so durable, when it returns. A schema not
    /// migrated since the table was added answers an error (the gate then runs the rerun
    /// without the check).
    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: RunNote,
    ) -> Result<Option<u32>, StoreError> {
        let runs = self.sql_table("idem_runs");
        let text = match note {
            RunNote::Started => sql!(
                "INSERT INTO {runs} AS r (idempotency_key, runs) VALUES ($1, 1) \
                 ON CONFLICT (idempotency_key) DO UPDATE \
                 SET runs = r.runs + 1, last_run_at = now() RETURNING r.runs",
                runs
            ),
            RunNote::NotRun => sql!(
                "UPDATE {runs} SET runs = greatest(runs - 1, 0) WHERE idempotency_key = $1 \
                 RETURNING runs",
                runs
            ),
            RunNote::Settled => sql!(
                "DELETE FROM {runs} WHERE idempotency_key = $1 RETURNING 0",
                runs
            ),
        };
        let n: Option<i32> = sqlx::query_scalar(statement(text))
            .bind(key.to_hex())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| map_sqlx(e, "recording a rerun"))?;
        Ok(Some(u32::try_from(n.unwrap_or(0)).unwrap_or(0)))
    }
}

/// Whether `schema.table` has `column` (false when the table does not exist yet): the
/// identity column of `migrations/0006_claim_identity.sql` on `processed_messages`, the
/// `traceparent` column of `migrations/0007_outbox_traceparent.sql` on `outbox`, the
/// change-data-capture mark of `migrations/0014_outbox_cdc.sql` (its table, never without
/// its row: both are made in one transaction).
async fn has_column(
    pool: &PgPool,
    schema: &str,
    table: &str,
    column: &str,
) -> Result<bool, StoreError> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute a \
         JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = $2 AND a.attname = $3 AND NOT a.attisdropped)",
    )
    .bind(schema)
    .bind(table)
    .bind(column)
    .fetch_one(pool)
    .await
    .map_err(|e| map_sqlx(e, &format!("read the columns of {table}")))
}
