//! The store's identity (`idem_store_identity`, `migrations/0004_store_identity.sql`): a
//! random id created by [`PgStore::migrate`], and a session counter. A front filter
//! scopes its marks to the id, so stores sharing one Redis never see each other's marks,
//! and registers each session in Redis, so a store restored from a backup (or cloned)
//! is noticed and gets a new id. [`PgStore::rotate_store_identity`] is the runbook step
//! for restores, failovers and clones.

use idem_core::sql::SqlText;
use idem_core::{sql, StoreError};
use sqlx::{Postgres, Transaction};

use crate::error::map_sqlx;
use crate::sql::statement;
use crate::store::PgStore;

// A store's identity as last read: the type is `idem-core`'s, shared with
// `idem-store-sqlite`.
pub use idem_core::record::StoreIdentity;

/// An identity session being started: the row is locked and its session incremented,
/// uncommitted. Register the session elsewhere, then [`commit`](Self::commit) — or
/// [`rotate`](Self::rotate) first when the registration says the session is stale.
/// Dropping it rolls back.
#[derive(Debug)]
pub struct PgIdentitySession {
    tx: Transaction<'static, Postgres>,
    table: SqlText,
    identity: StoreIdentity,
}

impl PgIdentitySession {
    /// The identity with the new session number.
    pub fn identity(&self) -> &StoreIdentity {
        &self.identity
    }

    /// Replaces the id by a new random one, session 1, in this transaction.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn rotate(&mut self) -> Result<&StoreIdentity, StoreError> {
        self.identity = rotate_in(&mut self.tx, &self.table).await?;
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
            .map_err(|e| map_sqlx(e, "commit the identity session"))
    }
}

async fn rotate_in(
    tx: &mut Transaction<'static, Postgres>,
    table: &SqlText,
) -> Result<StoreIdentity, StoreError> {
    let (store_id, session): (String, i64) = sqlx::query_as(statement(sql!(
        "UPDATE {table} SET store_id = replace(gen_random_uuid()::text, '-', ''), \
         session = 1, rotated_at = now() RETURNING store_id, session",
        table
    )))
    .fetch_optional(&mut **tx)
    .await
    .map_err(|e| map_sqlx(e, "rotate the store identity"))?
    .ok_or_else(StoreIdentity::missing)?;
    Ok(StoreIdentity::new(store_id, session))
}

impl PgStore {
    /// The store's identity, or a [`StoreError::Config`] when
    /// [`migrate`](PgStore::migrate) has not created it.
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn store_identity(&self) -> Result<StoreIdentity, StoreError> {
        let row: Option<(String, i64)> = sqlx::query_as(statement(sql!(
            "SELECT store_id, session FROM {t}",
            t = self.sql_table("idem_store_identity")
        )))
        .fetch_optional(self.pool())
        .await
        .map_err(|e| map_sqlx(e, "read the store identity"))?;
        let (store_id, session) = row.ok_or_else(StoreIdentity::missing)?;
        Ok(StoreIdentity::new(store_id, session))
    }

    /// Gives the store a new random identity (session 1), committed: front-filter marks
    /// written for the old identity no longer apply to it. The runbook step after a
    /// restore from a backup, a failover that may have lost commits, or a copy of the
    /// database (`idem migrate --rotate-store-identity`).
    ///
    /// # Errors
    /// [`StoreError`] from the database.
    pub async fn rotate_store_identity(&self) -> Result<StoreIdentity, StoreError> {
        let mut tx = self
            .pool()
            .begin()
            .await
            .map_err(|e| map_sqlx(e, "begin"))?;
        let id = rotate_in(&mut tx, &self.sql_table("idem_store_identity")).await?;
        tx.commit()
            .await
            .map_err(|e| map_sqlx(e, "commit the identity rotation"))?;
        Ok(id)
    }

    /// Starts an identity session: increments the session counter in a transaction that
    /// holds the row's lock until [`PgIdentitySession::commit`], so concurrent starts are
    /// serialised and register their numbers in order.
    ///
    /// # Errors
    /// [`StoreError::Config`] when the identity table or row is missing; other
    /// [`StoreError`]s from the database.
    pub async fn begin_identity_session(&self) -> Result<PgIdentitySession, StoreError> {
        let table = self.sql_table("idem_store_identity");
        let mut tx = self
            .pool()
            .begin()
            .await
            .map_err(|e| map_sqlx(e, "begin"))?;
        let (store_id, session): (String, i64) = sqlx::query_as(statement(sql!(
            "UPDATE {table} SET session = session + 1 RETURNING store_id, session",
            table
        )))
        .fetch_optional(&mut *tx)
        .await
        .map_err(|e| map_sqlx(e, "start an identity session"))?
        .ok_or_else(StoreIdentity::missing)?;
        Ok(PgIdentitySession {
            tx,
            table,
            identity: StoreIdentity::new(store_id, session),
        })
    }
}
