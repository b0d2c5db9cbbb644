//! The SQLite claim store.

use std::str::FromStr;

use async_trait::async_trait;
use idem_core::ident::Ident;
use idem_core::sql::SqlText;
use idem_core::{
    sql, Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, RunNote,
    StoreError,
};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row as _, Sqlite, SqliteConnection, SqlitePool, Transaction};

use crate::config::SqliteConfig;
use crate::error::map;
use crate::sql::statement;

/// The claims (with their identity column and its unique partial index: conflict
/// detection) and the outbox (with the relay's columns).
const MIGRATION: &str = include_str!("../migrations/0001_init.sql");
/// The store's identity (see [`crate::identity`]).
const IDENTITY: &str = include_str!("../migrations/0002_store_identity.sql");
/// The outcome tally (`idem_outcome_counts`, [`SqliteStore::add_outcome_counts`]).
const OUTCOME_COUNTS: &str = include_str!("../migrations/0003_outcome_counts.sql");
/// The reruns' record (`idem_runs`, [`ClaimStore::note_run`]).
const RUNS: &str = include_str!("../migrations/0004_runs.sql");
/// The log positions kept in claim transactions (`idem_positions`, [`idem_core::position`]).
const POSITIONS: &str = include_str!("../migrations/0005_positions.sql");

/// The current time as the store writes it (see `now!`).
pub(crate) const NOW: &str = now!();

/// The embedded store. Clones share one connection pool.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// Connects to (creating if missing) the database at `path` — a file path or a
    /// `sqlite://PATH` URL — in WAL mode.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the file cannot be opened.
    pub async fn connect(path: &str, config: SqliteConfig) -> Result<Self, StoreError> {
        let path = path
            .strip_prefix("sqlite://")
            .or_else(|| path.strip_prefix("sqlite:"))
            .unwrap_or(path);
        if path.is_empty() {
            return Err(StoreError::Config(
                "an SQLite store needs a file path (sqlite://PATH)".into(),
            ));
        }
        let options = SqliteConnectOptions::from_str(&format!("sqlite://{path}"))
            .map_err(|e| StoreError::Config(format!("invalid SQLite path {path:?}: {e}")))?
            .create_if_missing(config.create_if_missing)
            .journal_mode(SqliteJournalMode::Wal)
            // FULL, not NORMAL: in WAL mode NORMAL skips the sync at commit, so a commit
            // that was acked (and whose redelivery will be skipped) could vanish on a power
            // loss. FULL syncs the WAL at every commit.
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(config.busy_timeout)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(config.max_connections.max(1))
            // A connection sqlx still counts as inside a transaction is closed, never
            // handed out: when a commit fails on a full disk or an I/O error, SQLite has
            // already rolled the transaction back, sqlx's own ROLLBACK then fails, and
            // its count stays at one — every later `BEGIN IMMEDIATE` on that connection
            // would fail ("InvalidSavePointStatement"), each one a lost attempt.
            .before_acquire(|conn, _| {
                use sqlx::Connection as _;
                let open = conn.is_in_transaction();
                Box::pin(async move { Ok(!open) })
            })
            .connect_with(options)
            .await
            .map_err(|e| map("opening the SQLite database", e))?;
        Ok(Self { pool })
    }

    /// Wraps an existing pool.
    pub fn from_pool(pool: SqlitePool) -> Self {
        Self { pool }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Creates the tables if they are missing (the outcome tally `idem_outcome_counts`
    /// included), and the store's identity (a random id, kept once created; see
    /// [`crate::identity`]). A `processed_messages` made by another program with only the
    /// reference columns is used, given the nullable identity column first. Idempotent.
    ///
    /// # Errors
    /// A store error if the DDL fails.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        self.add_identity_to_reference_table().await?;
        for (script, what) in [
            (MIGRATION, "migrating"),
            (IDENTITY, "creating the store identity"),
            (OUTCOME_COUNTS, "creating the outcome tally"),
            (RUNS, "creating the reruns' record"),
            (POSITIONS, "creating the log positions"),
        ] {
            sqlx::raw_sql(script)
                .execute(&self.pool)
                .await
                .map_err(|e| map(what, e))?;
        }
        Ok(())
    }

    /// Adds the nullable identity column, `submission_timestamp`, to a `processed_messages`
    /// made by another program's consumer with only the reference columns, before
    /// `migrations/0001_init.sql` indexes it; in one transaction, so that two processes
    /// migrating at once add it once. A table made by [`migrate`](Self::migrate) has it.
    async fn add_identity_to_reference_table(&self) -> Result<(), StoreError> {
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| map("migrating the claim identity", e))?;
        let lacking: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master \
                            WHERE type = 'table' AND name = 'processed_messages') \
                AND NOT EXISTS (SELECT 1 FROM pragma_table_info('processed_messages') \
                                WHERE name = 'submission_timestamp')",
        )
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| map("migrating the claim identity", e))?;
        if lacking {
            sqlx::Executor::execute(
                &mut *tx,
                "ALTER TABLE processed_messages ADD COLUMN submission_timestamp TEXT",
            )
            .await
            .map_err(|e| map("migrating the claim identity", e))?;
        }
        tx.commit()
            .await
            .map_err(|e| map("migrating the claim identity", e))
    }

    /// `SELECT count(*)` of a table this store owns or the caller names; `table` must be
    /// a plain identifier.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an invalid name, a store error if the query fails.
    pub async fn count(&self, table: &str) -> Result<i64, StoreError> {
        let table = Ident::new(table)?;
        sqlx::query_scalar::<_, i64>(statement(sql!("SELECT count(*) FROM {table}", table)))
            .fetch_one(&self.pool)
            .await
            .map_err(|e| map("counting rows", e))
    }
}

