//! Errors: [`SqliteError`] for configuration, retention, inspection and export, and the
//! mapping of sqlx's errors to [`StoreError`] by SQLite result code — never by message text.

use idem_core::StoreError;

/// SQLite's primary result codes we tell apart (the extended code's low byte).
const SQLITE_BUSY: u32 = 5;
const SQLITE_LOCKED: u32 = 6;
const SQLITE_NOMEM: u32 = 7;
const SQLITE_READONLY: u32 = 8;
const SQLITE_IOERR: u32 = 10;
const SQLITE_CORRUPT: u32 = 11;
const SQLITE_FULL: u32 = 13;
const SQLITE_CANTOPEN: u32 = 14;
const SQLITE_PROTOCOL: u32 = 15;
const SQLITE_TOOBIG: u32 = 18;
const SQLITE_CONSTRAINT: u32 = 19;
const SQLITE_MISMATCH: u32 = 20;
const SQLITE_NOLFS: u32 = 22;
const SQLITE_RANGE: u32 = 25;
const SQLITE_NOTADB: u32 = 26;

/// Maps a sqlx error raised while doing `what`, by whose fault it is:
///
/// | result code | class |
/// |---|---|
/// | `BUSY`, `LOCKED`, `FULL`, `READONLY`, `NOMEM` | [`StoreError::Degraded`]: a lock another writer held past the busy timeout, a full disk, a read-only file, no memory: the store's fault whatever the message, never counted against it; retry |
/// | `IOERR`, `CORRUPT`, `CANTOPEN`, `PROTOCOL`, `NOLFS`, `NOTADB` | [`StoreError::Unavailable`]: the file, its disk or the machine failed; counted against a message only with the store's evidence that it works for others (the gate's probe) |
/// | `CONSTRAINT`, `TOOBIG`, `MISMATCH`, `RANGE` | [`StoreError::Rejected`]: this message's values, for good |
/// | anything else | [`StoreError::Other`], not retryable |
pub(crate) fn map(what: &str, e: sqlx::Error) -> StoreError {
    let message = what.to_owned();
    // The primary result code of a database error; 0 (SQLITE_OK, never a failure's) for
    // the driver's own errors.
    let code = match &e {
        sqlx::Error::Database(db) => {
            db.code().and_then(|c| c.parse::<u32>().ok()).unwrap_or(0) & 0xff
        }
        _ => 0,
    };
    let unreachable = matches!(
        e,
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_)
    );
    match code {
        SQLITE_BUSY | SQLITE_LOCKED | SQLITE_FULL | SQLITE_READONLY | SQLITE_NOMEM => {
            StoreError::degraded(message, e)
        }
        SQLITE_IOERR | SQLITE_CORRUPT | SQLITE_CANTOPEN | SQLITE_PROTOCOL | SQLITE_NOLFS
        | SQLITE_NOTADB => StoreError::unavailable(message, e),
        _ if unreachable => StoreError::unavailable(message, e),
        SQLITE_CONSTRAINT | SQLITE_TOOBIG | SQLITE_MISMATCH | SQLITE_RANGE => {
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

/// Maps the driver error of a handler's own statement in the claim's transaction (a
/// business write) to a [`StoreError`], by SQLite result code exactly as the store maps
/// its own (see the table above). A handler should use it rather than a blanket
/// non-retryable error: a full disk is then the store's fault (nothing is dead-lettered
/// for it), and only a value the schema refuses dead-letters its message.
///
/// ```
/// # async fn write(tx: &mut idem_store_sqlite::SqliteTx) -> Result<(), idem_core::StoreError> {
/// sqlx::query("INSERT INTO ledger (award_id) VALUES (?)")
///     .bind("A-1")
///     .execute(tx.conn())
///     .await
///     .map_err(|e| idem_store_sqlite::map_sqlx(e, "record the award"))?;
/// # Ok(()) }
/// ```
pub fn map_sqlx(e: sqlx::Error, what: &str) -> StoreError {
    map(what, e)
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
