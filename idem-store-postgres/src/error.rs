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
         is below the floor of {floor} (2 CFR §200.334 keeps records three years); \
         override explicitly to go below it"
    )]
    BelowRetentionFloor {
        /// The requested age.
        older_than: Duration,
        /// The configured floor.
        floor: crate::retention::RetentionFloor,
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

/// The schema name is the one name of [`PgConfig`](crate::PgConfig) (table names are the
/// crate's own).
impl From<idem_core::ident::InvalidIdent> for PgError {
    fn from(e: idem_core::ident::InvalidIdent) -> Self {
        Self::InvalidSchema { name: e.name }
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
/// SQLSTATE `in_failed_sql_transaction` (a statement sent after an earlier one failed).
pub(crate) const IN_FAILED_TRANSACTION: &str = "25P02";
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

/// What a retry can do about an SQLSTATE: the class [`map_sqlx`] turns into a
/// [`StoreError`] variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SqlStateClass {
    /// Another transaction got in the way; running it again can succeed
    /// ([`StoreError::Conflict`]).
    Conflict,
    /// The server will not take this work now, whatever the message: a lock that did not
    /// clear within the lock timeout, a read-only node, a full disk, no memory or
    /// connections left, a shutdown under way ([`StoreError::Degraded`]: never charged to
    /// the message).
    Degraded,
    /// The server, the connection or a session limit failed; retrying later can succeed
    /// ([`StoreError::Unavailable`]).
    Unavailable,
    /// The deployment is wrong (a missing schema, table, column or privilege): retrying
    /// cannot help, and every message would fail the same way ([`StoreError::Config`]).
    Config,
    /// The server refuses *this* message's values for good (bad bytes, a value too long
    /// for its column or index, a constraint): dead-letter it ([`StoreError::Rejected`]).
    Rejected,
    /// Not known: not retried, not dead-lettered as bad input ([`StoreError::Other`]).
    Other,
}

/// The [`SqlStateClass`] of an SQLSTATE code, by what a retry can do:
///
/// | SQLSTATE | class |
/// |---|---|
/// | `40001` serialization failure, `40P01` deadlock | `Conflict` |
/// | `55P03` lock not available (a `lock_timeout`: an operator's `LOCK TABLE`, a long transaction), `25006` read-only transaction (a failover to a standby), `53xxx` resources (a full disk, out of memory or connections), `57P01` admin shutdown, `57P03` cannot connect now | `Degraded` |
/// | `57014` query canceled (a `statement_timeout`), `25P03` idle-in-transaction timeout, `08xxx` connection, other `57P0x`, `58xxx` system errors (`58030` I/O, `58P01` undefined file), `XXxxx` internal errors (`XX000`, `XX001` data corrupted) | `Unavailable` |
/// | `3F000` no schema, `42P01` no table, `42703` no column, `42501` insufficient privilege | `Config` |
/// | `22xxx` data (`22021` bad bytes such as NUL, `22001` string too long, `22P05` untranslatable character), `54xxx` program limits (`54000`, e.g. an index row too big), `23xxx` constraints, other `42xxx` | `Rejected` |
/// | anything else | `Other` |
///
/// `Degraded` is the server's fault whatever the message, and never counts against a
/// delivery's attempts. `Conflict` and `Unavailable` may be either's: the gate counts one
/// against a message only with the store's evidence that it works (its probe commits, and
/// the failure is this message's alone), so a message that always times out or always
/// meets an internal error is dead-lettered after its attempts, with the SQLSTATE, while a
/// store that fails everyone dead-letters nothing.
pub fn classify_sqlstate(code: &str) -> SqlStateClass {
    match code {
        "40001" | "40P01" => SqlStateClass::Conflict,
        LOCK_NOT_AVAILABLE | "25006" | "57P01" | "57P03" => SqlStateClass::Degraded,
        "57014" | "25P03" => SqlStateClass::Unavailable,
        "3F000" | "42P01" | "42703" | "42501" => SqlStateClass::Config,
        c if c.starts_with("53") => SqlStateClass::Degraded,
        c if c.starts_with("08")
            || c.starts_with("57P")
            || c.starts_with("58")
            || c.starts_with("XX") =>
        {
            SqlStateClass::Unavailable
        }
        c if c.starts_with("22")
            || c.starts_with("23")
            || c.starts_with("54")
            || c.starts_with("42") =>
        {
            SqlStateClass::Rejected
        }
        _ => SqlStateClass::Other,
    }
}

/// Maps a driver error to a [`StoreError`]: database errors by their SQLSTATE's
/// [`classify_sqlstate`] class (never by message text), connection-level errors (I/O,
/// TLS, protocol, a pool timeout or a closed pool) as `Unavailable`, a bad URL as
/// `Config`.
pub fn map_sqlx(e: sqlx::Error, what: &str) -> StoreError {
    let message = what.to_owned();
    match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match classify_sqlstate(&code) {
                SqlStateClass::Conflict => StoreError::Conflict {
                    message,
                    source: Some(Box::new(e)),
                },
                SqlStateClass::Unavailable => StoreError::Unavailable {
                    message: format!("{what} (SQLSTATE {code})"),
                    source: Some(Box::new(e)),
                },
                SqlStateClass::Degraded => StoreError::Degraded {
                    message: format!("{what} (SQLSTATE {code})"),
                    source: Some(Box::new(e)),
                },
                // Insufficient privilege, or DDL on a table this role does not own: a
                // deployment mistake that retrying cannot fix.
                SqlStateClass::Config if code == "42501" => StoreError::Config(format!(
                    "{what}: {} (SQLSTATE {code}); this database role lacks the privilege \
                     (see the role layout in docs/operations.md: a least-privilege role runs with \
                     --no-migrate after the schema's owner ran `idem migrate`)",
                    db.message()
                )),
                SqlStateClass::Config => StoreError::Config(format!(
                    "{what}: {} (SQLSTATE {code}); has the schema been migrated?",
                    db.message()
                )),
                SqlStateClass::Rejected => StoreError::Rejected {
                    message: format!("{what} (SQLSTATE {code})"),
                    source: Some(Box::new(e)),
                },
                SqlStateClass::Other => StoreError::Other {
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

    /// The whole table, by what a retry can do; each row is a case a mapping change
    /// could break.
    #[test]
    fn sqlstates_are_classified_by_what_a_retry_can_do() {
        use SqlStateClass::*;
        let table = [
            ("40001", Conflict),    // serialization_failure
            ("40P01", Conflict),    // deadlock_detected
            ("55P03", Degraded),    // lock_not_available (lock_timeout)
            ("57014", Unavailable), // query_canceled (statement_timeout)
            ("25006", Degraded),    // read_only_sql_transaction (failed over to a standby)
            ("25P03", Unavailable), // idle_in_transaction_session_timeout
            ("08006", Unavailable), // connection_failure
            ("08001", Unavailable), // sqlclient_unable_to_establish_sqlconnection
            ("57P01", Degraded),    // admin_shutdown
            ("57P02", Unavailable), // crash_shutdown (a backend died: this message's?)
            ("57P03", Degraded),    // cannot_connect_now
            ("53300", Degraded),    // too_many_connections
            ("53100", Degraded),    // disk_full
            ("53200", Degraded),    // out_of_memory
            ("58030", Unavailable), // io_error
            ("58P01", Unavailable), // undefined_file
            ("XX000", Unavailable), // internal_error
            ("XX001", Unavailable), // data_corrupted
            ("3F000", Config),      // invalid_schema_name
            ("42P01", Config),      // undefined_table
            ("42703", Config),      // undefined_column
            ("42501", Config),      // insufficient_privilege
            ("22021", Rejected),    // character_not_in_repertoire (NUL in text)
            ("22001", Rejected),    // string_data_right_truncation
            ("22P05", Rejected),    // untranslatable_character
            ("22003", Rejected),    // numeric_value_out_of_range
            ("54000", Rejected),    // program_limit_exceeded (index row too big)
            ("23502", Rejected),    // not_null_violation
            ("23505", Rejected),    // unique_violation (not the claim's: it uses ON CONFLICT)
            ("42601", Rejected),    // syntax_error
            ("IDEM1", Other),       // the append-only trigger
            ("", Other),
        ];
        for (code, class) in table {
            assert_eq!(classify_sqlstate(code), class, "SQLSTATE {code:?}");
        }
        // And through map_sqlx: the variant, hence what the gate does with it.
        for (code, class) in table {
            let e = map_sqlx(fake(code), "claim");
            let ok = match class {
                Conflict => matches!(e, StoreError::Conflict { .. }) && e.is_retryable(),
                Unavailable => matches!(e, StoreError::Unavailable { .. }) && e.is_retryable(),
                Degraded => e.is_degraded() && e.is_retryable(),
                Config => matches!(e, StoreError::Config(_)) && !e.is_retryable(),
                Rejected => matches!(e, StoreError::Rejected { .. }) && !e.is_retryable(),
                Other => matches!(e, StoreError::Other { .. }) && !e.is_retryable(),
            };
            assert!(ok, "SQLSTATE {code:?} → {e:?}");
        }
    }

    /// A database error carrying `code`, as the driver would return it.
    fn fake(code: &str) -> sqlx::Error {
        #[derive(Debug)]
        struct Fake(String);
        impl std::fmt::Display for Fake {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "fake error {}", self.0)
            }
        }
        impl std::error::Error for Fake {}
        impl sqlx::error::DatabaseError for Fake {
            fn message(&self) -> &str {
                "fake"
            }
            fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
                Some(std::borrow::Cow::Borrowed(&self.0))
            }
            fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
                self
            }
            fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
                self
            }
            fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
                self
            }
            fn kind(&self) -> sqlx::error::ErrorKind {
                sqlx::error::ErrorKind::Other
            }
        }
        sqlx::Error::Database(Box::new(Fake(code.to_owned())))
    }

    #[test]
    fn floor_error_is_not_retryable() {
        let e = PgError::BelowRetentionFloor {
            older_than: Duration::from_secs(1),
            floor: Duration::from_secs(2).into(),
        };
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("floor"));
    }
}
