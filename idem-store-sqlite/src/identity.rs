//! The store's identity (`idem_store_identity`, `migrations/0002_store_identity.sql`): a
//! random id created by [`SqliteStore::migrate`] and a session counter, for a front
//! filter to scope its marks to (see `idem_store_postgres::identity`, which this mirrors).

use idem_core::StoreError;
use sqlx::{Sqlite, Transaction};

use crate::error::map;
use crate::store::SqliteStore;

// A store's identity as last read: the type is `idem-core`'s, shared with
// `idem-store-postgres`.
pub use idem_core::record::StoreIdentity;

/// An identity session being started: the write lock is held (`BEGIN IMMEDIATE`) and the
/// session incremented, uncommitted. Register the session, then [`commit`](Self::commit)
/// — or [`rotate`](Self::rotate) first. Dropping it rolls back.
#[derive(Debug)]
pub struct SqliteIdentitySession {
    tx: Transaction<'static, Sqlite>,
    identity: StoreIdentity,
}

const ROTATE: &str = "UPDATE idem_store_identity SET store_id = lower(hex(randomblob(16))), \
     session = 1, rotated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
     RETURNING store_id, session";

impl SqliteIdentitySession {
    /// The identity with the new session number.
    pub fn identity(&self) -> &StoreIdentity {
        &self.identity
    }

    /// Replaces the id by a new random one, session 1, in this transaction.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn rotate(&mut self) -> Result<&StoreIdentity, StoreError> {
        let (store_id, session): (String, i64) = sqlx::query_as(ROTATE)
            .fetch_optional(&mut *self.tx)
            .await
            .map_err(|e| map("rotating the store identity", e))?
            .ok_or_else(StoreIdentity::missing)?;
        self.identity = StoreIdentity::new(store_id, session);
        Ok(&self.identity)
    }

    /// Commits the new session (and rotation).
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn commit(self) -> Result<(), StoreError> {
        self.tx
            .commit()
            .await
            .map_err(|e| map("committing the identity session", e))
    }
}

impl SqliteStore {
    /// The store's identity, or a [`StoreError::Config`] when [`migrate`](Self::migrate)
    /// has not created it.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn store_identity(&self) -> Result<StoreIdentity, StoreError> {
        let row: Result<Option<(String, i64)>, _> =
            sqlx::query_as("SELECT store_id, session FROM idem_store_identity")
                .fetch_optional(self.pool())
                .await;
        let row = match row {
            Ok(row) => row,
            Err(e) => return Err(self.identity_error(e, "reading the store identity").await),
        };
        let (store_id, session) = row.ok_or_else(StoreIdentity::missing)?;
        Ok(StoreIdentity::new(store_id, session))
    }

    /// Gives the store a new random identity (session 1), committed: the runbook step
    /// after restoring or copying the database file (`idem migrate
    /// --rotate-store-identity`).
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn rotate_store_identity(&self) -> Result<StoreIdentity, StoreError> {
        let mut session = self.begin_identity_session().await?;
        let id = session.rotate().await?.clone();
        session.commit().await?;
        Ok(id)
    }

    /// Starts an identity session: `BEGIN IMMEDIATE` (the write lock, so concurrent starts
    /// are serialised) and the session counter incremented.
    ///
    /// # Errors
    /// [`StoreError::Config`] when the identity table or row is missing; other
    /// [`StoreError`]s from the database.
    pub async fn begin_identity_session(&self) -> Result<SqliteIdentitySession, StoreError> {
        let mut tx = self
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| map("beginning an identity session", e))?;
        let row: Result<Option<(String, i64)>, _> = sqlx::query_as(
            "UPDATE idem_store_identity SET session = session + 1 RETURNING store_id, session",
        )
        .fetch_optional(&mut *tx)
        .await;
        let (store_id, session) = match row {
            Ok(row) => row.ok_or_else(StoreIdentity::missing)?,
            Err(e) => {
                drop(tx);
                return Err(self.identity_error(e, "starting an identity session").await);
            }
        };
        Ok(SqliteIdentitySession {
            tx,
            identity: StoreIdentity::new(store_id, session),
        })
    }
}

impl SqliteStore {
    /// Maps an error of an identity statement: a missing table (checked in
    /// `sqlite_master`, not by the error's text) is a configuration error.
    async fn identity_error(&self, e: sqlx::Error, what: &str) -> StoreError {
        let exists: Result<i64, _> = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'idem_store_identity'",
        )
        .fetch_one(self.pool())
        .await;
        match exists {
            Ok(0) => StoreIdentity::missing(),
            _ => map(what, e),
        }
    }
}
