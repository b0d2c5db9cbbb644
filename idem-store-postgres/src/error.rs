//! Errors: [`PgError`] for configuration, retention and inspection, and the mapping of
//! driver errors to [`idem_core::StoreError`] by SQLSTATE (never by message text).

use std::time::Duration;

use idem_core::StoreError;

/// An error of this crate's own operations (configuration, [`purge`](crate::PgStore::purge),
/// [`inspect_key`](crate::PgStore::inspect_key)). The claim path uses
/// [`idem_core::StoreError`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgError {
    /// The schema name is not an SQL identifier (`^[A-Za-z_][A-Za-z0-9_]{0,62}$`).
    #[error("invalid schema name {name:?}: expected ^[A-Za-z_][A-Za-z0-9_]{{0,62}}$")]
    InvalidSchema {
        /// The rejected name (at most 80 characters of it).
        name: String,
    },
    /// Another option is out of range.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// A purge asked to delete records younger than the retention floor without
    /// [`allow_below_floor`](crate::PurgeOptions::allow_below_floor).
    #[error(
        "refusing to purge records younger than the retention floor: --older-than {older_than:?} \
         is below the floor of {floor:?} (2 CFR §200.334 keeps records three years); \
         override explicitly to go below it"
    )]
    BelowRetentionFloor {
        /// The requested age.
        older_than: Duration,
        /// The configured floor.
        floor: Duration,
    },
    /// A timestamp argument was rejected by the server (SQLSTATE class 22, e.g. not a
    /// valid `timestamptz`).
    #[error("invalid timestamp {value:?}: {reason}")]
    InvalidTimestamp {
        /// The rejected value (at most 80 characters of it).
        value: String,
        /// The server's reason.
        reason: String,
    },
    /// The sink of [`export_audit`](crate::PgStore::export_audit) failed (for example
    /// the output file could not be written).
    #[error("writing the audit export failed: {0}")]
    Sink(#[source] std::io::Error),
    /// The database failed; see [`StoreError::is_retryable`].
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl PgError {
    /// Whether running the same operation again can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::InvalidSchema { .. }
            | Self::InvalidOption(_)
            | Self::BelowRetentionFloor { .. }
            | Self::InvalidTimestamp { .. }
            | Self::Sink(_) => false,
            Self::Store(e) => e.is_retryable(),
        }
    }
}

impl From<PgError> for StoreError {
    fn from(e: PgError) -> Self {
        match e {
            PgError::Store(s) => s,
            other => StoreError::Config(other.to_string()),
        }
    }
}

impl From<sqlx::Error> for PgError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(map_sqlx(e, "database operation"))
    }
}

/// SQLSTATE `unique_violation`.
pub(crate) const UNIQUE_VIOLATION: &str = "23505";
/// SQLSTATE `lock_not_available` (a `lock_timeout` expired).
pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// The SQLSTATE of a database error, if it is one.
pub fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Whether `e` is a unique violation (SQLSTATE 23505).
pub fn is_unique_violation(e: &sqlx::Error) -> bool {
    sqlstate(e).as_deref() == Some(UNIQUE_VIOLATION)
}

/// Maps a driver error to a [`StoreError`] by SQLSTATE class:
///
/// | SQLSTATE / error | [`StoreError`] |
/// |---|---|
/// | `40001` serialization failure, `40P01` deadlock, `55P03` lock not available | `Conflict` |
/// | `08xxx` connection, `57P0x` shutdown, `53xxx` resources, I/O, TLS, pool timeout or closed | `Unavailable` |
/// | `3F000` no schema, `42P01` no table, `42703` no column | `Config` (run the migration) |
/// | `42501` insufficient privilege (or DDL on another role's table) | `Config` (grant, or `--no-migrate`) |
/// | `23xxx` constraints (including `23505`), `22xxx` data, other `42xxx` | `Rejected` |
/// | anything else | `Other`, not retryable |
pub fn map_sqlx(e: sqlx::Error, what: &str) -> StoreError {
    let message = what.to_owned();
    match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match code.as_str() {
                "40001" | "40P01" | LOCK_NOT_AVAILABLE => StoreError::Conflict {
                    message,
                    source: Some(Box::new(e)),
                },
                "3F000" | "42P01" | "42703" => StoreError::Config(format!(
                    "{what}: {} (SQLSTATE {code}); has the schema been migrated?",
                    db.message()
                )),
                // Insufficient privilege, or DDL on a table this role does not own: a
                // deployment mistake that retrying cannot fix.
                "42501" => StoreError::Config(format!(
                    "{what}: {} (SQLSTATE {code}); this database role lacks the privilege \
                     (see the role layout in README: a least-privilege role runs with \
                     --no-migrate after the schema's owner ran `idem migrate`)",
                    db.message()
                )),
                c if c.starts_with("08")
                    || c.starts_with("53")
                    || c.starts_with("57P")
                    || c == "58030" =>
                {
                    StoreError::Unavailable {
                        message,
                        source: Some(Box::new(e)),
                    }
                }
                c if c.starts_with("23") || c.starts_with("22") || c.starts_with("42") => {
                    StoreError::Rejected {
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
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => StoreError::Unavailable {
            message,
            source: Some(Box::new(e)),
        },
        sqlx::Error::Configuration(_) => StoreError::Config(format!("{what}: {e}")),
        _ => StoreError::Other {
            message,
            retryable: false,
            source: Some(Box::new(e)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_timeout_is_unavailable_and_retryable() {
        let e = map_sqlx(sqlx::Error::PoolTimedOut, "begin");
        assert!(matches!(e, StoreError::Unavailable { .. }), "{e:?}");
        assert!(e.is_retryable());
    }

    #[test]
    fn configuration_errors_are_not_retryable() {
        let e = map_sqlx(sqlx::Error::Configuration("bad url".into()), "connect");
        assert!(matches!(e, StoreError::Config(_)), "{e:?}");
        assert!(!e.is_retryable());
    }

    #[test]
    fn floor_error_is_not_retryable() {
        let e = PgError::BelowRetentionFloor {
            older_than: Duration::from_secs(1),
            floor: Duration::from_secs(2),
        };
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("floor"));
    }
}
