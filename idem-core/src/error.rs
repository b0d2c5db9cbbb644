//! Errors. Every error says whether retrying can help ([`StoreError::is_retryable`] and
//! friends); duplicates are *outcomes*, never errors.

use std::time::Duration;

/// A boxed error kept as the source of ours.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error and its sources on one line, `: `-separated; a source whose text the line
/// already holds is left out (an error that prints its source's text too).
///
/// ```
/// let e = std::io::Error::new(std::io::ErrorKind::Other, "disk full");
/// assert_eq!(idem_core::error::error_chain(&e), "disk full");
/// ```
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        let t = src.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = src.source();
    }
    s
}

/// Why a key could not be derived. Always a problem with the input: never retryable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The business (subject) id is empty.
    #[error("the subject id is empty")]
    EmptySubject,
    /// The submission timestamp is empty.
    #[error("the submission timestamp is empty")]
    EmptyTimestamp,
    /// The subject id contains `|`, which would let two identities collide.
    #[error("the subject id contains '|', which would make two identities collide")]
    SeparatorInSubject,
    /// Not 64 hex characters.
    #[error("an idempotency key is 64 hex characters")]
    InvalidHex,
}

/// A dedup or outbox store failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store could not be reached, or the connection broke. Retrying can help.
    #[error("store unavailable: {message}")]
    Unavailable {
        /// What was being done.
        message: String,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },
    /// The store works but will not take this work now, whatever the message: a lock
    /// that did not clear within the lock timeout (an operator's `LOCK TABLE`, a long
    /// transaction), a read-only node (a failover to a standby), a full disk, no memory or
    /// connections left, a shutdown under way. Retrying later can succeed, and it is never
    /// the message's fault: the gate defers the delivery without counting an attempt.
    #[error("store degraded: {message}")]
    Degraded {
        /// What was being done.
        message: String,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },
    /// A serialization failure or deadlock: the transaction was rolled back and running it
    /// again can succeed.
    #[error("transaction conflict: {message}")]
    Conflict {
        /// What was being done.
        message: String,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },
    /// A write failed for a reason that retrying will not change (a constraint other than
    /// the claim's, a missing table, a type mismatch).
    #[error("store rejected the operation: {message}")]
    Rejected {
        /// What was being done.
        message: String,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },
    /// The store is misconfigured (an invalid schema or table name, a missing migration).
    #[error("store configuration: {0}")]
    Config(String),
    /// A transaction advanced a log position ([`crate::position`]) at an epoch the
    /// partition has left: another member took the partition since. The transaction
    /// rolled back; its deliveries belong to the new owner and are left unsettled (never
    /// acked, never dead-lettered).
    #[error("fenced: {source_name} partition(s) {partitions:?} were taken by another member")]
    Fenced {
        /// The position's source.
        source_name: String,
        /// The partitions taken since.
        partitions: Vec<i32>,
    },
    /// Anything else; `retryable` is the adapter's best judgement.
    #[error("store error: {message}")]
    Other {
        /// What was being done.
        message: String,
        /// Whether a retry can help.
        retryable: bool,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },
}

/// What a failure means for the delivery that met it: the one place that decides between
/// a redelivery, a dead letter and stopping the consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// A retry can succeed (the store or broker is unreachable, a timeout, a serialization
    /// failure, a deadlock): roll back and nack with a growing delay.
    Transient,
    /// This message can never succeed (bad bytes, a value no column holds, a handler's
    /// refusal): roll back and dead-letter it with the reason.
    Permanent,
    /// The deployment is wrong (a missing table or privilege, a dead-letter destination
    /// that refuses dead letters): no message can succeed until an operator acts, so the
    /// consumer stops and acks nothing more.
    Config,
}

impl ErrorClass {
    /// A lowercase name (`transient`, `permanent`, `config`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Transient => "transient",
            Self::Permanent => "permanent",
            Self::Config => "config",
        }
    }
}

