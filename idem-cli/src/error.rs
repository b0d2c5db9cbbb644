//! The command's errors: bad input exits 2, a failure exits 1.

use idem_engine::StoreError;

/// A command's failure.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    /// Bad input (arguments, files, URLs): exit status 2.
    #[error("{0}")]
    Usage(String),
    /// The run failed (a store or broker error, a violated check): exit status 1.
    #[error("{0}")]
    Failed(String),
}

impl CliError {
    pub(crate) fn usage(msg: impl Into<String>) -> Self {
        Self::Usage(msg.into())
    }

    pub(crate) fn failed(msg: impl Into<String>) -> Self {
        Self::Failed(msg.into())
    }

    pub(crate) fn exit_code(&self) -> i32 {
        match self {
            Self::Usage(_) => 2,
            Self::Failed(_) => 1,
        }
    }
}

impl From<StoreError> for CliError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Config(m) => Self::Usage(m),
            other => Self::Failed(error_chain(&other)),
        }
    }
}

/// A name from the command line (a schema, a table, a column) that cannot go into SQL
/// is bad input: its message names it.
impl From<idem_engine::ident::InvalidIdent> for CliError {
    fn from(e: idem_engine::ident::InvalidIdent) -> Self {
        Self::Usage(e.to_string())
    }
}

#[cfg(feature = "postgres")]
impl From<idem_store_postgres::PgError> for CliError {
    fn from(e: idem_store_postgres::PgError) -> Self {
        use idem_store_postgres::PgError as E;
        match e {
            E::Store(s) => s.into(),
            E::BelowRetentionFloor { .. }
            | E::InvalidOption(_)
            | E::InvalidSchema { .. }
            | E::InvalidTimestamp { .. } => Self::Usage(e.to_string()),
            other => Self::Failed(error_chain(&other)),
        }
    }
}

impl From<idem_store_sqlite::SqliteError> for CliError {
    fn from(e: idem_store_sqlite::SqliteError) -> Self {
        use idem_store_sqlite::SqliteError as E;
        match e {
            E::Store(s) => s.into(),
            E::BelowRetentionFloor { .. }
            | E::InvalidOption(_)
            | E::InvalidName(_)
            | E::InvalidTimestamp { .. } => Self::Usage(e.to_string()),
            other => Self::Failed(error_chain(&other)),
        }
    }
}

/// An error and its sources on one line (`idem-core`'s, as the relay stores them).
pub(crate) use idem_engine::error::error_chain;