/// A claim transaction (`BEGIN IMMEDIATE`). The handler writes its business rows through
/// [`conn`](SqliteTx::conn). Dropping it without commit rolls back.
#[derive(Debug)]
pub struct SqliteTx {
    tx: Transaction<'static, Sqlite>,
}

impl SqliteTx {
    /// The transaction's connection, for business writes.
    pub fn conn(&mut self) -> &mut SqliteConnection {
        &mut self.tx
    }

    /// Why a claim inserted nothing: the key's own row (`Duplicate`), else the identity's
    /// (`Conflict`). Writers are serialised (`BEGIN IMMEDIATE`), so the row that refused
    /// the insert is still there.
    async fn refused(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        let Some((subject, stamp)) = meta.identity() else {
            return Ok(ClaimOutcome::Duplicate);
        };
        let row: Option<(String, i64)> = sqlx::query_as(
            "SELECT idempotency_key, 0 FROM processed_messages WHERE idempotency_key = ?1 \
             UNION ALL \
             SELECT * FROM (SELECT idempotency_key, 1 FROM processed_messages \
               WHERE award_id = ?2 AND submission_timestamp = ?3 LIMIT 1) \
             ORDER BY 2 LIMIT 1",
        )
        .bind(key.to_hex())
        .bind(subject)
        .bind(stamp)
        .fetch_optional(&mut *self.tx)
        .await
        .map_err(|e| map("classifying a claim", e))?;
        match row {
            Some((existing, 1)) => Ok(ClaimOutcome::Conflict {
                existing: existing.parse().map_err(|_| {
                    StoreError::other(
                        format!("processed_messages holds a malformed key {existing:?}"),
                        false,
                    )
                })?,
            }),
            _ => Ok(ClaimOutcome::Duplicate),
        }
    }
}

#[async_trait]
impl ClaimStore for SqliteStore {
    type Tx = SqliteTx;

