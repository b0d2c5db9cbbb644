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
//! ```
//! use idem_core::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey};
//! use idem_store_sqlite::{SqliteConfig, SqliteStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("grants.db");
//! # let path = path.to_str().expect("utf-8");
//! let store = SqliteStore::connect(path, SqliteConfig::default()).await?;
//! store.migrate().await?;
//! sqlx::query("CREATE TABLE IF NOT EXISTS disbursements (award_id TEXT, amount_cents INTEGER, idempotency_key TEXT)")
//!     .execute(store.pool()).await?;
//! let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", b"{}")?;
//! for delivery in 0..2 {
//!     // The second delivery is a redelivery: its claim is a duplicate, nothing is written.
//!     let mut tx = store.begin().await?;
//!     if tx.claim(&key, &ClaimMeta::new("A-1")).await? == ClaimOutcome::Claimed {
//!         sqlx::query("INSERT INTO disbursements (award_id, amount_cents, idempotency_key) VALUES (?, ?, ?)")
//!             .bind("A-1").bind(125_000_i64).bind(key.to_hex())
//!             .execute(tx.conn()).await?;
//!         tx.commit().await?;
//!     } else {
//!         tx.rollback().await?;
//!     }
//! }
//! let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM disbursements").fetch_one(store.pool()).await?;
//! assert_eq!(rows, 1, "posted exactly once");
//! assert!(store.inspect_key(&key).await?.is_some());
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

/// The current time as the stores write it (UTC, ISO 8601 with milliseconds), as a
/// literal so that statements holding it are string literals too (`concat!`).
macro_rules! now {
    () => {
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
    };
}

pub mod audit;
pub mod config;
pub mod error;
pub mod identity;
pub mod inspect;
mod outbox;
mod position;
pub mod retention;
pub mod source;
pub mod sql;
pub mod store;

pub use config::SqliteConfig;
pub use error::{map_sqlx, SqliteError};
pub use identity::{SqliteIdentitySession, StoreIdentity};
pub use source::{SqliteOutboxBatch, SqliteOutboxSource};
pub use store::{SqliteStore, SqliteTx};

/// What a purge deletes and reports, shared with `idem_store_postgres`.
pub use idem_core::retention::{
    PurgeOptions, PurgeProgress, PurgeReport, PurgeTable, RetentionFloor, DEFAULT_RETENTION_FLOOR,
};

/// The record types every SQL store shares (`inspect_key`, `inspect_subject`,
/// `export_audit`).
pub use idem_core::record::{AuditSummary, ClaimRecord, OutboxRecord, Timestamp};

/// Re-exported so callers use the same sqlx.
pub use sqlx;

// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