impl StoreError {
    /// What the failure means for the delivery: see [`ErrorClass`].
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::Config(_) => ErrorClass::Config,
            e if e.is_retryable() => ErrorClass::Transient,
            _ => ErrorClass::Permanent,
        }
    }

    /// Whether running the same operation again can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Unavailable { .. } | Self::Conflict { .. } | Self::Degraded { .. } => true,
            Self::Rejected { .. } | Self::Config(_) | Self::Fenced { .. } => false,
            Self::Other { retryable, .. } => *retryable,
        }
    }

    /// Whether this is [`StoreError::Fenced`]: the delivery is no longer this member's
    /// to settle.
    pub fn is_fenced(&self) -> bool {
        matches!(self, Self::Fenced { .. })
    }

    /// Shorthand for [`StoreError::Unavailable`].
    pub fn unavailable(message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Unavailable {
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// Whether this failure is the store's whatever the message
    /// ([`StoreError::Degraded`]): never counted against a delivery's attempts.
    pub fn is_degraded(&self) -> bool {
        matches!(self, Self::Degraded { .. })
    }

    /// Shorthand for [`StoreError::Degraded`].
    pub fn degraded(message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Degraded {
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// Shorthand for [`StoreError::Other`] with no source.
    pub fn other(message: impl Into<String>, retryable: bool) -> Self {
        Self::Other {
            message: message.into(),
            retryable,
            source: None,
        }
    }
}

/// A name from configuration that cannot go into SQL is a configuration error.
impl From<crate::ident::InvalidIdent> for StoreError {
    fn from(e: crate::ident::InvalidIdent) -> Self {
        Self::Config(e.to_string())
    }
}

/// Acknowledging, nacking or dead-lettering a delivery failed.
#[derive(Debug, thiserror::Error)]
#[error("broker settlement failed: {message}")]
#[non_exhaustive]
pub struct AckError {
    /// What was being done.
    pub message: String,
    /// Whether a retry can help (a dropped channel cannot be retried: the broker redelivers).
    pub retryable: bool,
    /// The client's error.
    #[source]
    pub source: Option<BoxError>,
    /// The broker's setup refuses the settlement, whatever the message: see
    /// [`AckError::config`].
    config: bool,
}

impl AckError {
    /// A new settlement error.
    pub fn new(message: impl Into<String>, retryable: bool, source: Option<BoxError>) -> Self {
        Self {
            message: message.into(),
            retryable,
            source,
            config: false,
        }
    }

    /// A settlement the broker's setup refuses, so that no delivery like it can be
    /// settled until an operator acts (a dead-letter destination that refuses the dead
    /// letter for good: too small a size limit, a missing permission). Not retryable, and
    /// of [`ErrorClass::Config`]: the consumer stops rather than take the delivery
    /// again and again. The acker that returns it leaves the delivery unsettled, neither
    /// acked nor handed back, so the broker delivers it again after the fix.
    pub fn config(message: impl Into<String>, source: Option<BoxError>) -> Self {
        Self {
            config: true,
            ..Self::new(message, false, source)
        }
    }

    /// Whether a retry can help.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// What the failure means: [`ErrorClass::Config`] for [`AckError::config`], else
    /// transient when retryable, permanent when not.
    pub fn class(&self) -> ErrorClass {
        if self.config {
            ErrorClass::Config
        } else if self.retryable {
            ErrorClass::Transient
        } else {
            ErrorClass::Permanent
        }
    }
}

/// Publishing outbox events to a broker failed.
#[derive(Debug, thiserror::Error)]
#[error("publish failed: {message}")]
#[non_exhaustive]
pub struct PublishError {
    /// What was being done.
    pub message: String,
    /// Whether a retry can help.
    pub retryable: bool,
    /// The client's error.
    #[source]
    pub source: Option<BoxError>,
}

impl PublishError {
    /// A new publish error.
    pub fn new(message: impl Into<String>, retryable: bool, source: Option<BoxError>) -> Self {
        Self {
            message: message.into(),
            retryable,
            source,
        }
    }

    /// Whether a retry can help.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }
}

/// Why a delivery was rejected: bad input that no retry can fix. It is dead-lettered with
/// this reason, never looped and never lost.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {detail}")]
pub struct RejectReason {
    /// A stable, machine-readable code (`not_json`, `missing_field`, `too_large`, …).
    pub code: &'static str,
    /// A human-readable explanation. Never contains the payload.
    pub detail: String,
}

impl RejectReason {
    /// A new reason.
    pub fn new(code: &'static str, detail: impl Into<String>) -> Self {
        Self {
            code,
            detail: detail.into(),
        }
    }
}

impl From<KeyError> for RejectReason {
    fn from(e: KeyError) -> Self {
        Self::new("invalid_identity", e.to_string())
    }
}

/// A handler's failure. The gate rolls the transaction back in every case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// The input is wrong for the business (no retry will fix it): dead-letter it.
    #[error("rejected: {0}")]
    Reject(RejectReason),
    /// A transient failure: nack the delivery so the broker redelivers it.
    #[error("transient: {0}")]
    Transient(#[source] BoxError),
    /// The store failed under the handler's writes.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl HandlerError {
    /// What the failure means for the delivery: see [`ErrorClass`].
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::Reject(_) => ErrorClass::Permanent,
            Self::Transient(_) => ErrorClass::Transient,
            Self::Store(e) => e.class(),
        }
    }

    /// Whether a redelivery can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Reject(_) => false,
            Self::Transient(_) => true,
            Self::Store(e) => e.is_retryable(),
        }
    }
}

/// The crate's umbrella error, for callers that want one type.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// See [`KeyError`].
    #[error(transparent)]
    Key(#[from] KeyError),
    /// See [`StoreError`].
    #[error(transparent)]
    Store(#[from] StoreError),
    /// See [`AckError`].
    #[error(transparent)]
    Ack(#[from] AckError),
    /// See [`PublishError`].
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// See [`HandlerError`].
    #[error(transparent)]
    Handler(#[from] HandlerError),
    /// A consumer's delivery stream failed.
    #[error("delivery stream failed: {0}")]
    Stream(#[source] BoxError),
    /// Waited too long for something (a connection, a lease).
    #[error("timed out after {0:?}")]
    Timeout(Duration),
}

impl Error {
    /// What the failure means for the delivery: see [`ErrorClass`].
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::Key(_) => ErrorClass::Permanent,
            Self::Store(e) => e.class(),
            Self::Handler(e) => e.class(),
            Self::Ack(e) => e.class(),
            other if other.is_retryable() => ErrorClass::Transient,
            _ => ErrorClass::Permanent,
        }
    }

    /// Whether retrying can help.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Key(_) => false,
            Self::Store(e) => e.is_retryable(),
            Self::Ack(e) => e.is_retryable(),
            Self::Publish(e) => e.is_retryable(),
            Self::Handler(e) => e.is_retryable(),
            Self::Stream(_) | Self::Timeout(_) => true,
        }
    }
}