    async fn begin(&self) -> Result<SqliteTx, StoreError> {
        let tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| map("beginning a transaction", e))?;
        Ok(SqliteTx { tx })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::TRANSACTIONAL
    }

    /// Takes the database's write lock (`BEGIN IMMEDIATE`, waiting at most the busy
    /// timeout) and commits: a locked, read-only or unreachable file fails it.
    async fn probe(&self) -> Result<(), StoreError> {
        let tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| map("probe: taking the write lock", e))?;
        tx.commit().await.map_err(|e| map("probe: commit", e))
    }

    /// One autocommitted statement on a pooled connection (`idem_runs`): durable when it
    /// returns, under `synchronous=FULL`.
    async fn note_run(
        &self,
        key: &IdempotencyKey,
        note: RunNote,
    ) -> Result<Option<u32>, StoreError> {
        let sql = match note {
            RunNote::Started => concat!(
                "INSERT INTO idem_runs (idempotency_key, runs, last_run_at) VALUES (?1, 1, ",
                now!(),
                ") ON CONFLICT (idempotency_key) DO UPDATE SET runs = runs + 1, \
                 last_run_at = excluded.last_run_at RETURNING runs"
            ),
            RunNote::NotRun => {
                "UPDATE idem_runs SET runs = max(runs - 1, 0) WHERE idempotency_key = ?1 \
                 RETURNING runs"
            }
            RunNote::Settled => "DELETE FROM idem_runs WHERE idempotency_key = ?1 RETURNING 0",
        };
        let n: Option<i64> = sqlx::query_scalar(sql)
            .bind(key.to_hex())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| map("recording a rerun", e))?;
        Ok(Some(u32::try_from(n.unwrap_or(0)).unwrap_or(u32::MAX)))
    }
}

#[async_trait]
impl ClaimTx for SqliteTx {
    async fn claim(
        &mut self,
        key: &IdempotencyKey,
        meta: &ClaimMeta,
    ) -> Result<ClaimOutcome, StoreError> {
        let stamp = meta.identity().map(|(_, ts)| ts);
        let done = sqlx::query(concat!(
            "INSERT INTO processed_messages (idempotency_key, award_id, claimed_at, submission_timestamp) \
             VALUES (?, ?, ",
            now!(),
            ", ?) ON CONFLICT DO NOTHING"
        ))
        .bind(key.to_hex())
        .bind(&meta.subject)
        .bind(stamp)
        .execute(&mut *self.tx)
        .await
        .map_err(|e| map("claiming a key", e))?;
        if done.rows_affected() == 1 {
            Ok(ClaimOutcome::Claimed)
        } else {
            self.refused(key, meta).await
        }
    }

    async fn claim_batch(
        &mut self,
        items: &[(IdempotencyKey, ClaimMeta)],
    ) -> Result<Vec<ClaimOutcome>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        // SQLite allows 32766 bound variables; 3 per row, so chunk well below that.
        for chunk in items.chunks(4000) {
            let mut sql = SqlText::from_static(
                "INSERT INTO processed_messages \
                 (idempotency_key, award_id, claimed_at, submission_timestamp) VALUES ",
            );
            for i in 0..chunk.len() {
                if i > 0 {
                    sql.push(",");
                }
                sql.push("(?, ?, ").push(NOW).push(", ?)");
            }
            // Any unique index: the key's, and the identity's (a row of this statement
            // included, so two payloads of one identity in one batch conflict too).
            sql.push(" ON CONFLICT DO NOTHING RETURNING idempotency_key");
            let mut q = sqlx::query(statement(sql));
            for (key, meta) in chunk {
                q = q
                    .bind(key.to_hex())
                    .bind(meta.subject.clone())
                    .bind(meta.identity().map(|(_, ts)| ts.to_owned()));
            }
            let rows = q
                .fetch_all(&mut *self.tx)
                .await
                .map_err(|e| map("claiming a batch", e))?;
            let mut claimed: std::collections::HashSet<String> =
                rows.iter().map(|r| r.get::<String, _>(0)).collect();
            for (key, meta) in chunk {
                // The first occurrence of a returned key is the claim; repeats are duplicates.
                out.push(if claimed.remove(&key.to_hex()) {
                    ClaimOutcome::Claimed
                } else {
                    self.refused(key, meta).await?
                });
            }
        }
        Ok(out)
    }

    /// Each partition's row read and written back in the transaction (one writer at a
    /// time), at its move's epoch ([`idem_core::position`]).
    async fn advance_positions(
        &mut self,
        moves: &[idem_core::PositionMove],
    ) -> Result<(), StoreError> {
        crate::position::advance(self, moves).await
    }

    async fn commit(self) -> Result<(), StoreError> {
        self.tx.commit().await.map_err(|e| map("committing", e))
    }

    async fn rollback(self) -> Result<(), StoreError> {
        self.tx.rollback().await.map_err(|e| map("rolling back", e))
    }
}
