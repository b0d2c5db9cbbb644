//! # idem-grant
//!
//! The grant-disbursement pipeline — idem's first user and its demo — in one place that
//! the `idem` command and the examples share:
//!
//! - [`parse_submission`]: the wire format (a JSON object, the message body exactly as
//!   delivered) → the [`IdempotencyKey`] and a [`Grant`], or a [`RejectReason`];
//! - [`GrantHandler`]: the disbursement handler — one `disbursements` row and one
//!   `disbursement.recorded` outbox event in the claim's transaction — for every store
//!   whose transaction implements [`GrantBook`] (SQLite, Postgres, the in-memory store,
//!   and any of them behind a front filter);
//! - [`GrantDb`]: the tables (created beside the store's own) and the read-back an audit
//!   or the demo's verdict needs.
//!
//! ```
//! use idem_grant::parse_submission;
//! let body = br#"{"award_id": "A-2026-014", "submission_timestamp": "2026-07-01T09:00:00Z", "amount_cents": 125000}"#;
//! let sub = parse_submission(body, idem_grant::DEFAULT_MAX_BODY).expect("valid");
//! assert_eq!(sub.subject, "A-2026-014");
//! assert_eq!(sub.input.amount_cents, 125_000);
//! let bad = parse_submission(br#"{"award_id": "A|B", "submission_timestamp": "t", "amount_cents": 1}"#, 1024);
//! assert_eq!(bad.unwrap_err().code, "invalid_identity");
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

mod canonical;
mod db;
mod handler;
mod submission;

pub use canonical::{canonical_json, KeyDerivation};
pub use db::{GrantDb, LedgerRow, GRANT_TABLE};
pub use handler::{GrantBook, GrantHandler, EVENT_DISBURSEMENT_RECORDED};
pub use submission::{
    json_body, parse_submission, parse_submission_with, Grant, DEFAULT_MAX_BODY,
    MAX_AWARD_ID_BYTES, MAX_TIMESTAMP_BYTES,
};

pub use idem_engine::{IdempotencyKey, RejectReason};

// The README's example, run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
