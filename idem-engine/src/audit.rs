//! Audit events: the retained evidence trail.
//!
//! Every processed submission, every suppressed duplicate, every conflict (the same
//! submission with another payload: `outcome = "conflict"`, with the other key's prefix in
//! `existing` and the pipeline's `policy`) and every rejection emits one
//! structured `tracing` event with target [`AUDIT_TARGET`] and the fields `key` (the
//! 12-character prefix), `subject` (the business id) and `outcome`. Payloads are never
//! logged. Route the target to durable storage with your subscriber, for example
//! `tracing_subscriber::filter::Targets::new().with_target("idem::audit", Level::INFO)`.

use crate::key::IdempotencyKey;

/// The `tracing` target of audit events.
pub const AUDIT_TARGET: &str = "idem::audit";

pub(crate) fn processed(key: &IdempotencyKey, subject: &str) {
    tracing::info!(target: "idem::audit", key = %key.short(), subject, outcome = "processed");
}

pub(crate) fn duplicate(key: &IdempotencyKey, subject: &str) {
    tracing::info!(target: "idem::audit", key = %key.short(), subject, outcome = "duplicate");
}

pub(crate) fn rejected(subject: Option<&str>, code: &str) {
    tracing::info!(target: "idem::audit", subject = subject.unwrap_or(""), outcome = "rejected", reason = code);
}

pub(crate) fn conflict(
    key: &IdempotencyKey,
    existing: &IdempotencyKey,
    subject: &str,
    policy: crate::gate::ConflictPolicy,
) {
    tracing::info!(target: "idem::audit", key = %key.short(), existing = %existing.short(), subject, outcome = "conflict", policy = policy.as_str());
}
