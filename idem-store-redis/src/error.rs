//! Errors of this crate, and how they map onto [`idem_core::StoreError`].

use std::time::Duration;

use idem_core::{BoxError, StoreError};

/// Something went wrong talking to Redis.
///
/// Every variant says whether retrying can help ([`RedisError::is_retryable`]); the
/// conversion into [`StoreError`] keeps that judgement and the source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// The configuration is invalid (a bad URL, key prefix or duration). Never retryable.
    #[error("invalid Redis configuration: {0}")]
    Config(String),
    /// The server could not be reached, or the connection broke. Retryable.
    #[error("Redis unavailable while trying to {action}")]
    Unavailable {
        /// What was being done.
        action: &'static str,
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// A command did not answer within the configured timeout. Retryable.
    #[error("Redis did not answer within {timeout:?} while trying to {action}")]
    Timeout {
        /// What was being done.
        action: &'static str,
        /// The per-command timeout.
        timeout: Duration,
    },
    /// The server refused a command (a wrong type, a script error, a cluster that cannot
    /// route it). Not retryable.
    #[error("Redis refused the command while trying to {action}")]
    Refused {
        /// What was being done.
        action: &'static str,
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// The server answered something this crate does not expect (another program writes
    /// under our key prefix?). Not retryable.
    #[error("unexpected reply from Redis while trying to {action}: {detail}")]
    UnexpectedReply {
        /// What was being done.
        action: &'static str,
        /// What was wrong with the reply.
        detail: String,
    },
    /// The lease of a claimed key expired and another worker now holds the key: this
    /// transaction no longer owns it and its commit is refused. Retryable (the
    /// redelivery will find the other worker's outcome).
    #[error("the lease on {key} was lost to another worker")]
    LeaseLost {
        /// The 12-character key prefix.
        key: String,
    },
}

impl RedisError {
    /// Whether running the same operation again can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Unavailable { .. } | Self::Timeout { .. } | Self::LeaseLost { .. } => true,
            Self::Config(_) | Self::Refused { .. } | Self::UnexpectedReply { .. } => false,
        }
    }
}

impl From<RedisError> for StoreError {
    fn from(e: RedisError) -> Self {
        match e {
            RedisError::Config(m) => StoreError::Config(m),
            e @ (RedisError::Unavailable { .. } | RedisError::Timeout { .. }) => {
                StoreError::Unavailable {
                    message: e.to_string(),
                    source: Some(Box::new(e)),
                }
            }
            e @ RedisError::LeaseLost { .. } => StoreError::Conflict {
                message: e.to_string(),
                source: Some(Box::new(e)),
            },
            e @ (RedisError::Refused { .. } | RedisError::UnexpectedReply { .. }) => {
                StoreError::Rejected {
                    message: e.to_string(),
                    source: Some(Box::new(e)),
                }
            }
        }
    }
}
