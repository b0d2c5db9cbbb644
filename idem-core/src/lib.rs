//! # idem-core
//!
//! The contract of exactly-once *effect* for consumers of at-least-once brokers: what a
//! store, a broker adapter and an engine agree on, with no runtime and no driver.
//!
//! 1. a deterministic [`IdempotencyKey`] from the submission's identity and the SHA-256 of
//!    its payload ([`IdempotencyKey::derive`], byte-identical to the reference);
//! 2. an atomic **claim** of that key in a store's transaction ([`ClaimStore`],
//!    [`ClaimTx::claim`]), in which the business write and an [`OutboxEvent`] commit too;
//! 3. the **ack only after the commit**: [`Acker::ack`] takes an [`AckProof`], which is
//!    minted from a commit that succeeded ([`commit`]) or from a duplicate claim;
//! 4. what happened to each delivery ([`Outcome`]) and the errors that decide it
//!    ([`StoreError`], [`HandlerError`], [`RejectReason`]).
//!
//! The claim also records the submission's identity (subject + submission timestamp,
//! [`ClaimMeta::identity`]): the same submission resent with another payload — another
//! key — is a [`ClaimOutcome::Conflict`].
//!
//! Stores (`idem-store-sqlite`, `idem-store-postgres`, `idem-store-redis`) and broker
//! adapters (`idem-broker`) implement this contract and depend on this crate alone. The
//! engine that runs it — the gate (claim → handler → commit → ack), the consumer loop,
//! the outbox relay, the front filter and the outcome tally — is `idem-engine`, released
//! on its own cadence; the `idem` crate re-exports both.
//!
//! ```
//! use idem_core::IdempotencyKey;
//! let key = IdempotencyKey::derive("A-2026-014", "2026-07-01T09:00:00Z", br#"{"amount_cents":1}"#)?;
//! println!("claiming {}", key.short());
//! # Ok::<(), idem_core::KeyError>(())
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod clock;
pub mod delivery;
pub mod duration;
pub mod error;
pub mod filter;
pub mod ident;
pub mod key;
#[doc(hidden)]
pub mod mutant;
pub mod outbox;
pub mod outcome;
pub mod position;
pub mod record;
pub mod redact;
pub mod retention;
pub mod scheme;
pub mod sql;
pub mod store;
pub mod tally;
pub mod trace;

pub use clock::{Clock, SharedClock, SystemClock};
pub use delivery::{commit, AckProof, AckReason, Acker, CommitReceipt, Delivery, Headers};
pub use error::{
    AckError, BoxError, Error, ErrorClass, HandlerError, KeyError, PublishError, RejectReason,
    StoreError,
};
pub use filter::DoneFilter;
pub use key::{sha256_hex, IdempotencyKey};
pub use outbox::{
    EventId, InvalidStoredEvent, OutboxBacklog, OutboxBatch, OutboxEvent, OutboxSource, Publisher,
};
pub use outcome::{Outcome, OutcomeKind};
pub use position::{PositionMove, PositionStore, StoredPosition, TakenPosition};
pub use redact::{redact_url, Redacted};
pub use store::{
    claim_order, Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, OutboxWriter, RunNote,
};
pub use tally::{FlushId, OutcomeCountStore};
pub use trace::{TraceParent, TRACEPARENT_HEADER};

/// Re-exported so implementors of the traits use the same macro version.
pub use async_trait::async_trait;

// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
