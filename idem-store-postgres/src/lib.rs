//! # idem-store-postgres
//!
//! The durable dedup store of idem on Postgres, through sqlx:
//!
//! - [`PgStore`] — a [`ClaimStore`](idem_core::ClaimStore) whose claim is `INSERT INTO
//!   processed_messages … ON CONFLICT DO NOTHING` **inside the caller's transaction**
//!   ([`PgTx`]); the handler writes its business rows through [`PgTx::conn`] and its
//!   outbox events through [`OutboxWriter`](idem_core::OutboxWriter), and all of it
//!   commits at once. Batch claims are one round trip.
//! - [`PgOutboxSource`] — the relay's source: `FOR UPDATE SKIP LOCKED` batches, per-subject
//!   order across several relays, LISTEN/NOTIFY wake-ups with a polling fallback.
//! - [`PgStore::purge`] — retention in bounded batches, with a three-year floor
//!   (2 CFR §200.334) that is only crossed on purpose; on the partitioned layout
//!   ([`PgLayout::Partitioned`], [`partition`]) it drops whole monthly partitions.
//! - Three layouts of the tables ([`PgLayout`]): the reference's plain tables (the
//!   default), partitioned by submission month ([`partition`]), and distributed — keyed
//!   by the award id so that Citus can distribute them colocated ([`distributed`]; it runs
//!   on plain Postgres, where it is tested; the Citus step itself is untested).
//! - [`PgStore::inspect_key`] / [`PgStore::inspect_subject`] — the audit questions.
//! - [`PgStore::export_audit`] — the dedup records of a time window and their outbox
//!   events, streamed in bounded pages, for a write-once archive.
//! - [`PgStore::audit_stats`] / [`PgStore::add_outcome_counts`] /
//!   [`PgStore::outcome_counts`] — what `idem audit report` shows, and the outcome tally
//!   (`idem_outcome_counts`: duplicates, conflicts, dead letters per day, counted by the
//!   consumers; see [`idem_core::tally`]).
//! - [`PgStore::store_identity`] / [`PgStore::begin_identity_session`] /
//!   [`PgStore::rotate_store_identity`] — the identity a front filter scopes its marks to.
//! - [`PgStore::migrate`] — the embedded, idempotent schema (`migrations/`);
//!   [`PgStore::migrate_append_only`] makes `processed_messages` append-only evidence.
//!
//! Tables are the reference's (`processed_messages(idempotency_key, award_id,
//! claimed_at)`, `outbox(event_type, payload, created_at, …)`), in a configurable
//! schema; a `processed_messages` created by another program with only those three
//! columns is used unchanged (without conflict detection). `migrate` adds one nullable
//! column, `submission_timestamp`, and a unique index on `(award_id,
//! submission_timestamp)` (`migrations/0006_claim_identity.sql`): a second payload of one
//! submission is then [`idem_core::ClaimOutcome::Conflict`], and the other program,
//! which never fills the column, still shares the table.
//!
//! Errors on the claim path are [`idem_core::StoreError`]s chosen by SQLSTATE
//! ([`error::map_sqlx`]); the crate's own operations return [`PgError`].
//!
//! The example runs against a local server (as the crate's tests do):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, IdempotencyKey, OutboxEvent, OutboxWriter};
//! use idem_store_postgres::{PgConfig, PgStore};
//!
//! let url = std::env::var("IDEM_TEST_POSTGRES_URL").unwrap_or("postgres://postgres@127.0.0.1:5432/test".into());
//! let store = PgStore::connect(&url, PgConfig::new("idem_doc_example")?).await?;
//! store.migrate().await?;
//! let key = IdempotencyKey::derive("A-1", "2026-07-01T09:00:00Z", br#"{"amount_cents":5}"#)?;
//! let mut tx = store.begin().await?;
//! match tx.claim(&key, &ClaimMeta::new("A-1")).await? {
//!     ClaimOutcome::Claimed => {
//!         tx.enqueue(&OutboxEvent::new(key, "disbursement.recorded", "A-1", r#"{"award_id":"A-1"}"#)).await?;
//!         tx.commit().await?;
//!     }
//!     // A conflict (the same award and timestamp with another payload) needs a decision:
//!     // the gate's ConflictPolicy makes it; here it is left alone.
//!     ClaimOutcome::Duplicate | ClaimOutcome::InProgress | ClaimOutcome::Conflict { .. } => {
//!         tx.rollback().await?
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! ## TLS
//! With the `tls` feature the connection URL's TLS settings are honoured, through rustls
//! (the `ring` provider; no OpenSSL): `sslmode` `require` (encrypted, not verified;
//! with an `sslrootcert`, verified as `verify-ca`, as libpq does), `verify-ca` (the
//! server's certificate chains to a trusted root) and `verify-full` (and names the host); `sslrootcert` (a PEM file of trusted roots, else the system's;
//! `SSL_CERT_FILE` / `SSL_CERT_DIR` name others), `sslcert` and `sslkey` (a client
//! certificate), e.g.
//! `postgres://idem@db.internal/app?sslmode=verify-full&sslrootcert=/etc/idem/pg-ca.pem`.
//! A mode that requires TLS never falls back to plaintext: a server without TLS is
//! refused, and so is every such URL on a build without the feature. `sslmode=prefer`
//! (the default, as in libpq) uses TLS when the server offers it and it is compiled in,
//! plaintext otherwise: use `require` or stronger wherever plaintext is not acceptable.
//! A password (in the URL, `?password=`, `PGPASSWORD`) goes to a host that is not
//! loopback only over `verify-ca` or `verify-full`: over `prefer` anyone on the path can
//! turn TLS down and ask for it in clear, over an unverified `require` present a
//! certificate of their own. `accept_unverified=true` in the URL sends it anyway.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod audit;
pub mod config;
pub mod distributed;
pub mod error;
pub mod identity;
pub mod inspect;
pub mod migrate;
mod outbox;
pub mod partition;
mod position;
pub mod retention;
pub mod source;
pub mod sql;
pub mod store;
mod warm;

pub use audit::AuditSummary;
pub use config::{OutboxMode, PgConfig, PgLayout};
pub use error::PgError;
pub use identity::{PgIdentitySession, StoreIdentity};
pub use inspect::{ClaimRecord, OutboxRecord, Timestamp};
pub use outbox::{PgColumn, PgRows};
pub use partition::PartitionMonth;
pub use retention::{
    PurgeOptions, PurgeProgress, PurgeReport, PurgeTable, RetentionFloor, DEFAULT_RETENTION_FLOOR,
};
pub use source::{PgOutboxBatch, PgOutboxSource};
pub use store::{PgStore, PgTx, APPEND_ONLY_SQLSTATE};

/// Re-exported so callers use the same sqlx as the store: [`PgStore::pool`],
/// [`PgStore::from_pool`], [`PgTx::conn`] and the `error` functions take and give its types.
pub use sqlx;
/// The sqlx types of this crate's signatures: [`PgStore::pool`] and [`PgStore::from_pool`]
/// (a pool), [`PgTx::conn`] (the claim transaction's connection, for the business writes).
pub use sqlx::{PgConnection, PgPool};

// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
