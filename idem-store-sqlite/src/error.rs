//! Errors: [`SqliteError`] for configuration, retention, inspection and export, and the
//! mapping of sqlx's errors to [`StoreError`] by SQLite result code — never by message text.

use idem_core::StoreError;

/// SQLite's primary result codes we tell apart (the extended code's low byte).
const SQLITE_BUSY: u32 = 5;
const SQLITE_LOCKED: u32 = 6;
const SQLITE_CONSTRAINT: u32 = 19;

/// Maps a sqlx error raised while doing `what`.
pub(crate) fn map(what: &str, e: sqlx::Error) -> StoreError {
    let message = what.to_owned();
    match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().and_then(|c| c.parse::<u32>().ok()).unwrap_or(0);
            match code & 0xff {
                SQLITE_BUSY | SQLITE_LOCKED => StoreError::Conflict {
                    message,
                    source: Some(Box::new(e)),
                },
                SQLITE_CONSTRAINT => StoreError::Rejected {
                    message,
                    source: Some(Box::new(e)),
                },
                _ => StoreError::Other {
                    message,
                    retryable: false,
                    source: Some(Box::new(e)),
                },
            }
        }
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => {
            StoreError::Unavailable {
                message,
                source: Some(Box::new(e)),
            }
        }
        _ => StoreError::Other {
            message,
            retryable: false,
            source: Some(Box::new(e)),
        },
    }
}

/// An error of this crate's own operations beyond the claim path (configuration,
/// [`purge`](crate::SqliteStore::purge), [`inspect_key`](crate::SqliteStore::inspect_key),
/// [`export_audit`](crate::SqliteStore::export_audit)), as `idem_store_postgres::PgError`
/// is for Postgres. The claim path uses [`idem_core::StoreError`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqliteError {
    /// An option is out of range (a path that is empty, a page size, …).
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// A table or column name from configuration is not a plain SQL identifier
    /// ([`Ident::new`](idem_core::ident::Ident::new)).
    #[error(transparent)]
    InvalidName(#[from] idem_core::ident::InvalidIdent),
    /// A purge asked to delete records younger than the retention floor without
    /// [`allow_below_floor`](idem_core::retention::PurgeOptions::allow_below_floor).
    #[error(
        "refusing to purge records younger than the retention floor: --older-than {older_than:?} \
         is below the floor of {floor} (2 CFR §200.334 keeps records three years); \
         override explicitly to go below it"
    )]
    BelowRetentionFloor {
        /// The requested age.
        older_than: std::time::Duration,
        /// The configured floor.
        floor: idem_core::retention::RetentionFloor,
    },
    /// A timestamp argument is not RFC 3339 (or a bare date).
    #[error("{name} {value:?} is not an RFC 3339 timestamp (e.g. 2026-07-01T00:00:00Z)")]
    InvalidTimestamp {
        /// Which argument (`since`, `until`, …).
        name: &'static str,
        /// The rejected value (at most 80 characters of it).
        value: String,
    },
    /// The sink of [`export_audit`](crate::SqliteStore::export_audit) failed (for example
    /// the output file could not be written).
    #[error("writing the audit export failed: {0}")]
    Sink(#[source] std::io::Error),
    /// The database failed; see [`StoreError::is_retryable`].
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl SqliteError {
    /// Whether running the same operation again can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Store(e) => e.is_retryable(),
            Self::InvalidOption(_)
            | Self::InvalidName(_)
            | Self::BelowRetentionFloor { .. }
            | Self::InvalidTimestamp { .. }
            | Self::Sink(_) => false,
        }
    }

    /// A timestamp argument that is not RFC 3339.
    pub(crate) fn timestamp(name: &'static str, value: &str) -> Self {
        Self::InvalidTimestamp {
            name,
            value: value.chars().take(80).collect(),
        }
    }
}

impl From<SqliteError> for StoreError {
    fn from(e: SqliteError) -> Self {
        match e {
            SqliteError::Store(s) => s,
            other => StoreError::Config(other.to_string()),
        }
    }
}
