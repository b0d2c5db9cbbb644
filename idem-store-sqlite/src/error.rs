//! Mapping sqlx's errors to [`StoreError`], by SQLite result code — never by message text.

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
