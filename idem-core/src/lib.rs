//! # idem-core
//!
//! Exactly-once *effect* for consumers of at-least-once brokers. A broker that never saw
//! the ack must redeliver; this crate makes the redelivery harmless:
//!
//! 1. a deterministic [`IdempotencyKey`] from the submission's identity and the SHA-256 of
//!    its payload ([`IdempotencyKey::derive`], byte-identical to the reference);
//! 2. an atomic **claim** of that key ([`ClaimTx::claim`]) before any work;
//! 3. the claim, the business write and an [`OutboxEvent`] in **one transaction**;
//! 4. the **ack only after the commit** — [`Acker::ack`] takes an [`AckProof`] that only
//!    this crate mints, after a commit or a duplicate claim; a duplicate rolls back and
//!    acks;
//! 5. a [`Relay`] that publishes the outbox at least once with deterministic [`EventId`]s.
//!
//! The claim also records the submission's identity (subject + submission timestamp,
//! [`ClaimMeta::identity`]): the same submission resent with another payload — another
//! key — is a [`ClaimOutcome::Conflict`], which the gate dead-letters naming both keys
//! ([`Outcome::Conflict`]) or processes as the reference does, by the pipeline's
//! [`ConflictPolicy`].
//!
//! A W3C `traceparent` on a delivery travels with it: the gate's span for the delivery
//! carries its trace id, and the outbox events its handler writes carry the trace on to
//! the relay and the next consumer ([`trace`]).
//!
//! The [`Gate`] runs that state machine for one delivery or one batch; [`consumer::run`]
//! drives a gate over a stream of deliveries with bounded concurrency and graceful
//! shutdown. Stores (`idem-store-sqlite`, `idem-store-postgres`, `idem-store-redis`) and
//! broker adapters (`idem-broker`) live in their own crates: this one has no runtime and
//! no driver.
//!
//! ```
//! use idem_core::IdempotencyKey;
//! let key = IdempotencyKey::derive("A-2026-014", "2026-07-01T09:00:00Z", br#"{"amount_cents":1}"#)?;
//! println!("claiming {}", key.short());
//! # Ok::<(), idem_core::KeyError>(())
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod audit;
mod backoff;
pub mod clock;
pub mod consumer;
pub mod delivery;
pub mod error;
pub mod filter;
pub mod gate;
pub mod ident;
pub mod key;
pub mod mutant;
pub mod outbox;
pub mod position;
pub mod record;
pub mod redact;
pub mod retention;
pub mod sql;
pub mod store;
pub mod tally;
pub mod trace;

pub use clock::{Clock, SharedClock, SystemClock};
pub use consumer::{ConsumerConfig, ConsumerStats};
pub use delivery::{AckProof, AckReason, Acker, Delivery, Headers};
pub use error::{
    AckError, BoxError, Error, ErrorClass, HandlerError, KeyError, PublishError, RejectReason,
    StoreError,
};
pub use filter::{DoneFilter, FilterStats, Filtered, FilteredTx, BREAKER_COOL_DOWN};
pub use gate::{
    ConflictPolicy, Gate, GateConfig, GateObserver, Handler, HandlerPanic, Identified, Outcome,
    OutcomeKind, RetryPolicy, Stage, Submission,
};
pub use key::{sha256_hex, IdempotencyKey};
pub use outbox::{
    Backoff, EventId, InvalidStoredEvent, OutboxBacklog, OutboxBatch, OutboxEvent, OutboxSource,
    Publisher, Relay, RelayObserver, RelayOptions, RelayStats,
};
pub use position::{PositionMove, PositionStore, StoredPosition, TakenPosition};
pub use redact::{redact_url, Redacted};
pub use store::{
    claim_order, Capabilities, ClaimMeta, ClaimOutcome, ClaimStore, ClaimTx, OutboxWriter, RunNote,
};
pub use tally::{FanOut, OutcomeCountStore, OutcomeTally};
pub use trace::{TraceParent, TRACEPARENT_HEADER};

/// Re-exported so implementors of the traits use the same macro version.
pub use async_trait::async_trait;

// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
