//! # idem-store-sqlite
//!
//! The embedded default store of [idem](idem_core): the claim, the business rows and the
//! outbox in one SQLite transaction, with no server to run. WAL mode with
//! `synchronous=FULL` (a commit that was acked survives a power loss: every commit
//! syncs the WAL); migrations embedded
//! and idempotent; the reference table names (`processed_messages`, `outbox`), so a
//! database written by another program's consumer can be shared.
//!
//! Every claim transaction starts with `BEGIN IMMEDIATE`: SQLite allows one writer at a
//! time, and taking the write lock up front means two workers never both read and then
//! fail to upgrade. Concurrent workers therefore serialise on the write lock (waiting up
//! to [`SqliteConfig::busy_timeout`]); a second claim of a key always sees the first one
//! committed or rolled back, as the contract asks.
//!
//! ```no_run
//! use idem_core::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
//! use idem_store_sqlite::{SqliteConfig, SqliteStore};
//!
//! # async fn run() -> Result<(), idem_core::StoreError> {
//! let store = SqliteStore::open("grants.db", SqliteConfig::default()).await?;
//! store.migrate().await?;
//! let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}").expect("valid");
//! let mut tx = store.begin().await?;
//! if tx.claim(&key, &ClaimMeta::new("A-1")).await? == ClaimOutcome::Claimed {
//!     sqlx::query("INSERT INTO disbursements (award_id, amount_cents, idempotency_key) VALUES (?, ?, ?)")
//!         .bind("A-1").bind(125_000_i64).bind(key.to_hex())
//!         .execute(tx.conn()).await.map_err(|e| idem_core::StoreError::other(e.to_string(), false))?;
//!     tx.commit().await?;
//! }
//! # Ok(()) }
//! ```

/// The current time as the stores write it (UTC, ISO 8601 with milliseconds), as a
/// literal so that statements holding it are string literals too (`concat!`).
macro_rules! now {
    () => {
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
    };
}

mod audit;
mod config;
mod error;
pub mod identity;
mod inspect;
mod outbox;
pub mod sql;
mod store;

pub use config::SqliteConfig;
pub use identity::{SqliteIdentitySession, StoreIdentity};
pub use outbox::{SqliteOutboxBatch, SqliteOutboxSource};
pub use store::{ClaimRow, OutboxRow, SqliteStore, SqliteTx};

/// The record types every SQL store shares (`inspect_key`, `inspect_subject`,
/// `export_audit`).
pub use idem_core::record::{AuditSummary, ClaimRecord, OutboxRecord, Timestamp};

/// Re-exported so callers use the same sqlx.
pub use sqlx;
